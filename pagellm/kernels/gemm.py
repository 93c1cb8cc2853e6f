"""The packed-weight float32 GEMM (``gemm.c``): ``y = x W^T + b`` with ``W`` packed once.

Callers (``layers/linear.py``) pack a weight with :func:`pack` after loading and then call
:func:`linear`. A weight whose values are exactly GGUF blocks (Q4_1 or Q8_0, dequantized) can
also be packed in 4 or 8 bits with :func:`pack_quantized`; ``linear(..., bits=4 or 8)`` over that
copy gives the same results bit for bit while reading a fifth (a quarter) of the bytes.

Where the kernel cannot run (neither AVX-512 nor AVX2 with FMA, no compiler, ``PAGELLM_CPU_KERNELS=0``, a non-float32
or non-CPU weight, or ``PAGELLM_CPU_GEMM=0`` to compare against MKL) :func:`usable` says so and
the caller keeps ``F.linear``, which is also the oracle in ``tests/test_gemm.py``.
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
    "packed_size_q": (_I, [_I, _I, _I]),
    "pack_weight_q": (ctypes.c_int, [_P, _P, _I, _I, _I]),
    "gemm_packed_q": (None, [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I]),
    "gemm_bf16_supported": (ctypes.c_int, []),
    "packed_size_bf16": (_I, [_I, _I]),
    "pack_weight_bf16": (None, [_P, _P, _I, _I]),
    "gemm_packed_bf16": (ctypes.c_int, [_P, _I, _P, _I, _P, _P, _I, _I, _I]),
    "gemm_amx_supported": (ctypes.c_int, []),
    "gemm_packed_bf16_amx": (ctypes.c_int, [_P, _I, _P, _I, _P, _P, _I, _I, _I]),
    "gemm_grouped": (ctypes.c_int, [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I]),
    "mlp_silu_bf16_amx": (ctypes.c_int, [_P, _I, _P, _I, _P, _P, _I, _I, _I]),
}


def _lib() -> ctypes.CDLL | None:
    lib = kernels.load("gemm", SIGNATURES)
    return lib if lib is not None and lib.gemm_f32_supported() else None


def usable(weight: torch.Tensor) -> bool:
    """Whether ``weight [N, K]`` can be packed for the kernel on this machine."""
    return (weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype == torch.float32
            and os.environ.get("PAGELLM_CPU_GEMM", "1") != "0" and _lib() is not None)


def _packing_lib(weight: torch.Tensor) -> ctypes.CDLL:
    """The kernel library, or a ``ValueError`` naming why ``weight`` cannot be packed here."""
    lib = _lib()
    if lib is None or not usable(weight):
        raise ValueError(f"cannot pack a {weight.dtype} {tuple(weight.shape)} weight on {weight.device} "
                         "for the CPU GEMM kernel")
    return lib


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of ``weight [N, K]``: 1-D, ``[ceil(N / 32)][K][32]``, zero-padded."""
    lib = _packing_lib(weight)
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = torch.empty(lib.packed_size_f32(n, k), dtype=torch.float32)
    lib.pack_weight_f32(out.data_ptr(), w.data_ptr(), n, k)
    return out


def bf16_supported() -> bool:
    """Whether this machine runs the bfloat16 kernel (AVX512-BF16 dot products); ``PAGELLM_CPU_BF16=0``
    or ``PAGELLM_CPU_GEMM=0`` say no."""
    lib = _lib()
    return (lib is not None and bool(lib.gemm_bf16_supported()) and os.environ.get("PAGELLM_CPU_BF16", "1") != "0"
            and os.environ.get("PAGELLM_CPU_GEMM", "1") != "0")


