"""The packed-weight float32 GEMM (``gemm.c``): ``y = x W^T + b`` with ``W`` packed once.

Callers (``layers/linear.py``) pack a weight with :func:`pack` after loading and then call
:func:`linear`. A weight whose values are exactly 4-bit blocks (GGUF's Q4_1, dequantized) can
also be packed in 4 bits with :func:`pack_q4`; ``linear(..., bits=4)`` over that copy gives the
same results bit for bit while reading about a fifth of the bytes. Where the kernel cannot run
(no AVX-512, no compiler, ``PAGELLM_CPU_KERNELS=0``, a non-float32 or non-CPU weight, or
``PAGELLM_CPU_GEMM=0`` to compare against MKL) :func:`usable` says so and the caller keeps
``F.linear``, which is also the oracle in ``tests/test_gemm.py``.
"""

from __future__ import annotations

import ctypes
import os

import torch

from pagellm import kernels

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES: kernels.Signatures = {
    "gemm_f32_supported": (ctypes.c_int, []),
    "packed_size_f32": (_I, [_I, _I]),
    "pack_weight_f32": (None, [_P, _P, _I, _I]),
    "gemm_packed_f32": (None, [_P, _I, _P, _I, _P, _P, _I, _I, _I]),
    "packed_size_q4": (_I, [_I, _I]),
    "pack_weight_q4": (ctypes.c_int, [_P, _P, _I, _I]),
    "gemm_packed_q4": (None, [_P, _I, _P, _I, _P, _P, _I, _I, _I]),
}


def _lib() -> ctypes.CDLL | None:
    lib = kernels.load("gemm", SIGNATURES)
    return lib if lib is not None and lib.gemm_f32_supported() else None


def usable(weight: torch.Tensor) -> bool:
    """Whether ``weight [N, K]`` can be packed for the kernel on this machine."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype == torch.float32
            and os.environ.get("PAGELLM_CPU_GEMM", "1") != "0" and _lib() is not None)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of ``weight [N, K]``: 1-D, ``[ceil(N / 32)][K][32]``, zero-padded."""
    lib = _lib()
    if lib is None or not usable(weight):
        raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight on {weight.device} "
                         "for the CPU GEMM kernel")
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = torch.empty(lib.packed_size_f32(n, k), dtype=torch.float32)
    lib.pack_weight_f32(out.data_ptr(), w.data_ptr(), n, k)
    return out


def pack_q4(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight [N, K]`` in 4 bits, or ``None`` unless every run of 32 values along K is exactly
    ``d * q + m`` (rounded after each step) for one ``d`` and ``m`` and integers ``q`` in 0..15,
    checked value by value, so the 4-bit copy can never change a result."""
    lib = _lib()
    if lib is None or not usable(weight):
        raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight on {weight.device} "
                         "for the CPU GEMM kernel")
    n, k = weight.shape
    if k % 32:
        return None
    w = weight.detach().contiguous()
    out = torch.empty(lib.packed_size_q4(n, k), dtype=torch.float32)
    return out if lib.pack_weight_q4(out.data_ptr(), w.data_ptr(), n, k) else None


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           bits: int = 32) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., out_features]`` for ``packed = pack(W)``, or
    ``packed = pack_q4(W)`` with ``bits=4``."""
    lib = _lib()
    assert lib is not None, "check usable() before pack()"
    k = x.shape[-1]
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be float32 on the CPU, got {x.dtype} on {x.device}")
    if bits not in (4, 32):
        raise ValueError(f"bits must be 4 or 32, got {bits!r}")
    size, gemm = ((lib.packed_size_f32, lib.gemm_packed_f32) if bits == 32
                  else (lib.packed_size_q4, lib.gemm_packed_q4))
    if packed.numel() != size(out_features, k) or (bits == 4 and k % 32):
        raise ValueError(f"packed {bits}-bit weight of {packed.numel()} floats does not fit [{out_features}, {k}]")
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous float32 of shape ({out_features},), got {tuple(bias.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        gemm(y.data_ptr(), out_features, x2.data_ptr(), x2.stride(0) if m > 1 else k,
             packed.data_ptr(), None if bias is None else bias.data_ptr(), m, out_features, k)
    return y.view(*x.shape[:-1], out_features)
