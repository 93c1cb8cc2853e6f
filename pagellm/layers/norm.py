"""RMSNorm with an optional fused residual add (HF's arithmetic, so outputs match it exactly)."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels import cpu_ops
from pagellm.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """``weight * x / sqrt(mean(x^2) + eps)`` computed in float32, as Hugging Face Llama does.

    Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_cpu(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """One pass instead of seven, ``residual`` updated in place (the decoder owns it), and the
        result written over ``x`` (as vLLM's fused add-norm: the sublayer's output is consumed, and a
        2,048-token step holds one hidden-sized tensor fewer). A per-head norm (Qwen3's q/k norm:
        3-D, heads contiguous) reads the qkv output in place."""
        if x.dim() == 3 and residual is None and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            return cpu_ops.rms_norm_heads(x, self.weight, self.eps)
        if x.dim() != 2:
            return self.forward_native(x, residual)
        if residual is None:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        out = x if x.dtype == torch.float32 and x.stride() == (x.shape[1], 1) else None
        return cpu_ops.rms_norm(x, self.weight, self.eps, residual, out), residual

    def forward_cuda(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """One kernel (the add, the norm, the weight), ``residual`` updated in place as on the CPU."""
        from pagellm.kernels import triton_ops

        if x.dim() not in (2, 3) or (residual is not None and (x.dim() != 2 or residual.stride(1) != 1)):
            return self.forward_native(x, residual)
        if residual is None:
            return triton_ops.rms_norm(x, self.weight, self.eps)
        return triton_ops.rms_norm(x, self.weight, self.eps, residual), residual
