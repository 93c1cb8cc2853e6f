"""The int8 GEMM over GGUF blocks (``gemm_int8.c``): weights at their stored 4 or 8 bits, activations
quantized to int8 per block of 32 values on the fly, AVX512-VNNI integer dot products.

Unlike ``gemm.linear(..., bits=4)``, which rebuilds float32 weights and is bit-exact with the float32
kernel, this path changes the numbers (activations are rounded to 8 bits, as in llama.cpp), so it
is a numerics mode of its own (``quantization="gguf"``), held to the quality gate in
``tests/test_numerics.py``. A row's result still depends on nothing but that row.
"""

from __future__ import annotations

import ctypes
import os

import torch

from pagellm import kernels
from pagellm.kernels import gemm

_P, _I = ctypes.c_void_p, ctypes.c_int64
SIGNATURES: kernels.Signatures = {
    "gemm_i8_supported": (ctypes.c_int, []),
    "packed_size_i8": (_I, [_I, _I, _I]),
    "pack_weight_i8": (ctypes.c_int, [_P, _P, _I, _I, _I]),
    "gemm_packed_i8": (ctypes.c_int, [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I]),
}


def _lib() -> ctypes.CDLL | None:
    lib = kernels.load("gemm_int8", SIGNATURES)
    return lib if lib is not None and lib.gemm_i8_supported() else None


def supported() -> bool:
    """Whether this machine runs the int8 kernel (AVX512-VNNI); ``PAGELLM_CPU_INT8=0`` or
    ``PAGELLM_CPU_GEMM=0`` say no."""
    return (os.environ.get("PAGELLM_CPU_INT8", "1") != "0" and os.environ.get("PAGELLM_CPU_GEMM", "1") != "0"
            and _lib() is not None)


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``(packed, bits)`` for a float32 ``weight [N, K]`` whose every run of 32 values along K is
    exactly one GGUF block (Q4_1 tried first, then Q8_0; checked value by value), else ``None``."""
    lib = _lib()
    if lib is None or not gemm.usable(weight) or weight.shape[1] % 32:
        return None
    n, k = weight.shape
    w = weight.detach().contiguous()
    for bits in (4, 8):  # a weight that is not Q4_1 fails on its first block
        out = torch.empty(lib.packed_size_i8(n, k, bits), dtype=torch.uint8)
        if lib.pack_weight_i8(out.data_ptr(), w.data_ptr(), n, k, bits):
            return out, bits
    return None


def linear(x: torch.Tensor, packed: torch.Tensor, bits: int, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., out_features]`` for ``(packed, bits) = pack(W)``,
    with x rounded to int8 per block of 32 (float32 in and out)."""
    lib = _lib()
    assert lib is not None, "check supported() before pack()"
    k = x.shape[-1]
    if bits not in (4, 8) or k % 32 or packed.numel() != lib.packed_size_i8(out_features, k, bits):
        raise ValueError(f"packed {bits}-bit weight of {packed.numel()} bytes does not fit [{out_features}, {k}]")
    x2, y = gemm.rows_and_output(x, bias, out_features)
    m = x2.shape[0]
    if m and lib.gemm_packed_i8(y.data_ptr(), out_features, x2.data_ptr(), x2.stride(0) if m > 1 else k,
                                packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                m, out_features, k, bits) != 0:
        raise MemoryError("the int8 GEMM could not allocate its scratch for x")
    return y.view(*x.shape[:-1], out_features)
