"""Paged attention in plain PyTorch, kernel-free: the reference backend (``"torch"``), the tests'
oracle, and the path on CUDA and wherever the compiled CPU kernels cannot run.

K/V of every layer live in a flat ``[num_slots, num_kv_heads, head_dim]`` view of the paged cache
(slot = block_id * block_size + offset). New K/V are scattered into their slots, then each group
gathers the blocks it reads and calls ``scaled_dot_product_attention``. Grouped-query attention
folds the query heads of one KV head into the query-length axis, so K/V are never repeated for
decodes. Decodes that share prefix-cache blocks attend to the shared part once ("cascade"):
one GEMM of all their queries against the shared K, merged with each one's own suffix in a
single softmax. The ``"cpu"`` backend (``cpu_paged.py``) subclasses this one and adds kinds of
groups run by compiled kernels; this module never calls a kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagellm.attention.kv_quant import as_cached, from_cache, to_cache
from pagellm.attention.metadata import AttentionGroup, AttentionKind, AttentionMetadata

# Decodes are split into at most this many length-sorted groups: less padding to gather and
# attend over, for a few more SDPA calls per layer.
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8


def _split_by_length(lens: list[int]) -> list[tuple[int, int]]:
    """Split length-sorted decodes into contiguous ``[start, end)`` groups of similar length."""
    n = len(lens)
    k = max(1, min(MAX_DECODE_GROUPS, n // MIN_DECODE_GROUP))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k) if bounds[i + 1] > bounds[i]]


def _padded_block_table(lens: list[int], tables: list[list[int]], block_size: int) -> torch.Tensor:
    """``[B, max_blocks]`` block ids covering each sequence's ``lens[b]`` positions, padded with block 0."""
    width = -(-max(lens) // block_size)
    rows = []
    for n_tok, ids in zip(lens, tables, strict=True):
        n = -(-n_tok // block_size)
        rows.append(ids[:n] + [0] * (width - n))
    return torch.tensor(rows, dtype=torch.long)


# Decodes sharing at least this many leading cached tokens (the same physical blocks, from
# prefix-cache hits) attend to them in one cascade group: the shared K/V are read once.
MIN_SHARED_TOKENS = 64


def _plan_decodes(lens: list[int], tables: list[list[int]], block_size: int,
                  share_prefixes: bool = True) -> list[tuple[list[int], int]]:
    """Group decodes: ``[(member indices, shared prefix blocks)]``; 0 shared means a plain group.

    Sequences whose first block is the same physical block share a prefix; their common run of
    block ids (leaving each at least one position of its own) is attended once. The rest are
    sorted by length and split into a few groups of similar length (less padding).
    ``share_prefixes=False``: plain groups only, so the order depends on the lengths alone (every
    KV cache group of a step then lays its decodes out alike).
    """
    by_first: dict[int, list[int]] = {}
    for i, t in enumerate(tables):
        by_first.setdefault(t[0] if share_prefixes else i, []).append(i)
    plans: list[tuple[list[int], int]] = []
    plain: list[int] = []
    for members in by_first.values():
        shared = 0
        if len(members) > 1:
            limit = (min(lens[i] for i in members) - 1) // block_size
            first = tables[members[0]]
            while shared < limit and all(tables[i][shared] == first[shared] for i in members):
                shared += 1
        if shared * block_size >= MIN_SHARED_TOKENS:
            plans.append((sorted(members, key=lambda i: -lens[i]), shared))
        else:
            plain.extend(members)
    plain.sort(key=lambda i: -lens[i])
    for lo, hi in _split_by_length([lens[i] for i in plain]) if plain else []:
        plans.append((plain[lo:hi], 0))
    return plans


def _attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and its log-sum-exp (for merging partial attentions). ``mask`` is additive.

    On CPU this is the fused flash kernel behind SDPA, which returns the LSE too and reads
    strided K/V without copying them; elsewhere plain matmuls.
    """
    if mask is not None:
        mask = mask.to(q.dtype)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                               scale=scale)
        return out, lse
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v), lse


def _cascade_decode(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, grp: AttentionGroup, block_size: int, scale: float) -> torch.Tensor:
    """Decode attention over a shared prefix plus each member's own suffix, merged exactly by LSE.

    The prefix is one attention call with all ``B * g`` queries of a KV head against the shared
    K/V (read once); the suffixes are one batched call. ``q [B, Hkv, g, D]``, own K/V
    ``[B, Hkv, S, D]``, ``grp.mask`` additive ``[B, 1, 1, S]``.
    """
    b, hkv, g, d = q.shape
    assert grp.shared_blocks is not None
    dc = key_cache.shape[-1]  # (the stored row: d, or d + the scale for an int8 cache)
    row = block_size * hkv * dc
    kp = from_cache(key_cache.view(-1, row).index_select(0, grp.shared_blocks).view(-1, hkv, dc), q.dtype)
    vp = from_cache(value_cache.view(-1, row).index_select(0, grp.shared_blocks).view(-1, hkv, dc), q.dtype)
    kp, vp = kp.transpose(0, 1)[None], vp.transpose(0, 1)[None]
    q_all = q.permute(1, 0, 2, 3).reshape(1, hkv, b * g, d)
    out_p, lse_p = _attend_with_lse(q_all, kp, vp, None, scale)
    out_p = out_p.view(hkv, b, g, d).permute(1, 0, 2, 3)
    lse_p = lse_p.view(hkv, b, g).permute(1, 0, 2)
    out_s, lse_s = _attend_with_lse(q, k_own, v_own, grp.mask, scale)
    m = torch.maximum(lse_p, lse_s)
    w_p, w_s = torch.exp(lse_p - m)[..., None], torch.exp(lse_s - m)[..., None]
    return (out_p * w_p + out_s * w_s) / (w_p + w_s)


def _repeat_kv(x: torch.Tensor, g: int, head_dim: int) -> torch.Tensor:
    """Repeat each KV head ``g`` times (HF's ``repeat_kv`` order). SDPA's ``enable_gqa`` would
    avoid the copy, but on CPU it drops to the slow math kernel; the fused one is worth the copy."""
    return x if g == 1 else x.repeat_interleave(g, dim=head_dim)


def _sequences(grp: AttentionGroup, block_size: int) -> list[tuple[int, int, int, torch.Tensor | None]]:
    """The group's sequences as ``(first flat row, query length, context length, block ids)``, for
    any kind of group (``None`` blocks: a fresh chunk, whose K/V are its own rows' slots)."""
    kind, b, ql = grp.kind, grp.batch_size, grp.query_len
    if kind == AttentionKind.FRESH_PREFILL:
        return [(grp.token_start, ql, ql, None)]
    if grp.kv_blocks is None:
        raise ValueError(f"a {kind.name} group needs kv_blocks")
    if kind == AttentionKind.PREFILL_KERNEL and grp.prefill_chunks is not None:
        rows, done, qls = grp.prefill_chunks.tolist()
        return [(rows[c], qls[c], done[c] + qls[c], grp.kv_blocks[c]) for c in range(b)]
    if kind == AttentionKind.DECODE_KERNEL and grp.seq_lens is not None:
        return [(grp.token_start + i, 1, int(n), grp.kv_blocks[i]) for i, n in enumerate(grp.seq_lens.tolist())]
    if grp.mask is None:
        raise ValueError(f"a {kind.name} group needs its mask")
    # PAGED and CASCADE_DECODE: each sequence's length is what its last query row may see.
    valid = grp.mask if grp.mask.dtype == torch.bool else grp.mask == 0
    lens = valid[:, 0, -1, :].sum(-1).tolist()
    shared = grp.shared_blocks if grp.shared_blocks is not None else grp.kv_blocks.new_empty(0)
    return [(grp.token_start + i * ql, ql, shared.numel() * block_size + int(n), torch.cat([shared, grp.kv_blocks[i]]))
            for i, n in enumerate(lens)]


def _windowed(out: torch.Tensor, grp: AttentionGroup, query: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor, slot_mapping: torch.Tensor, block_size: int, scale: float,
              window: int | None, softcap: float | None) -> None:
    """A group's attention with a sliding window (a query at position p sees keys p - window < k <= p)
    and/or logit soft-capping (``cap * tanh(s / cap)``), per sequence, in Hugging Face's eager order:
    scores in the model dtype, capped, masked, softmax in float32. Only the blocks a window reaches
    are read (blocks that left every window may be freed)."""
    hq, d = query.shape[1], query.shape[2]
    g = hq // key_cache.shape[1]
    for row0, ql, kv_len, blocks in _sequences(grp, block_size):
        lo = 0 if window is None else max(0, kv_len - ql - window + 1)  # the first key any query sees
        kpos = torch.arange(lo, kv_len, device=query.device)
        if blocks is None:
            slots = slot_mapping[row0 + lo:row0 + kv_len]
        else:
            slots = blocks[kpos // block_size] * block_size + kpos % block_size
        k = _repeat_kv(from_cache(key_cache.index_select(0, slots), query.dtype).transpose(0, 1), g, 0)
        v = _repeat_kv(from_cache(value_cache.index_select(0, slots), query.dtype).transpose(0, 1), g, 0)
        q = query[row0:row0 + ql].transpose(0, 1)  # [Hq, ql, D]
        s = torch.matmul(q, k.transpose(1, 2)) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        qpos = torch.arange(kv_len - ql, kv_len, device=query.device)[:, None]
        allowed = kpos[None, :] <= qpos
        if window is not None:
            allowed &= qpos - kpos[None, :] < window
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32).to(query.dtype)
        out[row0:row0 + ql] = torch.matmul(p, v).transpose(0, 1).reshape(ql, hq * d)


# One group's attention: writes rows ``token_start:token_end`` of ``out [T, Hq * D]``. The step's
# key and value (``None`` where the caller wrote them to the cache: ``reads_kv_from_cache``).
GroupImpl = Callable[[torch.Tensor, AttentionGroup, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                      torch.Tensor, torch.Tensor, int, float], None]
# The same for a layer with a sliding window and/or a logit soft-cap (the last two arguments).
WindowedImpl = Callable[[torch.Tensor, AttentionGroup, torch.Tensor, torch.Tensor, torch.Tensor, int, float,
                         int | None, float | None], None]


class TorchPagedAttention:
    """The reference backend: builds a step's groups and attends each with SDPA.

    ``build_metadata`` decides the groups (and their ``AttentionKind``); ``forward`` writes the
    step's K/V into the cache, then runs every group through the method registered for its kind
    in ``self.impls``. A subclass adds kinds (and builds groups of them) without an ``if`` here.
    A layer with a sliding window or a soft-cap runs each group through ``self.windowed_impls``
    where its kind has one there, else through ``_windowed`` (the reference, any kind).
    """

    name = "torch"
    # Cascade groups for decodes sharing prefix blocks; off where several KV cache groups must
    # lay a step's decodes out in one order (the worker says so).
    share_prefixes = True

    def __init__(self) -> None:
        self.impls: dict[AttentionKind, GroupImpl] = {
            AttentionKind.FRESH_PREFILL: self._fresh_prefill,
            AttentionKind.PAGED: self._paged,
            AttentionKind.CASCADE_DECODE: self._paged,
        }
        self.windowed_impls: dict[AttentionKind, WindowedImpl] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ------------------------------------------------------------------ metadata
    # Whether ``build_metadata`` reads the decodes' block table from a ``decode_table`` when given
    # one (a backend whose kernels read the blocks in place, in the caller's order).
    takes_decode_table = False

    def build_metadata(self, decode_lens: list[int], decode_block_tables: list[list[int]],
                       chunks: list[tuple[int, int, list[int]]], block_size: int,
                       device: torch.device, decode_table: torch.Tensor | None = None,
                       seq_lens: torch.Tensor | None = None) -> AttentionMetadata:
        """Build the per-step metadata; the caller lays decodes out in ``meta.decode_order`` and
        then sets ``meta.slot_mapping`` for the whole flat batch.

        ``decode_lens[b]``: context length (including the new token) of decode ``b``.
        ``chunks``: ``(num_computed_tokens, query_len, block_ids)`` per prefill chunk, in flat order.
        ``decode_table``: the decodes' ``decode_block_tables`` as a contiguous int64 ``[B, width]``
        (the persistent batch's rows), for a backend that ``takes_decode_table``; ``seq_lens``: then
        ``decode_lens`` as an int64 tensor, where the caller has one.
        """
        if decode_table is not None and self.takes_decode_table:
            groups, order = self._decode_table_group(decode_lens, decode_table, seq_lens)
        else:
            groups, order = self._decode_groups(decode_lens, decode_block_tables, block_size, device)
        end = self._chunk_groups(groups, len(order), chunks, block_size, device)
        return AttentionMetadata(backend=self, slot_mapping=torch.empty(0, dtype=torch.long, device=device),
                                 groups=groups, num_tokens=end, block_size=block_size, decode_order=order)

    def _decode_table_group(self, decode_lens: list[int], decode_table: torch.Tensor,
                            seq_lens: torch.Tensor | None) -> tuple[list[AttentionGroup], list[int]]:
        raise NotImplementedError(f"{type(self).__name__} does not take a decode table")

    def _decode_groups(self, decode_lens: list[int], decode_block_tables: list[list[int]], block_size: int,
                       device: torch.device) -> tuple[list[AttentionGroup], list[int]]:
        """Decodes in length-sorted ``PAGED`` groups, or ``CASCADE_DECODE`` where they share a prefix."""
        groups: list[AttentionGroup] = []
        order: list[int] = []
        plans = _plan_decodes(decode_lens, decode_block_tables, block_size, self.share_prefixes) if decode_lens else []
        for members, shared in plans:
            lo = len(order)
            order.extend(members)
            lens = [decode_lens[i] - shared * block_size for i in members]
            tables = [decode_block_tables[i][shared:] for i in members]
            table = _padded_block_table(lens, tables, block_size)
            pos = torch.arange(table.shape[1] * block_size)
            mask = (pos[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
            shared_blocks = None
            kind = AttentionKind.PAGED
            if shared:
                kind = AttentionKind.CASCADE_DECODE
                shared_blocks = torch.tensor(decode_block_tables[members[0]][:shared], dtype=torch.long,
                                             device=device)
                mask = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))  # additive, for the LSE kernel
            groups.append(AttentionGroup(kind, lo, len(order), len(members), 1, table.to(device), mask.to(device),
                                         shared_blocks=shared_blocks))
        return groups, order

    def _chunk_groups(self, groups: list[AttentionGroup], start: int, chunks: list[tuple[int, int, list[int]]],
                      block_size: int, device: torch.device) -> int:
        """One group per prefill chunk, appended to ``groups`` from flat row ``start``; returns the end."""
        for num_computed, q_len, block_ids in chunks:
            if num_computed == 0:
                groups.append(AttentionGroup(AttentionKind.FRESH_PREFILL, start, start + q_len, 1, q_len, None, None))
            else:
                kv_len = num_computed + q_len
                n_blocks = -(-kv_len // block_size)
                table = torch.tensor(block_ids[:n_blocks], dtype=torch.long)[None, :]
                pos = torch.arange(n_blocks * block_size)
                q_pos = torch.arange(num_computed, kv_len)
                mask = (pos[None, :] <= q_pos[:, None])[None, None]
                groups.append(AttentionGroup(AttentionKind.PAGED, start, start + q_len, 1, q_len, table.to(device),
                                             mask.to(device)))
            start += q_len
        return start

    # ------------------------------------------------------------------ forward
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Scatter this step's K/V (``[T, num_kv_heads, head_dim]``) into their cache slots."""
        key_cache.index_copy_(0, slot_mapping, to_cache(key, key_cache.dtype))
        value_cache.index_copy_(0, slot_mapping, to_cache(value, value_cache.dtype))

    def rotary_and_write_kv(self, rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]], query: torch.Tensor,
                            key: torch.Tensor, value: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                            kv_cache: tuple[torch.Tensor, torch.Tensor],
                            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``rotary`` (the layer's rotary op) over the query and key; a backend that writes the
        rotated K/V into the cache in the same kernel says so (``True``: ``forward`` skips its write)."""
        query, key = rotary(query, key, rope)
        return query, key, False

    # Group kinds whose implementation reads the step's K/V from the cache, not from ``forward``'s.
    cache_reading_kinds: frozenset[AttentionKind] = frozenset({AttentionKind.PAGED, AttentionKind.CASCADE_DECODE})

    def reads_kv_from_cache(self, meta: AttentionMetadata) -> bool:
        """Whether every group of this step reads its keys and values from the cache, so that a
        caller may write them there itself, slice by slice, and pass none to ``forward``. The
        reference's fresh prefill attends to the K/V it is given."""
        return all(grp.kind in self.cache_reading_kinds for grp in meta.groups)

    def forward(self, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None, kv_written: bool = False) -> torch.Tensor:
        """``query [T, Hq, D]``, ``key/value [T, Hkv, D]``, caches ``[num_slots, Hkv, D]`` -> ``[T, Hq*D]``.
        ``window``: this layer's sliding window; ``softcap``: its attention logit soft-cap. ``key`` and
        ``value`` may be ``None`` once written (``kv_written``) where ``reads_kv_from_cache``."""
        t, hq, d = query.shape
        if not kv_written:
            if key is None or value is None:
                raise ValueError("forward needs the step's key and value unless they are written (kv_written)")
            self.write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty(t, hq * d, dtype=query.dtype, device=query.device)
        for grp in meta.groups:
            if window is None and softcap is None:
                self.impls[grp.kind](out, grp, query, key, value, key_cache, value_cache, meta.block_size, scale)
            elif grp.kind in self.windowed_impls:
                self.windowed_impls[grp.kind](out, grp, query, key_cache, value_cache, meta.block_size, scale,
                                              window, softcap)
            else:
                _windowed(out, grp, query, key_cache, value_cache, meta.slot_mapping, meta.block_size, scale,
                          window, softcap)
        return out

    @staticmethod
    def _fresh_prefill(out: torch.Tensor, grp: AttentionGroup, query: torch.Tensor, key: torch.Tensor | None,
                       value: torch.Tensor | None, key_cache: torch.Tensor, value_cache: torch.Tensor, block_size: int,
                       scale: float) -> None:
        """Causal attention of a chunk over its own K/V; no cache read."""
        assert key is not None and value is not None, "a fresh prefill attends to the K/V it is given"
        hq, d = query.shape[1], query.shape[2]
        g = hq // key.shape[1]
        # 4-D inputs: with 3-D ones CPU SDPA silently takes the slow math kernel.
        qh = query[grp.token_start:grp.token_end].transpose(0, 1)[None]
        kf, vf = key[grp.token_start:grp.token_end], value[grp.token_start:grp.token_end]
        # Attend to the K/V as cached (rounded), like chunked and decode steps do, so that
        # chunking, prefix hits and preemption still cannot change the result.
        kf, vf = as_cached(kf, key_cache.dtype), as_cached(vf, key_cache.dtype)
        kh = _repeat_kv(kf.transpose(0, 1)[None], g, 1)
        vh = _repeat_kv(vf.transpose(0, 1)[None], g, 1)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        out[grp.token_start:grp.token_end] = o[0].transpose(0, 1).reshape(grp.token_end - grp.token_start, hq * d)

    @staticmethod
    def _paged(out: torch.Tensor, grp: AttentionGroup, query: torch.Tensor, key: torch.Tensor | None,
               value: torch.Tensor | None, key_cache: torch.Tensor, value_cache: torch.Tensor, block_size: int,
               scale: float) -> None:
        """Gather the group's blocks, then SDPA with its mask (plus the shared prefix, for a cascade)."""
        hq, d = query.shape[1], query.shape[2]
        hkv = key_cache.shape[1]
        g = hq // hkv
        q = query[grp.token_start:grp.token_end]
        b, ql = grp.batch_size, grp.query_len
        if grp.kv_blocks is None:
            raise ValueError(f"a {grp.kind.name} group needs kv_blocks")
        flat = grp.kv_blocks.reshape(-1)
        kv_len = grp.kv_blocks.shape[1] * block_size
        dc = key_cache.shape[-1]  # (the stored row: d, or d + the scale for an int8 cache)
        if grp.k_buf is None or grp.v_buf is None or grp.k_buf.dtype != key_cache.dtype:
            grp.k_buf = key_cache.new_empty(flat.numel(), block_size * hkv * dc)
            grp.v_buf = torch.empty_like(grp.k_buf)
        torch.index_select(key_cache.view(-1, block_size * hkv * dc), 0, flat, out=grp.k_buf)
        torch.index_select(value_cache.view(-1, block_size * hkv * dc), 0, flat, out=grp.v_buf)
        # A narrower cache is widened after the gather (attention math stays in the model dtype).
        k = from_cache(grp.k_buf.view(b, kv_len, hkv, dc), query.dtype).transpose(1, 2)
        v = from_cache(grp.v_buf.view(b, kv_len, hkv, dc), query.dtype).transpose(1, 2)
        if ql == 1:
            # Decode: the g query heads of each KV head become g query rows over the same keys.
            qh = q.view(b, hkv, g, d)
            if grp.kind == AttentionKind.CASCADE_DECODE:
                o = _cascade_decode(qh, k, v, key_cache, value_cache, grp, block_size, scale)
            else:
                o = F.scaled_dot_product_attention(qh, k, v, attn_mask=grp.mask, scale=scale)
            out[grp.token_start:grp.token_end] = o.reshape(b, hq * d)
        else:
            qh = q.view(b, ql, hq, d).transpose(1, 2)
            k, v = _repeat_kv(k, g, 1), _repeat_kv(v, g, 1)
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=grp.mask, scale=scale)
            out[grp.token_start:grp.token_end] = o.transpose(1, 2).reshape(b * ql, hq * d)
