"""Linear layers with weights pre-packed for oneDNN's CPU GEMM.

``F.linear`` on a CPU calls MKL's sgemm, which re-packs the weight matrix into its blocked layout
on every call. At decode batch sizes (a few to 64 rows) that packing is a large share of the
work; oneDNN's inner-product primitive over a weight reordered once, at load time, into its
blocked layout (the path ``torch.compile`` takes with weight freezing) runs 1.2-1.5x faster
there and as fast at prefill sizes (``benchmarks/roofline.py`` prints both).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def packing_supported(weight: torch.Tensor) -> bool:
    """Whether oneDNN can take this weight: a float32 CPU tensor on a torch build with mkldnn."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in oneDNN's blocked layout (not a Parameter: inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch-size hint only picks the blocking; any number of rows works afterwards.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 64)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not x.is_contiguous():
            x = x.reshape(-1, self.in_features).contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a :class:`PackedLinear` (dropping the plain
    weight); returns how many were packed. Call after the weights are loaded."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and packing_supported(child.weight):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                count += 1
    return count
