"""The small per-token ops of a step as Triton kernels, for a CUDA device: RMSNorm with the residual
add, SiLU/GeLU(tanh) times up, and rotary with the K/V cache write. Eagerly each is several torch
kernels of a microsecond or two (a 30-layer decode step ran some 50 of them); here each is one.

Every kernel takes one row per program and sums a row in one fixed order, so a row's bits never
depend on the batch (scheduling must never change greedy outputs). Each op's oracle is its layer's
``forward_native`` (``layers/``): float32 equal within rounding, 16-bit types within their own. On a
CPU they run only under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, res_ptr, w_ptr, n_heads, stride_xt, stride_xh, stride_rt, stride_ot, stride_oh,
                     eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Row ``(t, h)``: ``x += residual`` (stored back to ``residual``), then ``w * x / rms(x)``."""
    row = tl.program_id(0)
    t = row // n_heads
    h = row % n_heads
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + t * stride_rt + cols, mask=ok, other=0.0)  # (in the input's dtype, as HF)
        tl.store(res_ptr + t * stride_rt + cols, x, mask=ok)
    h32 = x.to(tl.float32)
    y = h32 * tl.rsqrt(tl.sum(h32 * h32, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = y.to(x.dtype).to(tl.float32) * w.to(tl.float32)  # (HF: the weight times the norm cast back)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``layers.norm.RMSNorm``'s arithmetic over the rows of ``x`` (``[T, N]``, or ``[T, H, N]`` heads
    with unit stride in ``N``); ``residual`` (``[T, N]``) becomes ``x + residual`` in place."""
    heads = x.shape[1] if x.dim() == 3 else 1
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    stride_xh, stride_oh = (x.stride(1), out.stride(1)) if x.dim() == 3 else (0, 0)
    res = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0] * heads,)](
        out, x, res, weight, heads, x.stride(0), stride_xh, res.stride(0), out.stride(0), stride_oh, eps,
        N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None)
    return out


@triton.jit
def tanh(x):
    """``tanh`` through ``exp`` (the attention kernel's soft-cap takes it too)."""
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _act_and_mul_kernel(out_ptr, x_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr, GELU: tl.constexpr):
    """``act(gate) * up`` for one row's columns ``BLOCK * j ..``: ``x = [gate | up]``."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    if GELU:  # (gelu_pytorch_tanh)
        a = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
    else:
        a = g / (1.0 + tl.exp(-g))
    y = a.to(gate.dtype).to(tl.float32) * up.to(tl.float32)  # (the activation in the model's dtype, as torch)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def act_and_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:
    """``[T, 2I]`` -> ``silu(gate) * up`` (``gelu``: ``gelu_tanh(gate) * up``) ``[T, I]``."""
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _act_and_mul_kernel[(t, triton.cdiv(n, block))](out, gate_up, n, gate_up.stride(0), out.stride(0),
                                                     BLOCK=block, GELU=gelu)
    return out


@triton.jit
def _rotary_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
                         stride_kcs, stride_kch, stride_vcs, stride_vch,
                         HQ: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, HALF: tl.constexpr,
                         D_PADDED: tl.constexpr, WRITE: tl.constexpr):
    """Head ``h`` of token ``t``: a query head rotated in place; a key head rotated in place and,
    with ``WRITE``, copied with its value head into the caches at the token's slot."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, HALF)
    jok = j < ROT // 2
    c1 = tl.load(cos_ptr + t * stride_ct + j, mask=jok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + ROT // 2 + j, mask=jok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_ct + j, mask=jok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_ct + ROT // 2 + j, mask=jok, other=0.0).to(tl.float32)
    if h < HQ:
        base = q_ptr + t * stride_qt + h * stride_qh
    else:
        base = k_ptr + t * stride_kt + (h - HQ) * stride_kh
    x1 = tl.load(base + j, mask=jok, other=0.0)
    x2 = tl.load(base + ROT // 2 + j, mask=jok, other=0.0)
    y1 = (x1.to(tl.float32) * c1 - x2.to(tl.float32) * s1).to(x1.dtype)  # (HF's rotate-half)
    y2 = (x2.to(tl.float32) * c2 + x1.to(tl.float32) * s2).to(x1.dtype)
    tl.store(base + j, y1, mask=jok)
    tl.store(base + ROT // 2 + j, y2, mask=jok)
    if WRITE and h >= HQ:
        kh = h - HQ
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kc = kc_ptr + slot * stride_kcs + kh * stride_kch
        tl.store(kc + j, y1.to(kc_ptr.dtype.element_ty), mask=jok)
        tl.store(kc + ROT // 2 + j, y2.to(kc_ptr.dtype.element_ty), mask=jok)
        d = tl.arange(0, D_PADDED)
        rest = (d >= ROT) & (d < D)  # the features past the rotary width, as they are
        tl.store(kc + d, tl.load(base + d, mask=rest, other=0.0).to(kc_ptr.dtype.element_ty), mask=rest)
        dok = d < D
        v = tl.load(v_ptr + t * stride_vt + kh * stride_vh + d, mask=dok, other=0.0)
        tl.store(vc_ptr + slot * stride_vcs + kh * stride_vch + d, v.to(vc_ptr.dtype.element_ty), mask=dok)


def rotary_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, cos: torch.Tensor,
                        sin: torch.Tensor, key_cache: torch.Tensor | None = None,
                        value_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None) -> None:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place by ``cos``/``sin`` (``[T, 1, R]``, the
    first ``R`` features; ``layers.rotary.apply_rotary``'s arithmetic); with caches, write the
    rotated keys and ``v`` into slots ``slot_mapping`` of ``[num_slots, Hkv, D]`` caches."""
    t, hq, d = q.shape
    rot = cos.shape[-1]
    cos, sin = cos.reshape(t, rot), sin.reshape(t, rot)
    write = key_cache is not None
    kc = key_cache if key_cache is not None else k
    vc = value_cache if value_cache is not None else k
    v = v if v is not None else k
    _rotary_write_kernel[(t, hq + k.shape[1])](
        q, k, v, cos, sin, kc, vc, slot_mapping if slot_mapping is not None else cos,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        HQ=hq, D=d, ROT=rot, HALF=triton.next_power_of_2(max(rot // 2, 1)), D_PADDED=triton.next_power_of_2(d),
        WRITE=write)
