"""State layers' per-token kernels on CPU float32 tensors (``linear_attention.c``): a causal
depthwise convolution over each sequence's convolution state, the gated delta rule (Qwen3.5's
gated DeltaNet) and Mamba2's selective state update (Granite 4) over its recurrent state, and
Mamba2's gated group norm. Their PyTorch equivalents are the layers' native paths
(``models/qwen3_5.py``, ``models/granite_hybrid.py``), which ``tests/test_linear_attention.py``
compares them against.

``spans``: a step's sequences as ``(first flat row, rows, fresh, state block)`` each
(``attention.metadata.StateMetadata``).
"""

from __future__ import annotations

import ctypes

import torch

from pagellm import kernels

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES: kernels.Signatures = {
    "causal_conv_f32": (None, [_P, _I, _P, _I, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int]),
    "mamba2_ssm_f32": (None, [_P, _P, _I, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P]),
    "gated_group_norm_f32": (None, [_P, _P, _I, _P, _I, _I, _I, _F, _P]),
    "gated_delta_rule_f32": (None, [_P, _P, _P, _P, _I, _P, _P, _P, _F, _P, _I, _P, _I, _I, _I, _I, _I, _I, _P]),
}
MAX_TAPS, MAX_HEAD = 17, 512  # (the kernels' stack buffers)


def _lib() -> ctypes.CDLL:
    lib = kernels.load("linear_attention", _SIGNATURES)
    assert lib is not None, "check available() first"
    return lib


def available() -> bool:
    """Build (once) and load the library; ``False`` when disabled or impossible."""
    return kernels.load("linear_attention", _SIGNATURES) is not None


def _spans(spans: list[tuple[int, int, bool, int]]) -> torch.Tensor:
    return torch.tensor([[r, n, int(f), b] for r, n, f, b in spans], dtype=torch.int64)


def _check(t: torch.Tensor, name: str, dim: int) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != dim or t.stride(-1) != 1:
        raise ValueError(f"{name} must be a CPU float32 {dim}-D tensor with a contiguous last dimension")


def _blocks_apart(state: torch.Tensor) -> bool:
    """Whether each block's state is contiguous (blocks any stride apart: views of the K/V pages)."""
    return state.dtype == torch.float32 and state.device.type == "cpu" and state[0].is_contiguous()


def _out(out: torch.Tensor | None, rows: int, width: int) -> torch.Tensor:
    """The output: ``out`` (a round's rows written into a step's) or a new ``[rows, width]``."""
    if out is None:
        return torch.empty(rows, width, dtype=torch.float32)
    if out.shape != (rows, width) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{rows}, {width}]")
    return out


