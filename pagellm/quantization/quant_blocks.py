"""A quantized checkpoint's projection kept at its stored width until the numerics are chosen.

Each checkpoint format has its own reader (``gguf_quant.GGUFBlocks`` for a GGUF file's bytes,
``group_quant.GroupQuantBlocks`` for AWQ / GPTQ / compressed-tensors' packed integers); the model
and its layers see only this interface: the kernel format the int8 GEMM packs it in, the integer
fields it packs from, and an exact float32 dequantization for every other kernel.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from pagellm.kernels.gemm_int8 import PARTS


class QuantizedBlocks:
    """One 2-D weight ``[N, K]`` (PyTorch's order) as its checkpoint stores it."""

    shape: tuple[int, int]
    row_lookup = False  # whether an embedding reads its rows from it (:meth:`gather_rows`)

    @property
    def type_name(self) -> str:
        """The stored type as the start-up ``numerics:`` line names it (``Q4_K``, ``AWQ int4 g128``)."""
        raise NotImplementedError

    @property
    def packed_name(self) -> str:
        """The type as the ``numerics:`` line names it where the int8 kernel takes it (where packing
        changes the values, it says so)."""
        return self.type_name

    def kernel_format(self) -> int | None:
        """The int8 kernel format these blocks pack into at their width (``None``: none)."""
        raise NotImplementedError

    def int8_fields(self) -> tuple[np.ndarray, ...]:
        """The fields ``gemm_int8.pack_blocks`` (legacy formats) or ``pack_kquant`` (K4 / K6) takes."""
        raise NotImplementedError

    def input_order(self) -> np.ndarray | None:
        """The order of the inputs in which the kernel takes these blocks, where not their stored one
        (GPTQ's act-order: the activations are permuted alike); ``None`` for the stored order."""
        return None

    def in_input_order(self, order: np.ndarray) -> QuantizedBlocks:
        """These blocks with their inputs in ``order`` (as :meth:`input_order` gives it)."""
        raise NotImplementedError

    def packing_format(self) -> int | None:
        """:meth:`kernel_format` in :meth:`input_order`: the format the blocks pack into."""
        order = self.input_order()
        return (self if order is None else self.in_input_order(order)).kernel_format()

    def take(self, lo: int, hi: int) -> QuantizedBlocks:
        """Outputs ``lo .. hi`` (only these read)."""
        raise NotImplementedError

    def take_inputs(self, lo: int, hi: int) -> QuantizedBlocks | None:
        """Inputs ``lo .. hi`` (a row-parallel rank's share), where the stored blocks split there;
        ``None`` where the range cuts through a block (or the format cannot split its inputs)."""
        return None

    def shard(self, dim: int, start: int, size: int) -> QuantizedBlocks:
        """A tensor-parallel rank's share, as ``copy_shard`` cuts a float weight: outputs (``dim`` 0)
        or inputs (1) ``start .. start + size``; ``self`` where that is the whole tensor, and
        ``CutThrough`` (dequantized) where the inputs' range cuts through the stored blocks."""
        if (start, size) == (0, self.shape[dim]):
            return self
        if dim == 0:
            return self.take(start, start + size)
        return self.take_inputs(start, start + size) or CutThrough(self, start, start + size)

    def dequantize(self) -> torch.Tensor:
        """The weight in float32 (a new tensor): every stored value exactly."""
        raise NotImplementedError

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [...]`` -> their rows in float32 ``[..., K]`` (an embedding lookup; see ``row_lookup``)."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop what this process holds of the checkpoint's pages once packed (nothing by default)."""


def combined_format(formats: Iterable[int | None]) -> int | None:
    """The kernel format of a projection whose parts (a fused one's tensors, in order) pack into
    ``formats``: the common one, ``PARTS`` where they differ (each run of parts in its own format),
    or ``None`` if a part has none."""
    found = set(formats)
    if not found or None in found:
        return None
    return found.pop() if len(found) == 1 else PARTS


class CutThrough(QuantizedBlocks):
    """Inputs ``lo .. hi`` of ``blocks`` where that range cuts through its blocks (a row-parallel
    rank's share of a K-quant's 256-value super-blocks cut at 128): no kernel format, dequantized
    (the ``numerics:`` line counts it under its own name)."""

    def __init__(self, blocks: QuantizedBlocks, lo: int, hi: int) -> None:
        self.blocks, self.lo, self.hi = blocks, lo, hi
        self.shape = (blocks.shape[0], hi - lo)

    @property
    def type_name(self) -> str:
        return f"{self.blocks.type_name} (this rank's share cuts its blocks)"

    def kernel_format(self) -> int | None:
        return None

    def take(self, lo: int, hi: int) -> CutThrough:
        return CutThrough(self.blocks.take(lo, hi), self.lo, self.hi)

    def dequantize(self) -> torch.Tensor:
        return self.blocks.dequantize()[:, self.lo:self.hi].contiguous()

    def release(self) -> None:
        self.blocks.release()
