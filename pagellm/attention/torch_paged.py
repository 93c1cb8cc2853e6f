"""Paged attention in plain PyTorch: the CPU default, also correct on CUDA.

K/V of every layer live in a flat ``[num_slots, num_kv_heads, head_dim]`` view of the paged cache
(slot = block_id * block_size + offset). New K/V are scattered into their slots, then each group
gathers the slots it reads and calls ``scaled_dot_product_attention``. Grouped-query attention
folds the query heads of one KV head into the query-length axis, so K/V are never repeated for
decodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.attention.metadata import AttentionGroup, AttentionMetadata


def build_metadata(
    decode_lens: list[int],
    decode_block_tables: list[list[int]],
    chunks: list[tuple[int, int, list[int]]],
    slot_mapping: list[int],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build the per-step metadata.

    ``decode_lens[b]``: context length (including the new token) of decode ``b``.
    ``chunks``: ``(num_computed_tokens, query_len, block_ids)`` per prefill chunk, in flat order.
    """
    groups: list[AttentionGroup] = []
    start = 0
    if decode_lens:
        b = len(decode_lens)
        max_kv = max(decode_lens)
        max_blocks = -(-max_kv // block_size)
        table = torch.zeros(b, max_blocks, dtype=torch.long)
        for i, ids in enumerate(decode_block_tables):
            n = min(len(ids), max_blocks)
            table[i, :n] = torch.tensor(ids[:n], dtype=torch.long)
        pos = torch.arange(max_kv)
        kv_slots = table[:, pos // block_size] * block_size + pos % block_size
        lens = torch.tensor(decode_lens, dtype=torch.long)
        valid = pos[None, :] < lens[:, None]
        kv_slots = torch.where(valid, kv_slots, 0)
        mask = valid[:, None, None, :]
        groups.append(AttentionGroup(0, b, b, 1, kv_slots.to(device), mask.to(device)))
        start = b
    for num_computed, q_len, block_ids in chunks:
        if num_computed == 0:
            groups.append(AttentionGroup(start, start + q_len, 1, q_len, None, None))
        else:
            kv_len = num_computed + q_len
            pos = torch.arange(kv_len)
            ids = torch.tensor(block_ids, dtype=torch.long)
            kv_slots = (ids[pos // block_size] * block_size + pos % block_size)[None, :]
            q_pos = torch.arange(num_computed, kv_len)
            mask = (pos[None, :] <= q_pos[:, None])[None, None]
            groups.append(AttentionGroup(start, start + q_len, 1, q_len, kv_slots.to(device), mask.to(device)))
        start += q_len
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        groups=groups,
        num_tokens=start,
    )


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V (``[T, num_kv_heads, head_dim]``) into their cache slots."""
    key_cache.index_copy_(0, slot_mapping, key)
    value_cache.index_copy_(0, slot_mapping, value)


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
    g = hq // hkv
    write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
    out = torch.empty(t, hq * d, dtype=query.dtype, device=query.device)
    for grp in meta.groups:
        q = query[grp.token_start:grp.token_end]
        if grp.kv_slots is None:
            # Fresh chunk: causal attention over its own K/V, no cache read.
            qh = q.transpose(0, 1)
            kh = key[grp.token_start:grp.token_end].transpose(0, 1)
            vh = value[grp.token_start:grp.token_end].transpose(0, 1)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=g > 1)
            out[grp.token_start:grp.token_end] = o.transpose(0, 1).reshape(grp.token_end - grp.token_start, hq * d)
            continue
        b, ql = grp.batch_size, grp.query_len
        flat = grp.kv_slots.reshape(-1)
        kv_len = grp.kv_slots.shape[1]
        k = key_cache.index_select(0, flat).view(b, kv_len, hkv, d).transpose(1, 2)
        v = value_cache.index_select(0, flat).view(b, kv_len, hkv, d).transpose(1, 2)
        if ql == 1:
            # Decode: the g query heads of each KV head become g query rows over the same keys.
            qh = q.view(b, hkv, g, d)
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=grp.mask, scale=scale)
            out[grp.token_start:grp.token_end] = o.reshape(b, hq * d)
        else:
            qh = q.view(b, ql, hq, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=grp.mask, scale=scale, enable_gqa=g > 1)
            out[grp.token_start:grp.token_end] = o.transpose(1, 2).reshape(b * ql, hq * d)
    return out
