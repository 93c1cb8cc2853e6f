"""``AttentionMetadata``: how the flat token batch of one step maps onto paged K/V.

The model runner lays the step's tokens out flat, decodes first, then one prefill chunk per
sequence. Attention runs per *group*: all decodes together (one query each), then each chunk on
its own (no query padding anywhere)::

    flat tokens: [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     slot_mapping: where each token's K/V goes
    groups:      decode(B=3)  chunk(seq p0) chunk(p1)  kv_slots: which cache slots each row reads
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagellm.attention.torch_paged import TorchPagedAttention


class AttentionKind(enum.Enum):
    """How a group is attended; each backend maps the kinds it builds to one method."""

    FRESH_PREFILL = enum.auto()  # a chunk with no earlier context: causal SDPA over its own K/V
    PAGED = enum.auto()  # decodes or one chunk: gather their blocks, SDPA with a mask
    CASCADE_DECODE = enum.auto()  # decodes sharing prefix blocks: the prefix once, merged by LSE
    DECODE_KERNEL = enum.auto()  # every decode of the step, compiled kernel over the blocks in place
    PREFILL_KERNEL = enum.auto()  # every chunk of the step, compiled kernel over the blocks in place


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together, the way ``kind`` says.

    ``kv_blocks[b]`` lists the cache blocks of sequence ``b`` in order (padded with block 0), so a
    whole block is gathered per index (block_size times fewer, contiguous copies than per slot);
    ``mask`` hides key positions past each sequence's length. A ``FRESH_PREFILL`` chunk (no
    earlier context) has neither: it attends causally to its own fresh K/V and never reads the cache.
    """

    kind: AttentionKind
    token_start: int
    token_end: int
    batch_size: int
    query_len: int
    kv_blocks: torch.Tensor | None
    mask: torch.Tensor | None
    # CASCADE_DECODE: ``shared_blocks`` (1-D) prefix every member, ``kv_blocks``/``mask`` then
    # cover only each member's suffix (the mask is then additive, float). The shared K/V are read
    # once for the whole group.
    shared_blocks: torch.Tensor | None = None
    # DECODE_KERNEL: each member's context length. The kernel reads ``kv_blocks`` in place, so no
    # gather and no mask.
    seq_lens: torch.Tensor | None = None
    # PREFILL_KERNEL: int64 ``[3, C]`` rows = each chunk's first flat token, num_computed_tokens,
    # query length (``kv_blocks`` holds the chunks' block tables; ``token_start/end`` span them all).
    # A DECODE_KERNEL group with it holds prefill chunks' tokens as decodes (no prefill kernel here).
    prefill_chunks: torch.Tensor | None = None
    # A backend's per-step kernel inputs, built once with the metadata and read by every layer (the
    # CUDA backend's: int32 block tables, each sequence's first query row and context length on the
    # device, the longest query).
    kernel_args: tuple | None = None
    # Gather buffers, allocated by the first layer and reused by the others: a fresh multi-MB
    # tensor per layer costs more in page faults on CPU than the copy itself.
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None


StateSpan = tuple[int, int, bool, int]  # (first flat row, rows, fresh, state block)


@dataclass(slots=True)
class StateMetadata:
    """A state layer group's share of a step (``core/kv_cache_spec.py`` ``MambaSpec``), in rounds:
    each round's copies ``(src, dst)`` of whole states between blocks, then its spans, each a
    sequence's run of flat rows and the block holding (and keeping) its state, ``fresh`` where the
    run starts the request (its state starts from zeros). One round without copies where a state
    is rewritten in its one block; where states are kept at block boundaries for prefix hits, a
    sequence's rows are cut at each boundary, round ``k`` its ``k``-th run, which continues in the
    next block from a copy of the state the previous run left (kept, then cached) in its own."""

    rounds: list[tuple[list[tuple[int, int]], list[StateSpan]]]

    @classmethod
    def in_place(cls, spans: list[StateSpan]) -> StateMetadata:
        return cls([([], spans)])

    def each_round(self, *states: torch.Tensor) -> Iterator[list[StateSpan]]:
        """Each round's spans, its copies made in ``states`` first (a layer's conv and recurrent
        states, each in its own pass over the rounds)."""
        for copies, spans in self.rounds:
            for src, dst in copies:
                for st in states:
                    st[dst] = st[src]
            yield spans


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs, built once by the model runner's backend and shared by every
    layer; ``backend`` (which built them) runs each layer's attention over them."""

    backend: TorchPagedAttention
    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    num_tokens: int
    block_size: int
    # Flat position -> index into the caller's decode list (decodes are reordered for grouping).
    decode_order: list[int]
    # Where the KV cache has several layer groups (core/kv_cache_spec.py): every group's metadata
    # (this one is group 0's; the same rows, each group's block tables and slots) and each layer's
    # group (index = layer in the stage).
    kv_groups: list[AttentionMetadata | StateMetadata] | None = None
    layer_group: list[int] | None = None
    # A plain decode step over groups: every group's slots ``[G, T]`` and block tables
    # ``[G, T, width]`` (the persistent batch's), for the decode graph.
    group_slots: torch.Tensor | None = None
    group_tables: torch.Tensor | None = None

    def for_layer(self, i: int) -> AttentionMetadata | StateMetadata:
        """Layer ``i``'s metadata (this one, where every layer shares one block table)."""
        if self.kv_groups is None or self.layer_group is None:
            return self
        return self.kv_groups[self.layer_group[i]]
