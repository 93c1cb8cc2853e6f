"""SwiGLU's activation: ``silu(gate) * up`` over a fused ``[gate | up]`` projection output."""

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
