"""Fused decoder ops on CPU float32 tensors (``cpu_ops.c``), each with its PyTorch equivalent.

The callers are ``CustomOp.forward_cpu`` methods (``layers/``, ``sampling/``) and the ``"cpu"``
attention backend, given these ops once at start-up (``layers/custom_op.select_kernels``); their
``forward_native`` is the plain PyTorch code ``tests/test_cpu_ops.py`` compares every op against.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from pagellm import kernels

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES: kernels.Signatures = {
    "rms_norm_f32": (None, [_P, _I, _P, _P, _P, _I, _I, _F]),
    "rms_norm_heads_f32": (None, [_P, _I, _P, _P, _I, _I, _I, _F]),
    "rotary_f32": (None, [_P, _I, _P, _P, _I, _I, _I]),
    "silu_and_mul_f32": (None, [_P, _P, _I, _I]),
    "gelu_tanh_and_mul_f32": (None, [_P, _P, _I, _I]),
    "moe_combine_f32": (None, [_P, _P, _P, _P, _I, _I, _I]),
    "write_kv_f32": (None, [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I]),
    "write_kv_f16": (None, [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I]),
    "write_kv_i8": (None, [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I]),
    "argmax_logsumexp_f32": (None, [_P, _I, _I, _I, _P, _P]),
    "apply_token_bitmask_f32": (None, [_P, _I, _I, _P, _I, _P, _P, _I]),
}
_WRITE_KV = {torch.float32: "write_kv_f32", torch.float16: "write_kv_f16", torch.int8: "write_kv_i8"}


def _lib() -> ctypes.CDLL:
    lib = kernels.load("cpu_ops", _SIGNATURES)
    assert lib is not None, "check available() first"
    return lib


def available() -> bool:
    """Build (once) and load the library; ``False`` when disabled or impossible."""
    return kernels.load("cpu_ops", _SIGNATURES) is not None


def writes_kv_into(key_cache: torch.Tensor) -> bool:
    """Whether :func:`write_kv` handles a cache of this dtype and device."""
    return key_cache.device.type == "cpu" and key_cache.dtype in _WRITE_KV and available()


def address(name: str) -> int:
    """The address of one of these kernels (``kernels/decode_graph.c`` calls them through a table)."""
    return kernels.address(getattr(_lib(), name))


def write_kv_address(key_cache: torch.Tensor) -> int | None:
    """The address of the K/V write kernel for this cache's dtype, ``None`` if :func:`write_kv` cannot write it."""
    return address(_WRITE_KV[key_cache.dtype]) if writes_kv_into(key_cache) else None


def _rows(x: torch.Tensor, name: str) -> int:
    """Row stride of a 2-D view whose last dimension is contiguous."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D with a contiguous last dimension, got strides {x.stride()}")
    return x.stride(0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``norm(x)``; with ``residual``: ``residual += x`` in place, then ``norm(residual)``.

    ``x [T, n]`` (row-strided allowed), ``residual [T, n]`` contiguous; returns ``out``, or a new
    ``[T, n]``. With ``residual``, ``out`` may be ``x`` itself (each row is read whole before its
    result is written).
    """
    t, n = x.shape
    if out is None:
        out = torch.empty(t, n, dtype=x.dtype)
    elif out.shape != (t, n) or out.dtype != x.dtype or not out.is_contiguous() \
            or (out.data_ptr() == x.data_ptr() and (residual is None or x.stride(0) != n)):
        raise ValueError(f"out must be a contiguous {x.dtype} [{t}, {n}] (x itself only with a residual)")
    if residual is not None and not residual.is_contiguous():
        raise ValueError("residual must be contiguous")
    _lib().rms_norm_f32(x.data_ptr(), _rows(x, "x"), None if residual is None else residual.data_ptr(),
                      weight.contiguous().data_ptr(), out.data_ptr(), t, n, eps)
    return out


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``norm`` of every head row of ``x [T, H, n]`` (rows strided allowed, heads contiguous);
    returns a new contiguous ``[T, H, n]``."""
    t, h, n = x.shape
    if x.stride(2) != 1 or x.stride(1) != n:
        raise ValueError(f"x must have contiguous heads, got strides {x.stride()}")
    out = torch.empty(t, h, n, dtype=x.dtype)
    _lib().rms_norm_heads_f32(x.data_ptr(), x.stride(0), weight.contiguous().data_ptr(), out.data_ptr(), t, h, n, eps)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``x [T, H, D]`` in place (heads contiguous, any row stride) by per-token ``cos/sin [T, D]``."""
    t, h, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d:
        raise ValueError(f"x must have contiguous heads, got strides {x.stride()}")
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    _lib().rotary_f32(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, h, d)


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor:
    t, two_i = gate_up.shape
    gate_up = gate_up.contiguous()
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    getattr(_lib(), kernel)(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2I]`` contiguous; returns ``[T, I]``."""
    return _gated("silu_and_mul_f32", gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` for ``gate_up [T, 2I]`` contiguous; returns ``[T, I]``."""
    return _gated("gelu_tanh_and_mul_f32", gate_up)


