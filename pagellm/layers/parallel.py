"""Tensor-parallel linear and embedding layers (Megatron's split, as vLLM does it).

Each rank holds a slice of the weight and ``weight_loader`` cuts that slice out of the full
checkpoint tensor, so a rank's parameters are only its shard::

    ColumnParallelLinear   W[out, in]  split by rows (output features); fused layers (qkv,
                           gate/up) split each part separately, so every rank gets whole heads
    RowParallelLinear      W[out, in]  split by columns; partial outputs are summed (all-reduce)
    VocabParallelEmbedding E[vocab, d] split by rows; tokens outside a rank's rows give zeros,
                           then an all-reduce (exact: one non-zero addend per token)

With a group of size 1 each is a plain ``Linear`` (``layers/linear.py``) / ``nn.Embedding``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed import TensorParallelGroup, shard_range
from pagellm.layers.linear import Linear
from pagellm.quantization.quant_blocks import QuantizedBlocks


class ColumnParallelLinear(Linear):
    """Output features split across ranks. ``parts`` lists, per fused part (q, k, v or gate, up),
    this rank's ``(start, size)`` inside that part of the full weight."""

    def __init__(self, input_size: int, parts: list[tuple[int, int]], bias: bool,
                 full_sizes: list[int] | None = None) -> None:
        super().__init__(input_size, sum(size for _, size in parts), bias=bias)
        self.parts = parts
        # Each part's size in the full weight: a checkpoint that stores the layer fused (Phi-3's
        # qkv_proj, gate_up_proj) is cut into its parts by these.
        self.full_sizes = full_sizes

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, part: int | None) -> None:
        """Copy this rank's rows of checkpoint tensor ``loaded`` (part ``part`` of a fused layer, or
        the whole fused layer as one tensor)."""
        if part is None and len(self.parts) > 1 and self.full_sizes is not None:
            if loaded.shape[0] != sum(self.full_sizes):
                raise ValueError(f"shape {tuple(loaded.shape)} is not the fused parts {self.full_sizes}")
            at = 0
            for i, full in enumerate(self.full_sizes):
                self.weight_loader(param, loaded.narrow(0, at, full), i)
                at += full
            return
        idx = 0 if part is None else part
        if part is None and len(self.parts) != 1:
            raise ValueError(f"a fused layer of {len(self.parts)} parts needs the part of each checkpoint tensor")
        start, size = self.parts[idx]
        offset = sum(s for _, s in self.parts[:idx])
        copy_shard(param.narrow(0, offset, size), loaded, 0, start, size)

    def shard_of_blocks(self, blocks: QuantizedBlocks, part: int | None) -> QuantizedBlocks:
        return blocks.shard(0, *self.parts[part or 0])


class RowParallelLinear(Linear):
    """Input features split across ranks (``in_range`` = this rank's ``(start, size)``); the
    outputs are summed over the group, then the bias (held whole by every rank) is added once."""

    def __init__(self, in_range: tuple[int, int], output_size: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__(in_range[1], output_size, bias=bias)
        self.in_range = in_range
        self.tp = tp

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, part: int | None) -> None:
        if param.dim() == 1:  # the bias
            copy_shard(param, loaded, None, 0, 0)
        else:
            copy_shard(param, loaded, 1, *self.in_range)

    def shard_of_blocks(self, blocks: QuantizedBlocks, part: int | None) -> QuantizedBlocks:
        # (With 2 ranks both shares end where the other starts: both keep their blocks or both cut
        # them. With more, a rank whose share cuts a block dequantizes this projection alone.)
        return blocks.shard(1, *self.in_range)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out`` as for ``Linear``, on one rank (the all-reduce returns its own)."""
        if self.tp.world_size == 1:
            return super().forward(x, out)
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows ``vocab_range = (start, size)`` of the full vocabulary; the same slice serves as
    the LM head's weight when the embeddings are tied."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        self.vocab_range = tp.shard(vocab_size)
        # Every rank's share, to concatenate the LM head's logits in rank order.
        self.vocab_sizes = [shard_range(vocab_size, tp.world_size, r)[1] for r in range(tp.world_size)]
        super().__init__(self.vocab_range[1], hidden_size)
        self.tp = tp

    # The checkpoint's own rows (a GGUF file's blocks, an AWQ checkpoint's 16 bits), widened to float32
    # as tokens need them: an unsharded embedding whose float copy would outweigh the quantized
    # model (``models/cpu_packing.pack_for_cpu`` decides).
    kept_rows: QuantizedBlocks | None = None

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # (as ``Linear.reset_parameters``: nothing to write on meta)
            super().reset_parameters()

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, part: int | None) -> None:
        copy_shard(param, loaded, 0, *self.vocab_range)

    def materialize(self) -> None:
        """Write the kept blocks into the float weight and read rows from it from now on."""
        if self.kept_rows is not None:
            with torch.no_grad():
                self.weight.copy_(self.kept_rows.dequantize())
            self.kept_rows = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.kept_rows.gather_rows(input_ids) if self.kept_rows is not None else super().forward(input_ids)
        start, size = self.vocab_range
        local = input_ids - start
        outside = (local < 0) | (local >= size)
        local = local.masked_fill(outside, 0)
        x = self.kept_rows.gather_rows(local) if self.kept_rows is not None else F.embedding(local, self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


def copy_shard(dst: torch.Tensor, full: Any, dim: int | None, start: int, size: int) -> None:
    """``dst.copy_(full.narrow(dim, start, size))`` (``dim=None``: all of ``full``); a checkpoint
    tensor of the wrong shape raises ``ValueError`` naming both shapes. ``full`` is a tensor or a
    not-yet-read one with ``shape``, ``dim()`` and ``narrow`` (only the slice is read)."""
    if dim is None or full.dim() <= dim or full.shape[dim] < start + size:
        dim, start, size = 0, 0, full.shape[0] if full.dim() else 0
    src = full.narrow(dim, start, size) if full.dim() else full
    if dst.shape != src.shape:
        raise ValueError(f"shape {tuple(full.shape)} does not give this rank's shard {tuple(dst.shape)}")
    dst.copy_(src)
