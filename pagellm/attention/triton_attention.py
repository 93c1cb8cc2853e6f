"""Paged attention in Triton (the ``"cuda"`` backend's): decodes and prefill chunks alike, keys split
into fixed partitions (flash-decoding) so a lone decode still fills the GPU.

A program takes one sequence's tile of ``BLOCK_M`` query rows for one KV head, a row being a
(token, query head of that KV head) pair, so grouped-query attention reads each K/V block once for
all the heads that share it. It walks the sequence's block table directly (no gather), one cache
block per iteration, with an online softmax in float32: causal, with a layer's sliding window (a
query at position p sees keys p - window < k <= p; blocks before every row's window are skipped)
and logit soft-cap (``cap * tanh(s / cap)``). K/V in float32, float16 or bfloat16.

The keys of a row are cut into partitions of ``PARTITION_SIZE`` positions. Each partition's
softmax state ``(max, sum, weighted values)`` is computed alone, then the partitions are combined
in order (``_combine``)::

    decodes (split):   program (seq, head, tile, partition) -> scratch;  reduce: combine p = 0, 1, ..
    chunks (whole):    program (seq, head, tile) computes partition 0, combines, partition 1, ..

Both run the same two functions in the same order, and the cut depends on positions only, never on
the batch: a row's bits are the same decoded alone, in a batch, or prefilled (scheduling must never
change greedy outputs). A partition or block masked whole for a row leaves its state's bits as they
were. A decode of a 135M model at batch 1 is 3 KV heads: 3 programs without the split, one per
partition of each with it.

On a CPU it runs under ``TRITON_INTERPRET=1`` (the tests compare it with the torch reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.kernels.triton_ops import tanh

# Query rows per program, whatever the step holds: a row's result then depends on its own query and
# keys only, not on its neighbours, the batch, or whether it is decoded or prefilled.
BLOCK_M = 16
# Key positions per partition (rounded to whole cache blocks): at 16-token blocks, 8 blocks a program.
PARTITION_SIZE = 128


@triton.jit
def _attend(q, q_pos, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, ctx, start, end, scale, softcap, window,
            stride_ks, stride_kh, stride_vs, stride_vh,
            HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
            PRECISION: tl.constexpr):
    """The softmax state of keys ``start .. end`` (whole blocks from ``start``) for the tile's rows."""
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_ok = dims < HEAD_DIM
    m_i, l_i, acc = _empty_state(BLOCK_M, HEAD_DIM_PADDED)
    offs = tl.arange(0, BLOCK_SIZE)
    for s0 in range(start, end, BLOCK_SIZE):
        block = tl.load(table_ptr + s0 // BLOCK_SIZE)
        slots = block.to(tl.int64) * BLOCK_SIZE + offs
        k_pos = s0 + offs
        k_ok = k_pos < ctx
        k = tl.load(k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                    mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k).to(q.dtype), out_dtype=tl.float32, input_precision=PRECISION) * scale
        if USE_SOFTCAP:
            s = softcap * tanh(s / softcap)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if USE_WINDOW:
            allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
                    mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        # (the model's dtype for both, as the reference widens a narrower cache before attending)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), out_dtype=tl.float32,
                                            input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _combine(m_i, l_i, acc, m_p, l_p, acc_p):
    """Two softmax states as one: the running one and the next partition's."""
    m_new = tl.maximum(m_i, m_p)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp(m_i - m_safe)
    b = tl.exp(m_p - m_safe)
    return m_new, l_i * a + l_p * b, acc * a[:, None] + acc_p * b[:, None]


@triton.jit
def _tile(q_start_ptr, seq_lens_ptr, seq, kv_head, tile, window, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_SIZE: tl.constexpr, PART: tl.constexpr, USE_WINDOW: tl.constexpr):
    """A tile's rows and the keys any of them may see: its query length and context, each row's query
    head, validity, flat token and position, the first block start ``lo``, the end ``hi``, and the
    partitions ``lo_part .. hi_part``."""
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_start
    ctx = tl.load(seq_lens_ptr + seq)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // GROUP
    q_pos = ctx - q_len + token  # each row's absolute position
    last_token = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, q_len * GROUP - 1) // GROUP
    hi = ctx - q_len + last_token + 1  # keys past the tile's last row are masked for every row
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - q_len + (tile * BLOCK_M) // GROUP - window + 1, 0)
    lo = (lo // BLOCK_SIZE) * BLOCK_SIZE
    return (q_len, ctx, kv_head * GROUP + rows % GROUP, token < q_len, (q_start + token).to(tl.int64), q_pos, lo, hi,
            lo // PART, (hi + PART - 1) // PART)


@triton.jit
def _empty_state(BLOCK_M: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr):
    """A softmax state over no keys: ``(max, sum, weighted values)`` = ``(-inf, 0, 0)``."""
    return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32))


