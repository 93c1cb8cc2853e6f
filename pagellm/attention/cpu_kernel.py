"""The compiled CPU kernels for paged attention: decode (``pagellm/kernels/paged_decode.c``) and
prefill (``paged_prefill.c``, below).

The pure-PyTorch decode path gathers every block a decode reads into a dense buffer, then runs
SDPA over it: the K/V bytes cross memory three times, and at 64 decodes that is more than half
of a step. The kernel reads K and V straight from their blocks, once. Unavailable (no compiler,
``PAGELLM_CPU_KERNELS=0``, a non-CPU device, a cache that is not float32, float16 or int8, or a
float16 or int8 cache with a head size over 256): the pure path runs, and it remains the oracle
the tests compare against. Queries and outputs are float32 either way; an int8 cache's rows carry
their scale (``kv_quant.py``).
"""

from __future__ import annotations

import ctypes
import os

import torch

from pagellm import kernels
from pagellm.attention.kv_quant import value_head_dim

_ARGS = ([ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6
         + [ctypes.c_float])
_SIGNATURES: kernels.Signatures = {
    "paged_decode_f32": (ctypes.c_int, _ARGS),
    "paged_decode_f16": (ctypes.c_int, _ARGS),
    "paged_decode_i8": (ctypes.c_int, _ARGS),
    "paged_decode_f16_supported": (ctypes.c_int, [ctypes.c_int64]),
    "paged_decode_windowed": (ctypes.c_int, _ARGS + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float]),
}
_ELEMENT_TYPE = {torch.float32: 0, torch.float16: 1, torch.int8: 2}  # paged_decode_windowed's et
_DECODE = {torch.float32: "paged_decode_f32", torch.float16: "paged_decode_f16", torch.int8: "paged_decode_i8"}


def _check_status(status: int, kernel: str) -> None:
    if status != 0:
        raise MemoryError(f"the {kernel} attention kernel could not allocate its scratch memory")


def _check_window_softcap(window: int | None, softcap: float | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of positions, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")


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
    return key_cache.dtype == torch.float32 or bool(lib.paged_decode_f16_supported(value_head_dim(key_cache)))


def decode_kernel_address(key_cache: torch.Tensor, windowed: bool = False) -> int | None:
    """The address of the decode kernel for this cache (``kernels/decode_graph.c`` calls it through a
    table), ``None`` where :func:`usable_for` says no. ``windowed``: the entry point that takes a
    window, a soft-cap and the cache's :func:`element_type`."""
    lib = kernels.load("paged_decode", _SIGNATURES)
    if lib is None or not usable_for(key_cache):
        return None
    return kernels.address(getattr(lib, "paged_decode_windowed" if windowed else _DECODE[key_cache.dtype]))


def element_type(cache_dtype: torch.dtype) -> int:
    """How the windowed decode kernel numbers a cache's element type."""
    return _ELEMENT_TYPE[cache_dtype]


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           block_size: int, scale: float, window: int | None = None,
                           softcap: float | None = None) -> None:
    """``out[b] = softmax(q[b] K_b^T * scale) V_b`` over the first ``seq_lens[b]`` cached positions,
    or, with a sliding ``window``, the last ``window`` of them (keys ``p - window < k <= p`` for the
    decode at ``p``); with ``softcap``, each score ``s`` becomes ``softcap * tanh(s / softcap)``.

    ``query`` ``[B, Hq, D]`` float32 with contiguous heads and any row stride (a view of the qkv
    output: no copy), ``out`` the same shape contiguous; caches ``[num_slots, Hkv, D]`` float32 or
    float16, or ``[num_slots, Hkv, D + 4]`` int8 (see :func:`usable_for`); ``block_tables``
    ``[B, max_blocks]`` and ``seq_lens`` ``[B]`` int64 on the CPU.
    """
    lib = kernels.load("paged_decode", _SIGNATURES)
    assert lib is not None, "call available() first"
    b, hq, d = query.shape
    hkv = key_cache.shape[1]
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("out must be contiguous float32")
    if query.dtype != torch.float32 or query.stride(2) != 1 or query.stride(1) != d:
        raise ValueError(f"query must be float32 with contiguous heads, got strides {query.stride()}")
    for t, name in ((key_cache, "key_cache"), (value_cache, "value_cache")):
        if t.dtype != key_cache.dtype or t.dtype not in _DECODE or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32, float16 or int8 (both caches the same)")
    if value_head_dim(key_cache) != d:
        raise ValueError(f"cache rows of {key_cache.shape[-1]} {key_cache.dtype} do not hold head size {d}")
    if not usable_for(key_cache):
        raise ValueError(f"no decode kernel for a {key_cache.dtype} cache with head size {d} on this machine")
    for t, name in ((block_tables, "block_tables"), (seq_lens, "seq_lens")):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int64")
    _check_window_softcap(window, softcap)
    if window is not None or softcap is not None:
        status = lib.paged_decode_windowed(
            out.data_ptr(), query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(), b, hq, hkv, d, block_size, block_tables.shape[1], scale,
            _ELEMENT_TYPE[key_cache.dtype], window or 0, softcap or 0.0)
        _check_status(status, "decode")
        return
    decode = getattr(lib, _DECODE[key_cache.dtype])
    status = decode(out.data_ptr(), query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
                    block_tables.data_ptr(), seq_lens.data_ptr(), b, hq, hkv, d, block_size, block_tables.shape[1],
                    scale)
    _check_status(status, "decode")


