"""A linear layer with its weight pre-packed for oneDNN's CPU GEMM.

``F.linear`` on a CPU calls MKL's sgemm, which re-packs the weight matrix on every call. For the
LM head (49k x 576 for SmolLM2) at decode batch sizes that packing is a large share of the work:
oneDNN's inner product over a weight reordered once, at load time (the path ``torch.compile``
takes with weight freezing), ran 1.2-2.5x faster at 8-128 rows. For the layers' smaller
projections it measured no faster, so they stay on ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import nn


def packing_supported(weight: torch.Tensor) -> bool:
    """Whether oneDNN can take this weight: a float32 CPU tensor on a torch build with mkldnn."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``y = x W^T`` for ``x [N, in_features]``, with ``W`` held in oneDNN's blocked layout (not a
    Parameter: inference only; no bias, as no supported LM head has one)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch-size hint only picks the blocking; any number of rows works afterwards.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
