"""Gated MLP activations over a fused ``[gate | up]`` projection output: SwiGLU's ``silu(gate) * up``,
GeGLU's ``gelu_tanh(gate) * up`` (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.kernels import cpu_ops
from pagellm.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """``gate_up [T, 2I]`` -> ``silu(gate) * up`` ``[T, I]``."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_ops.silu_and_mul(gate_up)

    def forward_cuda(self, gate_up: torch.Tensor) -> torch.Tensor:
        from pagellm.kernels import triton_ops

        return triton_ops.act_and_mul(gate_up)


class GeluTanhAndMul(CustomOp):
    """``gate_up [T, 2I]`` -> ``gelu(gate, approximate="tanh") * up`` ``[T, I]`` (HF's
    ``gelu_pytorch_tanh``)."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def forward_cpu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_ops.gelu_tanh_and_mul(gate_up)

    def forward_cuda(self, gate_up: torch.Tensor) -> torch.Tensor:
        from pagellm.kernels import triton_ops

        return triton_ops.act_and_mul(gate_up, gelu=True)


def gated_activation(config: object) -> CustomOp:
    """The MLP's activation named by an HF config (``hidden_activation`` where set, as Gemma's are,
    else ``hidden_act``); a name with no implementation here is refused."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if name == "silu":
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return GeluTanhAndMul()
    raise ValueError(f"MLP activation {name!r} is not supported (supported: silu, gelu_pytorch_tanh)")