# ---- prefill (``pagellm/kernels/paged_prefill.c``) ------------------------------------------------
# The pure path runs SDPA per chunk: a fresh chunk over its own K/V with the K/V heads repeated
# for grouped-query attention, a chunk after cached tokens over a gather of its blocks with a
# mask. The kernel reads the blocks in place for every chunk, one task per (chunk, KV head,
# query tile), and shares each K/V row among the KV head's query heads: 2.1-2.4x SDPA's rate on
# SmolLM2's shapes (docs/performance.md).
_PREFILL_ARGS = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
                 + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int64])
_PREFILL_WINDOWED_ARGS = _PREFILL_ARGS + [ctypes.c_int64, ctypes.c_float]  # + window, softcap (0: none)
_PREFILL_SIGNATURES: kernels.Signatures = {
    "paged_prefill_f32": (ctypes.c_int, _PREFILL_WINDOWED_ARGS),
    "paged_prefill_f16": (ctypes.c_int, _PREFILL_WINDOWED_ARGS),
    "paged_prefill_i8": (ctypes.c_int, _PREFILL_WINDOWED_ARGS),
    "paged_prefill_supported": (ctypes.c_int, [ctypes.c_int64]),
}
_PREFILL = {torch.float32: "paged_prefill_f32", torch.float16: "paged_prefill_f16", torch.int8: "paged_prefill_i8"}
# On AMX bfloat16 tiles (``paged_prefill_amx.c``), for runs that never decode: same arguments.
_PREFILL_AMX_SIGNATURES: kernels.Signatures = {
    "paged_prefill_amx_f32": (ctypes.c_int, _PREFILL_ARGS),
    "paged_prefill_amx_f16": (ctypes.c_int, _PREFILL_ARGS),
    "paged_prefill_amx_supported": (ctypes.c_int, [ctypes.c_int64]),
}
_PREFILL_AMX = {torch.float32: "paged_prefill_amx_f32", torch.float16: "paged_prefill_amx_f16"}


def prefill_usable_for(key_cache: torch.Tensor) -> bool:
    """Whether prefill chunks over this cache (``[num_slots, Hkv, D]``) can take the prefill kernel:
    a float32, float16 or int8 CPU cache whose head size is a multiple of 16 up to 256 (the decode
    kernel's AVX-512 sizes, whose sums it reproduces) on an AVX-512 machine."""
    if key_cache.device.type != "cpu" or key_cache.dtype not in _PREFILL:
        return False
    lib = kernels.load("paged_prefill", _PREFILL_SIGNATURES)
    return lib is not None and bool(lib.paged_prefill_supported(value_head_dim(key_cache)))


