"""Paged attention as one Triton kernel (the ``"cuda"`` backend's): decodes and prefill chunks alike.

Each program takes one sequence's tile of ``BLOCK_M`` query rows for one KV head, a row being a
(token, query head of that KV head) pair, so grouped-query attention reads each K/V block once for
all the heads that share it. It walks the sequence's block table directly (no gather), one cache
block per iteration, with an online softmax in float32: causal, with a layer's sliding window (a
query at position p sees keys p - window < k <= p; blocks before every row's window are skipped)
and logit soft-cap (``cap * tanh(s / cap)``). K/V in float32, float16 or bfloat16.

On a CPU it runs under ``TRITON_INTERPRET=1`` (the tests compare it with the torch reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query rows per program, whatever the step holds: a row's result then depends on its own query and
# keys only, not on its neighbours, the batch, or whether it is decoded or prefilled (scheduling
# must never change greedy outputs). Blocks masked whole for a row leave its sums' bits unchanged.
BLOCK_M = 16


@triton.jit
def _tanh(x):
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, q_start_ptr, seq_lens_ptr,
    scale, softcap, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len * GROUP:
        return
    ctx = tl.load(seq_lens_ptr + seq)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = token < q_len
    q_pos = ctx - q_len + token  # each row's absolute position
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    last_token = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, q_len * GROUP - 1) // GROUP
    hi = ctx - q_len + last_token + 1  # keys past the tile's last row are masked for every row
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(ctx - q_len + (tile * BLOCK_M) // GROUP - window + 1, 0)
    offs = tl.arange(0, BLOCK_SIZE)
    for start in range((lo // BLOCK_SIZE) * BLOCK_SIZE, hi, BLOCK_SIZE):
        block = tl.load(block_tables_ptr + seq * stride_bt + start // BLOCK_SIZE)
        slots = block.to(tl.int64) * BLOCK_SIZE + offs
        k_pos = start + offs
        k_ok = k_pos < ctx
        k = tl.load(k_cache_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                    mask=k_ok[:, None] & dim_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k).to(q.dtype), out_dtype=tl.float32, input_precision=PRECISION) * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
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
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, q_start: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int,
                    block_size: int, scale: float, window: int | None = None, softcap: float | None = None) -> None:
    """``out [T, Hq, D]`` for ``query [T, Hq, D]`` over caches ``[num_slots, Hkv, D]``: sequence ``s``
    has query rows ``q_start[s] .. q_start[s + 1]`` (int32 ``[S + 1]``), ``seq_lens[s]`` positions
    of context (its queries the last ones) in the blocks of ``block_tables[s]`` (int32)."""
    hq, d = query.shape[1], query.shape[2]
    hkv = key_cache.shape[1]
    group = hq // hkv
    num_seqs = seq_lens.shape[0]
    grid = (num_seqs, hkv, triton.cdiv(max_query_len * group, BLOCK_M))
    paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, q_start, seq_lens,
        scale, softcap or 0.0, window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1),
        block_tables.stride(0),
        HEAD_DIM=d, HEAD_DIM_PADDED=max(16, triton.next_power_of_2(d)), GROUP=group, BLOCK_M=BLOCK_M,
        BLOCK_SIZE=block_size, USE_SOFTCAP=softcap is not None, USE_WINDOW=window is not None,
        # float32 (the oracle) in full precision: no TF32 rounding of the products on a GPU
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