@triton.jit
def paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, q_start_ptr, seq_lens_ptr, m_ptr, l_ptr, acc_ptr,
    num_parts, scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PART: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    """SPLIT: one partition of a tile into the scratch ``m, l, acc`` (``[T, Hq, num_parts(, D)]``);
    else the tile's partitions combined in order, into ``out``."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    if SPLIT:
        part = tile % num_parts
        tile = tile // num_parts
    q_len, ctx, head, row_ok, flat, q_pos, lo, hi, lo_part, hi_part = _tile(
        q_start_ptr, seq_lens_ptr, seq, kv_head, tile, window, GROUP, BLOCK_M, BLOCK_SIZE, PART, USE_WINDOW)
    if tile * BLOCK_M >= q_len * GROUP:
        return
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + flat[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    table = block_tables_ptr + seq * stride_bt
    if SPLIT:
        if (part < lo_part) | (part >= hi_part):
            return
        m_i, l_i, acc = _attend(q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, ctx,
                                tl.maximum(part * PART, lo), tl.minimum(part * PART + PART, hi), scale, softcap,
                                window, stride_ks, stride_kh, stride_vs, stride_vh, HEAD_DIM, HEAD_DIM_PADDED,
                                BLOCK_M, BLOCK_SIZE, USE_SOFTCAP, USE_WINDOW, PRECISION)
        idx = (flat * (tl.num_programs(1) * GROUP) + head) * num_parts + part
        tl.store(m_ptr + idx, m_i, mask=row_ok)
        tl.store(l_ptr + idx, l_i, mask=row_ok)
        tl.store(acc_ptr + idx[:, None] * HEAD_DIM_PADDED + dims[None, :], acc, mask=row_ok[:, None])
    else:
        m_i, l_i, acc = _empty_state(BLOCK_M, HEAD_DIM_PADDED)
        for p in range(lo_part, hi_part):
            m_p, l_p, acc_p = _attend(q, q_pos, k_cache_ptr, v_cache_ptr, table, kv_head, ctx,
                                      tl.maximum(p * PART, lo), tl.minimum(p * PART + PART, hi), scale, softcap,
                                      window, stride_ks, stride_kh, stride_vs, stride_vh, HEAD_DIM, HEAD_DIM_PADDED,
                                      BLOCK_M, BLOCK_SIZE, USE_SOFTCAP, USE_WINDOW, PRECISION)
            m_i, l_i, acc = _combine(m_i, l_i, acc, m_p, l_p, acc_p)
        tl.store(out_ptr + flat[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def reduce_partitions_kernel(
    out_ptr, q_start_ptr, seq_lens_ptr, m_ptr, l_ptr, acc_ptr, num_parts, window, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PART: tl.constexpr, USE_WINDOW: tl.constexpr,
):
    """A split tile's partitions combined in order (the whole kernel's loop, over the scratch)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_len, ctx, head, row_ok, flat, q_pos, lo, hi, lo_part, hi_part = _tile(
        q_start_ptr, seq_lens_ptr, seq, kv_head, tile, window, GROUP, BLOCK_M, BLOCK_SIZE, PART, USE_WINDOW)
    if tile * BLOCK_M >= q_len * GROUP:
        return
    dims = tl.arange(0, HEAD_DIM_PADDED)
    m_i, l_i, acc = _empty_state(BLOCK_M, HEAD_DIM_PADDED)
    for p in range(lo_part, hi_part):
        idx = (flat * (tl.num_programs(1) * GROUP) + head) * num_parts + p
        m_p = tl.load(m_ptr + idx, mask=row_ok, other=float("-inf"))
        l_p = tl.load(l_ptr + idx, mask=row_ok, other=0.0)
        acc_p = tl.load(acc_ptr + idx[:, None] * HEAD_DIM_PADDED + dims[None, :], mask=row_ok[:, None], other=0.0)
        m_i, l_i, acc = _combine(m_i, l_i, acc, m_p, l_p, acc_p)
    tl.store(out_ptr + flat[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < HEAD_DIM)[None, :])


def partition_size(block_size: int) -> int:
    """Key positions per partition: whole cache blocks, ``PARTITION_SIZE`` where the blocks divide it."""
    return block_size * max(1, PARTITION_SIZE // block_size)


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, q_start: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                    block_size: int, scale: float, window: int | None = None, softcap: float | None = None,
                    num_partitions: int = 1) -> None:
    """``out [T, Hq, D]`` for ``query [T, Hq, D]`` over caches ``[num_slots, Hkv, D]``: sequence ``s``
    has query rows ``q_start[s] .. q_start[s + 1]`` (int32 ``[S + 1]``), ``seq_lens[s]`` positions
    of context (its queries the last ones) in the blocks of ``block_tables[s]`` (int32).
    ``num_partitions`` > 1: each tile's partitions (at most that many: ``partition_size`` positions
    each, up to the longest context) run as programs of their own, then a reduce combines them."""
    t, hq, d = query.shape
    hkv = key_cache.shape[1]
    group = hq // hkv
    tiles = triton.cdiv(max_query_len * group, BLOCK_M)
    d_pad = max(16, triton.next_power_of_2(d))
    split = num_partitions > 1
    m = torch.empty((t, hq, num_partitions) if split else (1,), dtype=torch.float32, device=query.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty((t, hq, num_partitions, d_pad) if split else (1,), dtype=torch.float32, device=query.device)
    shape = dict(HEAD_DIM=d, HEAD_DIM_PADDED=d_pad, GROUP=group, BLOCK_M=BLOCK_M, BLOCK_SIZE=block_size,
                 PART=partition_size(block_size), USE_WINDOW=window is not None)
    paged_attention_kernel[(seq_lens.shape[0], hkv, tiles * num_partitions)](
        out, query, key_cache, value_cache, block_tables, q_start, seq_lens, m, l_sum, acc, num_partitions,
        scale, softcap or 0.0, window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1),
        block_tables.stride(0), USE_SOFTCAP=softcap is not None, SPLIT=split,
        # float32 (the oracle) in full precision: no TF32 rounding of the products on a GPU
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", **shape,
    )
    if split:
        reduce_partitions_kernel[(seq_lens.shape[0], hkv, tiles)](
            out, q_start, seq_lens, m, l_sum, acc, num_partitions, window or 0, out.stride(0), out.stride(1), **shape)