def prefill_bf16_tiles_usable_for(key_cache: torch.Tensor) -> bool:
    """Whether prefill chunks over this cache can take the AMX kernel (``bf16_tiles=True`` below): a
    float32 or float16 CPU cache with head size 64 or 128 on a machine with AMX bfloat16 tiles
    (``PAGELLM_CPU_AMX=0`` says no, as it does for the GEMMs)."""
    if key_cache.device.type != "cpu" or key_cache.dtype not in _PREFILL_AMX \
            or os.environ.get("PAGELLM_CPU_AMX", "1") == "0":
        return False
    lib = kernels.load("paged_prefill_amx", _PREFILL_AMX_SIGNATURES)
    return lib is not None and bool(lib.paged_prefill_amx_supported(key_cache.shape[-1]))


def paged_prefill_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor, token_starts: torch.Tensor,
                            num_computed: torch.Tensor, query_lens: torch.Tensor, block_size: int,
                            scale: float, bf16_tiles: bool = False, window: int | None = None,
                            softcap: float | None = None) -> None:
    """Causal attention of every prefill chunk of a step over its sequence's cached K/V.

    Chunk ``c``'s tokens are rows ``token_starts[c] ..`` of ``query`` ``[T, Hq, D]`` (rows may be
    strided, heads contiguous) and of ``out`` ``[T, Hq * D]``, at positions ``num_computed[c] ..``;
    their own K/V must already be in the cache. ``block_tables`` ``[C, max_blocks]`` and the
    per-chunk vectors are contiguous int64 CPU tensors.

    ``window``: a query at position ``p`` sees keys ``p - window < k <= p``; ``softcap``: each score
    ``s`` becomes ``softcap * tanh(s / softcap)`` (both as the decode kernel applies them).

    ``bf16_tiles``: q, K, V and the softmax weights rounded to bfloat16, products summed in float32
    on AMX tiles (``paged_prefill_amx.c``; see :func:`prefill_bf16_tiles_usable_for`). Batch
    invariant, but not the decode kernel's sums: only for runs that never decode (pooling), and
    without a window or a soft-cap.
    """
    _check_window_softcap(window, softcap)
    if bf16_tiles and (window is not None or softcap is not None):
        raise ValueError("the AMX prefill kernel has no sliding window or soft-cap")
    if bf16_tiles:
        lib = kernels.load("paged_prefill_amx", _PREFILL_AMX_SIGNATURES)
        usable, names = prefill_bf16_tiles_usable_for(key_cache), _PREFILL_AMX
    else:
        lib = kernels.load("paged_prefill", _PREFILL_SIGNATURES)
        usable, names = prefill_usable_for(key_cache), _PREFILL
    assert lib is not None, "check prefill_usable_for() / prefill_bf16_tiles_usable_for() first"
    t, hq, d = query.shape
    hkv = key_cache.shape[1]
    if query.dtype != torch.float32 or query.stride(2) != 1 or query.stride(1) != d:
        raise ValueError("query must be float32 with contiguous heads")
    if out.dtype != torch.float32 or out.shape != (t, hq * d) or out.stride(1) != 1:
        raise ValueError("out must be float32 [T, Hq * D] with contiguous rows")
    for x, name in ((key_cache, "key_cache"), (value_cache, "value_cache")):
        if x.dtype != key_cache.dtype or x.dtype not in names or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous {', '.join(str(t)[6:] for t in names)} (both caches the same)")
    if not usable:
        raise ValueError(f"no {'AMX ' if bf16_tiles else ''}prefill kernel for head size {d} on this machine")
    for x, name in ((block_tables, "block_tables"), (token_starts, "token_starts"), (num_computed, "num_computed"),
                    (query_lens, "query_lens")):
        if x.dtype != torch.int64 or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous int64")
    args = (out.data_ptr(), out.stride(0), query.data_ptr(), query.stride(0), key_cache.data_ptr(),
            value_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], token_starts.data_ptr(),
            num_computed.data_ptr(), query_lens.data_ptr(), len(token_starts), hq, hkv, block_size, scale, d)
    kernel = getattr(lib, names[key_cache.dtype])
    status = kernel(*args) if bf16_tiles else kernel(*args, window or 0, softcap or 0.0)
    _check_status(status, "prefill")