def causal_conv(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                spans: list[tuple[int, int, bool, int]], silu: bool, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, C]`` (rows strided allowed) convolved along each span's rows by ``weight [C, taps]``
    after its ``state [blocks, C, taps - 1]`` (zeros where fresh), plus ``bias``, SiLU after where
    ``silu``; the states rewritten. Returns ``[T, C]`` (``out``: the spans' rows written there)."""
    _check(x, "x", 2)
    c, taps = weight.shape
    if taps > MAX_TAPS or not _blocks_apart(state) or state.shape[1:] != (c, taps - 1):
        raise ValueError(f"state must be a float32 [blocks, {c}, {taps - 1}], each block's contiguous "
                         f"(taps <= {MAX_TAPS})")
    out = _out(out, x.shape[0], c)
    sp = _spans(spans)
    w = weight.float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    _lib().causal_conv_f32(x.data_ptr(), x.stride(0), state.data_ptr(), state.stride(0), w.data_ptr(),
                           None if b is None else b.data_ptr(), out.data_ptr(), sp.data_ptr(), len(spans), c, taps,
                           int(silu))
    return out


def gated_delta_rule(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, ssm_a: torch.Tensor,
                     dt_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float, state: torch.Tensor,
                     spans: list[tuple[int, int, bool, int]], num_k_heads: int, tiled: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule over each span's tokens in order, and its gated RMSNorm:
    ``mixed [T, 2 Hk K + Hv V]`` the convolved ``q | k | v``; ``z [T, Hv V]``, ``b, a [T, Hv]`` views
    of one projection's rows (one row stride); ``ssm_a [Hv]`` the decay rates ``-exp(A_log)``;
    ``state [blocks, Hv, K, V]`` (each block's contiguous) read and rewritten. Value head ``h`` reads
    key head ``h // (Hv / Hk)``, or ``h % Hk`` when ``tiled`` (llama.cpp's order of the value heads).
    Returns ``[T, Hv V]`` (``out``: the spans' rows written there)."""
    hv, k_dim, v_dim = state.shape[1:]
    for t, name in ((mixed, "mixed"), (z, "z"), (b, "b"), (a, "a")):
        _check(t, name, 2)
    if not mixed.is_contiguous() or mixed.shape[1] != 2 * num_k_heads * k_dim + hv * v_dim:
        raise ValueError("mixed must be a contiguous [T, 2 Hk K + Hv V]")
    if not (z.stride(0) == b.stride(0) == a.stride(0)):
        raise ValueError("z, b and a must share one row stride (views of one projection's rows)")
    if not _blocks_apart(state) or max(k_dim, v_dim) > MAX_HEAD:
        raise ValueError(f"state must be a float32 [blocks, Hv, K, V], each block's contiguous (K, V <= {MAX_HEAD})")
    out = _out(out, mixed.shape[0], hv * v_dim)
    sp = _spans(spans)
    f32 = [p.float().contiguous() for p in (ssm_a, dt_bias, norm_weight)]
    _lib().gated_delta_rule_f32(mixed.data_ptr(), z.data_ptr(), b.data_ptr(), a.data_ptr(), z.stride(0),
                                *(p.data_ptr() for p in f32), eps, state.data_ptr(), state.stride(0), sp.data_ptr(),
                                len(spans), num_k_heads, hv, k_dim, v_dim, int(tiled), out.data_ptr())
    return out


def mamba2_ssm(xbc: torch.Tensor, dt: torch.Tensor, ssm_a: torch.Tensor, dt_bias: torch.Tensor, d: torch.Tensor,
               state: torch.Tensor, spans: list[tuple[int, int, bool, int]], num_groups: int,
               out: torch.Tensor | None = None, dt_min: float = 0.0) -> torch.Tensor:
    """Mamba2's selective state update over each span's tokens in order: ``xbc [T, H P + 2 G N]`` the
    convolved ``x | B | C``, ``dt [T, H]`` (rows strided allowed); ``ssm_a [H]`` the decay rates
    ``-exp(A_log)``; ``state [blocks, H, P, N]`` (each block's contiguous) read and rewritten;
    ``softplus(dt + dt_bias)`` floored at ``dt_min``. Returns ``y [T, H P]`` (before the gated norm;
    ``out``: the spans' rows written there)."""
    h, p, n = state.shape[1:]
    _check(xbc, "xbc", 2)
    _check(dt, "dt", 2)
    if not xbc.is_contiguous() or xbc.shape[1] != h * p + 2 * num_groups * n or h % num_groups:
        raise ValueError("xbc must be a contiguous [T, H P + 2 G N], H a multiple of G")
    if not _blocks_apart(state) or n > MAX_HEAD:
        raise ValueError(f"state must be a float32 [blocks, H, P, N], each block's contiguous (N <= {MAX_HEAD})")
    out = _out(out, xbc.shape[0], h * p)
    sp = _spans(spans)
    f32 = [t.float().contiguous() for t in (ssm_a, dt_bias, d)]
    _lib().mamba2_ssm_f32(xbc.data_ptr(), dt.data_ptr(), dt.stride(0), *(t.data_ptr() for t in f32), state.data_ptr(),
                          state.stride(0), sp.data_ptr(), len(spans), h, p, n, num_groups, dt_min, out.data_ptr())
    return out


def gated_group_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                     eps: float) -> torch.Tensor:
    """``weight * groupnorm(y * silu(z))``, each row's features RMS-normed ``group_size`` at a time:
    ``y [T, I]`` contiguous, ``z [T, I]`` (rows strided allowed). Returns ``[T, I]``."""
    _check(y, "y", 2)
    _check(z, "z", 2)
    t, i = y.shape
    if not y.is_contiguous() or z.shape != y.shape or i % group_size:
        raise ValueError("y must be contiguous, z of its shape, and its width a multiple of group_size")
    out = torch.empty(t, i, dtype=torch.float32)
    w = weight.float().contiguous()
    _lib().gated_group_norm_f32(y.data_ptr(), z.data_ptr(), z.stride(0), w.data_ptr(), t, i, group_size, eps,
                                out.data_ptr())
    return out
