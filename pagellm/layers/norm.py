"""RMSNorm with an optional fused residual add (HF's arithmetic, so outputs match it exactly)."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels import cpu_ops


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` computed in float32, as Hugging Face Llama does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``.

        On CPU float32 2-D inputs the fused kernel does it in one pass and updates ``residual``
        in place (the decoder owns it), instead of seven PyTorch passes.
        """
        if x.dim() == 2 and cpu_ops.usable(x):
            if residual is None:
                return cpu_ops.rms_norm(x, self.weight, self.eps)
            return cpu_ops.rms_norm(x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
