"""A 16-bit checkpoint tensor kept in 16 bits: an AWQ / GPTQ checkpoint's embedding (and LM head)
beside its 4-bit projections. In float32 the embedding alone would take more memory than every
projection's share of it (SmolLM2-1.7B: 0.39 GiB against 0.84 GiB of 4-bit projections); its rows
are widened as tokens need them, which is exact."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.mapped_files import read_rows, release_pages
from pagellm.quantization.quant_blocks import QuantizedBlocks

HALF_TYPES = {torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class Rows16(QuantizedBlocks):
    """``rows [N, K]`` in float16 or bfloat16, as the checkpoint stores them."""

    rows: torch.Tensor

    row_lookup = True

    @property
    def shape(self) -> tuple[int, int]:  # type: ignore[override]
        return tuple(self.rows.shape)  # type: ignore[return-value]

    @property
    def type_name(self) -> str:
        return HALF_TYPES[self.rows.dtype]

    def kernel_format(self) -> int | None:
        return None  # (the LM head built from it is quantized to Q8_0 first: ``Linear.quantize_to_q8_0``)

    def int8_fields(self) -> tuple[np.ndarray, ...]:
        raise TypeError("16-bit rows have no int8 kernel fields")

    def take(self, lo: int, hi: int) -> Rows16:
        return Rows16(self.rows[lo:hi])

    def dequantize(self) -> torch.Tensor:
        return self.rows.float()

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        unique, inverse = torch.unique(ids, return_inverse=True)
        rows = read_rows(self.rows, unique.tolist())  # (rows mapped from the file: read, not mapped)
        if rows is None:
            return F.embedding(ids, self.rows).float()
        return F.embedding(inverse, rows).float()

    def release(self) -> None:
        release_pages(self.rows)  # (the pages packing read; a lookup reads its rows without mapping any)
