"""``Linear``: ``nn.Linear`` whose weight is repacked after loading for the CPU GEMM kernel.

``F.linear`` on a CPU calls MKL's sgemm, which re-packs the weight on every call; at decode
batch sizes that is a large share of the work. :meth:`Linear.pack_for_cpu` packs the weight once
(``kernels/gemm.py``) and the packed copy replaces it, so memory does not grow. Without the
kernel (no AVX-512 or compiler, ``PAGELLM_CPU_KERNELS=0``, a GPU, bfloat16) nothing is packed
and ``F.linear`` runs as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels import gemm


class Linear(nn.Linear):
    """``nn.Linear`` with an optional packed weight (inference only)."""

    packed: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("packed", None, persistent=False)

    def pack_for_cpu(self) -> bool:
        """Pack the loaded weight for the GEMM kernel if it can run here; ``True`` if packed."""
        if self.packed is not None:
            return True
        if self.weight is None or not gemm.usable(self.weight):
            return False
        self.packed = gemm.pack(self.weight)
        # Nothing reads the row-major weight any more: drop it rather than hold the layer twice.
        self.register_parameter("weight", None)
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)``, through the kernel once packed."""
        if self.packed is not None:
            return gemm.linear(x, self.packed, self.out_features, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)