def amx_supported() -> bool:
    """Whether this machine (and its kernel: Linux grants the tile state per process) runs AMX bf16
    tiles; ``PAGELLM_CPU_AMX=0`` says no."""
    lib = _lib()
    return (bf16_supported() and lib is not None and os.environ.get("PAGELLM_CPU_AMX", "1") != "0"
            and bool(lib.gemm_amx_supported()))


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` rounded to bfloat16 (nearest even) and packed in pairs of k for
    ``linear(..., bits=16)`` (held in an int32 tensor: one pair per element)."""
    lib = _packing_lib(weight)
    if not bf16_supported():
        raise ValueError("no bfloat16 GEMM kernel on this machine (AVX512-BF16)")
    n, k = weight.shape
    w = weight.detach().contiguous()
    out = torch.empty(lib.packed_size_bf16(n, k), dtype=torch.int32)
    lib.pack_weight_bf16(out.data_ptr(), w.data_ptr(), n, k)
    return out


def pack_quantized(weight: torch.Tensor, bits: int) -> torch.Tensor | None:
    """``weight [N, K]`` in ``bits`` (4 or 8), or ``None`` unless every run of 32 values along K is
    exactly one GGUF block: ``d * q + m`` (rounded after each step) with integers ``q`` in 0..15
    for 4 bits (Q4_1), ``d * q`` with ``q`` in -128..127 for 8 bits (Q8_0). Checked value by
    value, so the copy can never change a result."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    lib = _packing_lib(weight)
    n, k = weight.shape
    if k % 32:
        return None
    w = weight.detach().contiguous()
    out = torch.empty(lib.packed_size_q(n, k, bits), dtype=torch.float32)
    return out if lib.pack_weight_q(out.data_ptr(), w.data_ptr(), n, k, bits) else None


def check_bias(bias: torch.Tensor | None, out_features: int) -> None:
    """What a packed-weight kernel reads as the bias: ``None`` or contiguous float32 ``[out_features]``."""
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"bias must be contiguous float32 of shape ({out_features},), got {tuple(bias.shape)}")


def rows_and_output(x: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The checks every packed-weight kernel needs on ``x [..., K]`` and ``bias``; ``x`` as rows with
    contiguous last dimension, and the uninitialised float32 output ``[rows, out_features]``."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be float32 on the CPU, got {x.dtype} on {x.device}")
    check_bias(bias, out_features)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, torch.empty(x2.shape[0], out_features, dtype=torch.float32)


def kernel_addresses() -> dict[str, int]:
    """The GEMM kernels' addresses by kind (``kernels/decode_graph.c`` calls them through a table);
    empty where the kernel cannot run."""
    lib = _lib()
    if lib is None:
        return {}
    return {"float32": kernels.address(lib.gemm_packed_f32), "quantized": kernels.address(lib.gemm_packed_q),
            "bfloat16": kernels.address(lib.gemm_packed_bf16),
            "bfloat16_amx": kernels.address(lib.gemm_packed_bf16_amx)}


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           bits: int = 32, amx: bool = False) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., out_features]`` for ``packed = pack(W)``,
    ``packed = pack_quantized(W, bits)`` with the same ``bits``, or ``pack_bf16(W)`` with ``bits=16``
    (then x is rounded to bfloat16 too; sums and the output stay float32), on AMX tiles if ``amx``.
    Each variant gives a row the same result whatever else is in ``x``; the two bf16 variants
    differ from each other in the order of their sums, so a model uses one of them throughout."""
    lib = _lib()
    assert lib is not None, "check usable() before pack()"
    k = x.shape[-1]
    if bits not in (4, 8, 16, 32):
        raise ValueError(f"bits must be 4, 8, 16 or 32, got {bits!r}")
    if bits == 32:
        size = lib.packed_size_f32(out_features, k)
    elif bits == 16:
        size = lib.packed_size_bf16(out_features, k)
    else:
        size = lib.packed_size_q(out_features, k, bits)
    if packed.numel() != size or (bits in (4, 8) and k % 32):
        raise ValueError(f"packed {bits}-bit weight of {packed.numel()} floats does not fit [{out_features}, {k}]")
    x2, y = rows_and_output(x, bias, out_features)
    m = x2.shape[0]
    if m:
        args = (y.data_ptr(), out_features, x2.data_ptr(), x2.stride(0) if m > 1 else k,
                packed.data_ptr(), None if bias is None else bias.data_ptr(), m, out_features, k)
        if bits == 32:
            lib.gemm_packed_f32(*args)
        elif bits == 16:
            if (lib.gemm_packed_bf16_amx if amx else lib.gemm_packed_bf16)(*args) != 0:
                raise MemoryError("the bfloat16 GEMM could not allocate its scratch for x")
        else:
            lib.gemm_packed_q(*args, bits)
    return y.view(*x.shape[:-1], out_features)


def mlp_silu_amx(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, hidden: int,
                 intermediate: int) -> torch.Tensor:
    """``down(silu(gate) * up)`` with ``gate | up = x Wgu^T``, for ``gate_up = pack_bf16(Wgu [2I, H])``
    and ``down = pack_bf16(Wd [H, I])``, on AMX tiles in one call: the same bits as
    ``linear(..., bits=16, amx=True)``, ``cpu_ops.silu_and_mul`` and ``linear`` again (the activations
    stay bfloat16 rows in cache between the products). ``I`` must be a multiple of 32."""
    lib = _lib()
    assert lib is not None, "check amx_supported() before pack_bf16()"
    if intermediate % 32 or x.shape[-1] != hidden:
        raise ValueError(f"x [..., {x.shape[-1]}] and intermediate {intermediate} do not fit the fused MLP "
                         f"(hidden {hidden}; intermediate a multiple of 32)")
    if gate_up.numel() != lib.packed_size_bf16(2 * intermediate, hidden) \
            or down.numel() != lib.packed_size_bf16(hidden, intermediate):
        raise ValueError(f"packed weights do not fit gate/up [{2 * intermediate}, {hidden}] and down "
                         f"[{hidden}, {intermediate}]")
    x2, y = rows_and_output(x, None, hidden)
    m = x2.shape[0]
    if m and lib.mlp_silu_bf16_amx(y.data_ptr(), hidden, x2.data_ptr(), x2.stride(0) if m > 1 else hidden,
                                   gate_up.data_ptr(), down.data_ptr(), m, hidden, intermediate) != 0:
        raise MemoryError("the fused MLP could not allocate its scratch")
    return y.view(*x.shape[:-1], hidden)


def linear_grouped(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, out_features: int,
                   bits: int, amx: bool = False) -> torch.Tensor:
    """Many weights of one shape in one call: rows ``offsets[g] .. offsets[g + 1]`` of ``x [M, K]``
    times weight ``g``'s transpose, for ``weights`` the ``data_ptr()`` of each (int64 ``[G]``, every
    one packed alike: :func:`pack` with ``bits=32``, :func:`pack_bf16` with ``bits=16``, AMX tiles
    if ``amx``; no bias) and ``offsets`` int64 ``[G + 1]`` from 0 to ``M``. A row's result is what
    :func:`linear` over its own weight gives it, bit for bit. The caller keeps the weights alive."""
    lib = _lib()
    assert lib is not None, "check usable() before pack()"
    if bits not in (16, 32):
        raise ValueError(f"bits must be 16 or 32 for grouped weights, got {bits!r}")
    g = weights.shape[0]
    if weights.dtype != torch.int64 or weights.dim() != 1 or not weights.is_contiguous():
        raise ValueError("weights must be a contiguous int64 tensor of addresses")
    if offsets.dtype != torch.int64 or offsets.shape != (g + 1,) or not offsets.is_contiguous():
        raise ValueError(f"offsets must be contiguous int64 [{g + 1}]")
    x2, y = rows_and_output(x, None, out_features)
    if x2.dim() != 2 or int(offsets[0]) != 0 or int(offsets[-1]) != x2.shape[0] or bool((offsets.diff() < 0).any()):
        raise ValueError(f"offsets must rise from 0 to the {x2.shape[0]} rows of x")
    if x2.shape[0] and lib.gemm_grouped(y.data_ptr(), out_features, x2.data_ptr(), x2.stride(0), weights.data_ptr(),
                                        offsets.data_ptr(), g, out_features, x2.shape[1], bits, int(amx)) != 0:
        raise MemoryError("the grouped GEMM could not allocate its scratch (or this machine lacks its kind)")
    return y