def moe_combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j y[pos[t, j]] * weights[t, j]`` (products added in ``j`` order) for ``y
    [R, H]`` float32, ``pos`` int64 ``[T, k]`` (rows of ``y``) and ``weights`` float32 ``[T, k]``."""
    t, k = pos.shape
    h = y.shape[1]
    if y.dtype != torch.float32 or weights.dtype != torch.float32 or pos.dtype != torch.int64 \
            or weights.shape != (t, k):
        raise ValueError("moe_combine takes float32 y and weights [T, k] and int64 pos [T, k]")
    if t and (int(pos.min()) < 0 or int(pos.max()) >= y.shape[0]):
        raise ValueError(f"pos must index the {y.shape[0]} rows of y")
    y, pos, weights = y.contiguous(), pos.contiguous(), weights.contiguous()
    out = torch.empty(t, h, dtype=torch.float32)
    _lib().moe_combine_f32(y.data_ptr(), pos.data_ptr(), weights.data_ptr(), out.data_ptr(), t, k, h)
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``key_cache[slot_mapping] = key`` (and value) for float32 ``[T, Hkv, D]`` rows with contiguous
    heads, into a float32 or float16 cache (rounded to nearest) or an int8 one (``kv_quant``'s
    layout and rounding)."""
    t, hkv, d = key.shape
    k2, v2 = key.reshape(t, hkv * d), value.reshape(t, hkv * d)  # views: heads are contiguous within a row
    if key.dtype != torch.float32 or value.dtype != torch.float32:
        raise ValueError("key and value must be float32")
    for c in (key_cache, value_cache):
        if not c.is_contiguous() or c.dtype not in _WRITE_KV or c.dtype != key_cache.dtype:
            raise ValueError("caches must be contiguous float32, float16 or int8 (both the same)")
    if key_cache.shape[1:] != (hkv, d + 4 if key_cache.dtype == torch.int8 else d):  # (+ the scale)
        raise ValueError(f"cache rows {tuple(key_cache.shape[1:])} do not hold [{hkv}, {d}] {key_cache.dtype} K/V")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous int64")
    getattr(_lib(), _WRITE_KV[key_cache.dtype])(k2.data_ptr(), _rows(k2, "key"), v2.data_ptr(), _rows(v2, "value"),
                                              key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
                                              t, hkv, d)


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int], mask_rows: list[int]) -> None:
    """``logits[rows[i]]`` keeps only the tokens set in ``bitmask[mask_rows[i]]`` (numpy ``int32 [M, W]``),
    the rest set to ``-inf``, in place; float32 ``[R, V]`` logits with a contiguous last dimension."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError("logits must be float32 [R, V]")
    words = np.ascontiguousarray(bitmask, dtype=np.int32)
    if words.ndim != 2 or (logits.shape[1] + 31) // 32 > words.shape[1]:
        raise ValueError(f"bitmask must be int32 [M, >= {(logits.shape[1] + 31) // 32}], got {words.shape}")
    if len(rows) != len(mask_rows) or any(not 0 <= r < logits.shape[0] for r in rows) \
            or any(not 0 <= m < words.shape[0] for m in mask_rows):
        raise ValueError("rows / mask_rows out of range")
    r_t = torch.tensor(rows, dtype=torch.int64)
    m_t = torch.tensor(mask_rows, dtype=torch.int64)
    _lib().apply_token_bitmask_f32(logits.data_ptr(), _rows(logits, "logits"), logits.shape[1],
                                   words.ctypes.data, words.shape[1], r_t.data_ptr(), m_t.data_ptr(), len(rows))


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits.argmax(-1), torch.logsumexp(logits, -1))`` for float32 ``[R, V]`` in one pass per
    row; the same first-maximum tie-break as ``argmax``. Rows holding a NaN, or only -inf, go
    through torch."""
    idx, lse = _argmax_lse(logits, with_lse=True)
    assert lse is not None
    return idx, lse


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for float32 ``[R, V]``, as :func:`argmax_logsumexp` without the sum."""
    return _argmax_lse(logits, with_lse=False)[0]


def _argmax_lse(logits: torch.Tensor, with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    r, v = logits.shape
    if r and v == 0:
        raise ValueError("logits must have at least one column")
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    idx = torch.empty(r, dtype=torch.int64)
    lse = torch.empty(r, dtype=torch.float32) if with_lse else None
    if r:
        _lib().argmax_logsumexp_f32(x.data_ptr(), _rows(x, "logits"), r, v, idx.data_ptr(),
                                    None if lse is None else lse.data_ptr())
    bad = idx < 0
    if lse is not None:
        bad |= lse.isnan()
    rows = bad.nonzero().flatten()
    if len(rows):
        idx[rows] = logits[rows].argmax(-1)
        if lse is not None:
            lse[rows] = torch.logsumexp(logits[rows], -1)
    return idx, lse
