"""The compiled CPU kernel for paged decode attention (``pagellm/kernels/paged_decode.c``).

The pure-PyTorch decode path gathers every block a decode reads into a dense buffer, then runs
SDPA over it: the K/V bytes cross memory three times, and at 64 decodes that is more than half
of a step. The kernel reads K and V straight from their blocks, once. Unavailable (no compiler,
``PAGELLM_CPU_KERNELS=0``, a non-CPU device, a cache that is neither float32 nor float16, or a
float16 cache without AVX-512 / head size 64): the pure path runs, and it remains the oracle the
tests compare against. Queries and outputs are float32 either way.
"""

from __future__ import annotations

import ctypes

import torch

from pagellm import kernels

_ARGS = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]
_SIGNATURES: kernels.Signatures = {
    "paged_decode_f32": (None, _ARGS),
    "paged_decode_f16": (None, _ARGS),
    "paged_decode_f16_supported": (ctypes.c_int, [ctypes.c_int64]),
}
_DECODE = {torch.float32: "paged_decode_f32", torch.float16: "paged_decode_f16"}


def available() -> bool:
    """Build (once) and load the kernel; ``False`` when it is disabled or cannot be built."""
    return kernels.load("paged_decode", _SIGNATURES) is not None


def usable_for(key_cache: torch.Tensor) -> bool:
    """Whether decodes over this cache (``[num_slots, Hkv, D]``) can take the kernel."""
    if key_cache.device.type != "cpu" or key_cache.dtype not in _DECODE:
        return False
    lib = kernels.load("paged_decode", _SIGNATURES)
    if lib is None:
        return False
    return key_cache.dtype == torch.float32 or bool(lib.paged_decode_f16_supported(key_cache.shape[-1]))


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           block_size: int, scale: float) -> None:
    """``out[b] = softmax(q[b] K_b^T * scale) V_b`` over the first ``seq_lens[b]`` cached positions.

    ``query``/``out`` ``[B, Hq, D]`` contiguous float32; caches ``[num_slots, Hkv, D]`` float32 or
    float16 (see :func:`usable_for`); ``block_tables`` ``[B, max_blocks]`` and ``seq_lens`` ``[B]``
    int64 on the CPU.
    """
    lib = kernels.load("paged_decode", _SIGNATURES)
    assert lib is not None, "call available() first"
    b, hq, d = query.shape
    hkv = key_cache.shape[1]
    for t, name in ((out, "out"), (query, "query")):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32")
    for t, name in ((key_cache, "key_cache"), (value_cache, "value_cache")):
        if t.dtype != key_cache.dtype or t.dtype not in _DECODE or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 or float16 (both caches the same)")
    if not usable_for(key_cache):
        raise ValueError(f"no decode kernel for a {key_cache.dtype} cache with head size {d} on this machine")
    for t, name in ((block_tables, "block_tables"), (seq_lens, "seq_lens")):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int64")
    decode = getattr(lib, _DECODE[key_cache.dtype])
    decode(out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
           seq_lens.data_ptr(), b, hq, hkv, d, block_size, block_tables.shape[1], scale)
