"""Paged attention in plain PyTorch: the CPU default, also correct on CUDA.

K/V of every layer live in a flat ``[num_slots, num_kv_heads, head_dim]`` view of the paged cache
(slot = block_id * block_size + offset). New K/V are scattered into their slots, then each group
gathers the blocks it reads and calls ``scaled_dot_product_attention``. Grouped-query attention
folds the query heads of one KV head into the query-length axis, so K/V are never repeated for
decodes. Decodes that share prefix-cache blocks attend to the shared part once ("cascade"):
one GEMM of all their queries against the shared K, merged with each one's own suffix in a
single softmax. On CPU, compiled kernels take the decodes (``cpu_kernel.paged_decode_attention``)
and the prefill chunks (``cpu_kernel.paged_prefill_attention``) where they apply; this path stays
their fallback and the tests' oracle.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F

from pagellm.attention import cpu_kernel
from pagellm.attention.metadata import AttentionGroup, AttentionMetadata
from pagellm.kernels import cpu_ops

# Decodes are split into at most this many length-sorted groups: less padding to gather and
# attend over, for a few more SDPA calls per layer.
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8


def _decode_groups(lens: list[int]) -> list[tuple[int, int]]:
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


def _plan_decodes(lens: list[int], tables: list[list[int]], block_size: int) -> list[tuple[list[int], int]]:
    """Group decodes: ``[(member indices, shared prefix blocks)]``; 0 shared means a plain group.

    Sequences whose first block is the same physical block share a prefix; their common run of
    block ids (leaving each at least one position of its own) is attended once. The rest are
    sorted by length and split into a few groups of similar length (less padding).
    """
    by_first: dict[int, list[int]] = {}
    for i, t in enumerate(tables):
        by_first.setdefault(t[0], []).append(i)
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
    for lo, hi in _decode_groups([lens[i] for i in plain]) if plain else []:
        plans.append((plain[lo:hi], 0))
    return plans


def build_metadata(
    decode_lens: list[int],
    decode_block_tables: list[list[int]],
    chunks: list[tuple[int, int, list[int]]],
    block_size: int,
    device: torch.device,
    decode_kernel: bool = False,
    prefill_kernel: bool = False,
) -> AttentionMetadata:
    """Build the per-step metadata; the caller lays decodes out in ``meta.decode_order`` and
    then sets ``meta.slot_mapping`` for the whole flat batch.

    ``decode_lens[b]``: context length (including the new token) of decode ``b``.
    ``chunks``: ``(num_computed_tokens, query_len, block_ids)`` per prefill chunk, in flat order.
    ``decode_kernel``: run all decodes as one group through the compiled CPU kernel (the caller
    checked ``cpu_kernel.usable_for``); it reads blocks in place, so no grouping pays off.
    ``prefill_kernel``: run all chunks as one group through the compiled prefill kernel (the caller
    checked :func:`prefill_kernel_usable`).
    """
    groups: list[AttentionGroup] = []
    order: list[int] = []
    if decode_kernel and decode_lens:
        order = list(range(len(decode_lens)))
        table = _padded_block_table(decode_lens, decode_block_tables, block_size)
        groups.append(AttentionGroup(0, len(order), len(order), 1, table, None,
                                     seq_lens=torch.tensor(decode_lens, dtype=torch.long)))
        decode_lens = []
    for members, shared in _plan_decodes(decode_lens, decode_block_tables, block_size) if decode_lens else []:
        lo = len(order)
        order.extend(members)
        lens = [decode_lens[i] - shared * block_size for i in members]
        tables = [decode_block_tables[i][shared:] for i in members]
        table = _padded_block_table(lens, tables, block_size)
        pos = torch.arange(table.shape[1] * block_size)
        mask = (pos[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
        shared_blocks = None
        if shared:
            shared_blocks = torch.tensor(decode_block_tables[members[0]][:shared], dtype=torch.long, device=device)
            mask = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))  # additive, for the LSE kernel
        groups.append(AttentionGroup(lo, len(order), len(members), 1, table.to(device), mask.to(device),
                                     shared_blocks=shared_blocks))
    start = len(order)
    if prefill_kernel and chunks:
        lens = [num_computed + q_len for num_computed, q_len, _ in chunks]
        table = _padded_block_table(lens, [ids for _, _, ids in chunks], block_size)
        # Each chunk's first flat row, then the end of the last.
        bounds = list(accumulate((q_len for _, q_len, _ in chunks), initial=start))
        info = torch.tensor([bounds[:-1], [c[0] for c in chunks], [c[1] for c in chunks]], dtype=torch.long)
        groups.append(AttentionGroup(start, bounds[-1], len(chunks), 0, table, None, prefill_chunks=info))
        start, chunks = bounds[-1], []
    for num_computed, q_len, block_ids in chunks:
        if num_computed == 0:
            groups.append(AttentionGroup(start, start + q_len, 1, q_len, None, None))
        else:
            kv_len = num_computed + q_len
            n_blocks = -(-kv_len // block_size)
            table = torch.tensor(block_ids[:n_blocks], dtype=torch.long)[None, :]
            pos = torch.arange(n_blocks * block_size)
            q_pos = torch.arange(num_computed, kv_len)
            mask = (pos[None, :] <= q_pos[:, None])[None, None]
            groups.append(AttentionGroup(start, start + q_len, 1, q_len, table.to(device), mask.to(device)))
        start += q_len
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=device),
        groups=groups,
        num_tokens=start,
        block_size=block_size,
        decode_order=order,
    )


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
    row = block_size * hkv * d
    kp = key_cache.view(-1, row).index_select(0, grp.shared_blocks).view(-1, hkv, d).transpose(0, 1)[None].to(q.dtype)
    vp = value_cache.view(-1, row).index_select(0, grp.shared_blocks).view(-1, hkv, d).transpose(0, 1)[None].to(q.dtype)
    q_all = q.permute(1, 0, 2, 3).reshape(1, hkv, b * g, d)
    out_p, lse_p = _attend_with_lse(q_all, kp, vp, None, scale)
    out_p = out_p.view(hkv, b, g, d).permute(1, 0, 2, 3)
    lse_p = lse_p.view(hkv, b, g).permute(1, 0, 2)
    out_s, lse_s = _attend_with_lse(q, k_own, v_own, grp.mask, scale)
    m = torch.maximum(lse_p, lse_s)
    w_p, w_s = torch.exp(lse_p - m)[..., None], torch.exp(lse_s - m)[..., None]
    return (out_p * w_p + out_s * w_s) / (w_p + w_s)


def prefill_kernel_usable(key_cache: torch.Tensor, query_dtype: torch.dtype) -> bool:
    """Whether prefill chunks over this cache can run in the compiled CPU prefill kernel (built on
    first call): float32 queries and cache, head size 64, AVX-512."""
    return query_dtype == torch.float32 and cpu_kernel.prefill_usable_for(key_cache)


def decode_kernel_usable(key_cache: torch.Tensor, query_dtype: torch.dtype) -> bool:
    """Whether decodes over this cache can run in the compiled CPU kernel (built on first call);
    its queries and outputs are float32."""
    return query_dtype == torch.float32 and cpu_kernel.usable_for(key_cache)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V (``[T, num_kv_heads, head_dim]``) into their cache slots.

    ``index_copy_`` runs on one thread and costs ~8 % of a prefill step; the CPU kernel is a
    parallel row copy straight from the (strided) qkv output.
    """
    if (cpu_ops.writes_kv_into(key_cache) and cpu_ops.usable(key) and key.stride(1) == key.shape[2]
            and value.stride(1) == value.shape[2]):
        cpu_ops.write_kv(key, value, key_cache, value_cache, slot_mapping)
        return
    key_cache.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _repeat_kv(x: torch.Tensor, g: int, head_dim: int) -> torch.Tensor:
    """Repeat each KV head ``g`` times (HF's ``repeat_kv`` order). SDPA's ``enable_gqa`` would
    avoid the copy, but on CPU it drops to the slow math kernel; the fused one is worth the copy."""
    return x if g == 1 else x.repeat_interleave(g, dim=head_dim)


def forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``query [T, Hq, D]``, ``key/value [T, Hkv, D]``, caches ``[num_slots, Hkv, D]`` -> ``[T, Hq*D]``."""
    t, hq, d = query.shape
    hkv = key.shape[1]
    block_size = meta.block_size
    g = hq // hkv
    write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    out = torch.empty(t, hq * d, dtype=query.dtype, device=query.device)
    for grp in meta.groups:
        q = query[grp.token_start:grp.token_end]
        if grp.kv_blocks is None:
            # Fresh chunk: causal attention over its own K/V, no cache read.
            # 4-D inputs: with 3-D ones CPU SDPA silently takes the slow math kernel.
            qh = q.transpose(0, 1)[None]
            kf, vf = key[grp.token_start:grp.token_end], value[grp.token_start:grp.token_end]
            if key_cache.dtype != query.dtype:
                # Attend to the K/V as cached (rounded), like chunked and decode steps do, so that
                # chunking, prefix hits and preemption still cannot change the result.
                kf, vf = kf.to(key_cache.dtype).to(query.dtype), vf.to(key_cache.dtype).to(query.dtype)
            kh = _repeat_kv(kf.transpose(0, 1)[None], g, 1)
            vh = _repeat_kv(vf.transpose(0, 1)[None], g, 1)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
            out[grp.token_start:grp.token_end] = o[0].transpose(0, 1).reshape(grp.token_end - grp.token_start, hq * d)
            continue
        if grp.prefill_chunks is not None:
            # Reads every chunk's K/V (just written above) in place; queries stay strided.
            info = grp.prefill_chunks
            cpu_kernel.paged_prefill_attention(out, query, key_cache, value_cache, grp.kv_blocks, info[0], info[1],
                                               info[2], block_size, scale)
            continue
        b, ql = grp.batch_size, grp.query_len
        if grp.seq_lens is not None:
            cpu_kernel.paged_decode_attention(out[grp.token_start:grp.token_end].view(b, hq, d), q.contiguous(),
                                              key_cache, value_cache, grp.kv_blocks, grp.seq_lens, block_size, scale)
            continue
        flat = grp.kv_blocks.reshape(-1)
        kv_len = grp.kv_blocks.shape[1] * block_size
        if grp.k_buf is None or grp.k_buf.dtype != key_cache.dtype:
            grp.k_buf = key_cache.new_empty(flat.numel(), block_size * hkv * d)
            grp.v_buf = torch.empty_like(grp.k_buf)
        assert grp.v_buf is not None
        torch.index_select(key_cache.view(-1, block_size * hkv * d), 0, flat, out=grp.k_buf)
        torch.index_select(value_cache.view(-1, block_size * hkv * d), 0, flat, out=grp.v_buf)
        # A 16-bit cache under a wider model is upcast after the gather (attention math stays in the model dtype).
        k = grp.k_buf.view(b, kv_len, hkv, d).transpose(1, 2).to(query.dtype)
        v = grp.v_buf.view(b, kv_len, hkv, d).transpose(1, 2).to(query.dtype)
        if ql == 1:
            # Decode: the g query heads of each KV head become g query rows over the same keys.
            qh = q.view(b, hkv, g, d)
            if grp.shared_blocks is not None:
                o = _cascade_decode(qh, k, v, key_cache, value_cache, grp, block_size, scale)
            else:
                o = F.scaled_dot_product_attention(qh, k, v, attn_mask=grp.mask, scale=scale)
            out[grp.token_start:grp.token_end] = o.reshape(b, hq * d)
        else:
            qh = q.view(b, ql, hq, d).transpose(1, 2)
            k, v = _repeat_kv(k, g, 1), _repeat_kv(v, g, 1)
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=grp.mask, scale=scale)
            out[grp.token_start:grp.token_end] = o.transpose(1, 2).reshape(b * ql, hq * d)
    return out
