"""``AttentionMetadata``: how the flat token batch of one step maps onto paged K/V.

The model runner lays the step's tokens out flat, decodes first, then one prefill chunk per
sequence. Attention runs per *group*: all decodes together (one query each), then each chunk on
its own (no query padding anywhere)::

    flat tokens: [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     slot_mapping: where each token's K/V goes
    groups:      decode(B=3)  chunk(seq p0) chunk(p1)  kv_slots: which cache slots each row reads
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended in one SDPA call.

    ``kv_slots[b, j]`` is the cache slot of key position ``j`` of sequence ``b`` (padding points at
    slot 0 and is masked out by ``mask``). ``kv_slots is None`` means a chunk with no earlier
    context: it attends causally to its own fresh K/V and never reads the cache.
    """

    token_start: int
    token_end: int
    batch_size: int
    query_len: int
    kv_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs, built once by the model runner and shared by every layer."""

    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    num_tokens: int
