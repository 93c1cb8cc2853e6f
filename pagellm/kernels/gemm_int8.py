"""The int8 GEMM over GGUF blocks (``gemm_int8.c``): weights at their stored width, activations
quantized to int8 on the fly (per block of 32 values, or per super-block of 256 for the K formats),
integer dot products on AVX512-VNNI, AVX2 or plain C: the same bits on each (:func:`isa`).

Unlike ``gemm.linear(..., bits=4)``, which rebuilds float32 weights and is bit-exact with the float32
kernel, this path changes the numbers (activations are rounded to 8 bits, as in llama.cpp), so it
is a numerics mode of its own (``quantization="gguf"``), held to the quality gate in
``tests/test_numerics.py``. A row's result still depends on nothing but that row.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from pagellm import kernels
from pagellm.kernels import gemm

_P, _I = ctypes.c_void_p, ctypes.c_int64
# The weight formats (``bits`` in the C interface): GGUF's legacy blocks of 32 at 4 or 8 bits,
# K-quant super-blocks of 256 (K4: Q4_K's 4 bits; K6: 6 bits, any K type), PARTS: runs of output
# rows each in its own format (a fused projection whose tensors differ in type), and Q4_GROUPS + G
# (:func:`q4_format`): 4-bit blocks whose d and m G consecutive blocks share (an AWQ / GPTQ group).
Q4_BLOCKS, Q8_BLOCKS, K4, K6, PARTS, Q4_GROUPS = 4, 8, 0x104, 0x106, 0x200, 0x10000
FORMATS = {Q4_BLOCKS: "4-bit blocks", Q8_BLOCKS: "8-bit blocks", K4: "K4 super-blocks", K6: "K6 super-blocks",
           PARTS: "parts in their own formats"}


def q4_format(blocks: int) -> int:
    """The format of 4-bit blocks of 32 whose d and m are shared by ``blocks`` consecutive blocks
    (a group of 32 ``blocks`` inputs): 4.5 bits per weight where ``Q4_BLOCKS``' record holds 6."""
    if not 1 <= blocks < 0x10000:
        raise ValueError(f"blocks must be in 1..65535, got {blocks}")
    return Q4_BLOCKS if blocks == 1 else Q4_GROUPS + blocks


def format_name(fmt: int) -> str:
    """How the ``numerics:`` line names a kernel format."""
    return f"4-bit groups of {32 * (fmt - Q4_GROUPS)}" if fmt > Q4_GROUPS else FORMATS.get(fmt, str(fmt))


def _k_multiple(fmt: int) -> int | None:
    """What a weight's K must be a multiple of in ``fmt`` (``None``: not a single format)."""
    if fmt > Q4_GROUPS:
        return 32 * (fmt - Q4_GROUPS) if fmt - Q4_GROUPS < 0x10000 else None
    return {Q4_BLOCKS: 32, Q8_BLOCKS: 32, K4: 256, K6: 256}.get(fmt)
SIGNATURES: kernels.Signatures = {
    "gemm_i8_supported": (ctypes.c_int, []),
    "gemm_i8_amx": (ctypes.c_int, [ctypes.c_int]),
    "packed_size_i8": (_I, [_I, _I, _I]),
    "pack_weight_i8": (ctypes.c_int, [_P, _P, _I, _I, _I]),
    "pack_blocks_i8": (ctypes.c_int, [_P, _P, _P, _P, _I, _I, _I]),
    "pack_kquant": (ctypes.c_int, [_P, _P, _P, _P, _P, _P, _I, _I, _I]),
    "gemm_packed_i8": (ctypes.c_int, [_P, _I, _P, _I, _P, _P, _I, _I, _I, _I]),
}


def _lib() -> ctypes.CDLL | None:
    lib = kernels.load("gemm_int8", SIGNATURES)
    return lib if lib is not None and lib.gemm_i8_supported() else None


def supported() -> bool:
    """Whether the int8 kernel runs here (it builds wherever there is a C compiler);
    ``PAGELLM_CPU_INT8=0`` or ``PAGELLM_CPU_GEMM=0`` say no."""
    return (os.environ.get("PAGELLM_CPU_INT8", "1") != "0" and os.environ.get("PAGELLM_CPU_GEMM", "1") != "0"
            and _lib() is not None)


ISAS = {3: "AVX512-VNNI", 2: "AVX2", 1: "plain C"}


def isa(lib: ctypes.CDLL | None = None) -> str:
    """The instruction set the int8 kernel was built for here (or ``lib``'s, a build with other flags)."""
    lib = lib or _lib()
    return ISAS[lib.gemm_i8_supported()] if lib is not None else "none"


def amx(enable: bool | None = None) -> bool:
    """Whether the K formats run 16-row tiles on AMX (Sapphire Rapids and later; the results are bit
    for bit those of the VNNI path). ``enable`` turns it off or back on (tests compare the two);
    ``PAGELLM_CPU_AMX=0`` starts with it off."""
    lib = _lib()
    return lib is not None and bool(lib.gemm_i8_amx(-1 if enable is None else int(enable)))


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``(packed, bits)`` for a float32 ``weight [N, K]`` whose every run of 32 values along K is
    exactly one GGUF block (Q4_1 tried first, then Q8_0; checked value by value), else ``None``."""
    lib = _lib()
    if lib is None or weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype != torch.float32 \
            or weight.shape[1] % 32:
        return None
    n, k = weight.shape
    w = weight.detach().contiguous()
    for bits in (4, 8):  # a weight that is not Q4_1 fails on its first block
        out = torch.empty(lib.packed_size_i8(n, k, bits), dtype=torch.uint8)
        if lib.pack_weight_i8(out.data_ptr(), w.data_ptr(), n, k, bits):
            return out, bits
    return None


def _c(a: np.ndarray, dtype: type) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=dtype)


def packed_size(n: int, k: int, fmt: int) -> int:
    """Bytes of a ``[n, k]`` weight packed in ``fmt`` (not ``PARTS``)."""
    lib = _lib()
    assert lib is not None, "check supported() first"
    return int(lib.packed_size_i8(n, k, fmt))


def _into(out: torch.Tensor | None, rows: int, k: int, fmt: int, row0: int) -> tuple[torch.Tensor, int]:
    """``(out, address)`` for packing ``rows`` outputs from output ``row0`` on (a multiple of 32:
    panels are whole) into ``out``, a weight's packed bytes (a new one for ``out=None``)."""
    size = packed_size(rows, k, fmt)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    at = row0 // 32 * packed_size(32, k, fmt)
    if row0 % 32 or at + size > out.numel():
        raise ValueError(f"rows {row0}..{row0 + rows} do not fit the packed weight's whole panels")
    return out, out.data_ptr() + at


def pack_blocks(d: np.ndarray, m: np.ndarray, q: np.ndarray, bits: int, out: torch.Tensor | None = None,
                row0: int = 0) -> torch.Tensor:
    """The packed weight of GGUF blocks of 32 given as fields (``quantization/gguf_quant.legacy_fields``):
    ``w = d q + m`` per block, d and m ``[N, K / 32]``, q ``[N, K]``, in ``Q4_BLOCKS``, ``Q8_BLOCKS``
    or a :func:`q4_format` (whose groups' blocks must have equal d and m); into ``out`` from output
    ``row0`` on if given (a weight packed a slice of rows at a time)."""
    lib = _lib()
    assert lib is not None, "check supported() first"
    n, k = q.shape
    # (q as bytes: 0..15 or -128..127; unsigned 4-bit q is the same bytes, viewed without a copy)
    d, m, q = _c(d, np.float32), _c(m, np.float32), _c(q.view(np.int8) if q.dtype == np.uint8 else q, np.int8)
    out, at = _into(out, n, k, bits, row0)
    if not lib.pack_blocks_i8(at, d.ctypes.data, m.ctypes.data, q.ctypes.data, n, k, bits):
        raise ValueError(f"cannot pack [{n}, {k}] as {format_name(bits)}")
    return out


def pack_kquant(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, q: np.ndarray,
                fmt: int, out: torch.Tensor | None = None, row0: int = 0) -> torch.Tensor:
    """The packed weight of K-quant super-blocks given as fields (``quantization/gguf_quant.kquant_fields``)
    in format ``K4`` or ``K6``; ``out`` and ``row0`` as for :func:`pack_blocks`."""
    lib = _lib()
    assert lib is not None, "check supported() first"
    n, k = q.shape
    f32, i8 = (_c(d, np.float32), _c(dmin, np.float32)), (_c(sc, np.int8), _c(mn, np.int8))
    q = _c(q, np.uint8)
    out, at = _into(out, n, k, fmt, row0)
    if not lib.pack_kquant(at, f32[0].ctypes.data, f32[1].ctypes.data, i8[0].ctypes.data,
                           i8[1].ctypes.data, q.ctypes.data, n, k, fmt):
        raise ValueError(f"cannot pack [{n}, {k}] as {FORMATS.get(fmt, fmt)}")
    return out


def pack_parts(parts: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor:
    """One ``PARTS`` weight from ``(packed, format, rows)`` runs of output rows, in order: a header
    of int64 ``[count, (format, rows, byte offset) per part]``, then the parts 64-byte aligned."""
    header = 8 * (1 + 3 * len(parts))
    offsets, at = [], -(-header // 64) * 64
    for packed, _, _ in parts:
        offsets.append(at)
        at += -(-packed.numel() // 64) * 64
    out = torch.zeros(at, dtype=torch.uint8)
    fields = [len(parts)] + [v for (_, fmt, n), off in zip(parts, offsets, strict=True) for v in (fmt, n, off)]
    out[:header] = torch.tensor(fields, dtype=torch.int64).view(torch.uint8)
    for (packed, _, _), off in zip(parts, offsets, strict=True):
        out[off:off + packed.numel()] = packed
    return out


def parts_of(packed: torch.Tensor) -> list[tuple[int, int, int]]:
    """A ``PARTS`` weight's ``(format, rows, byte offset)`` per part, read from its header."""
    count = int(packed[:8].view(torch.int64))
    return [tuple(f) for f in packed[8:8 + 24 * count].view(torch.int64).view(count, 3).tolist()]


def _fits(packed: torch.Tensor, bits: int, n: int, k: int) -> bool:
    if bits == PARTS:
        parts = parts_of(packed) if packed.numel() >= 8 else []
        return (sum(rows for _, rows, _ in parts) == n and all(fmt != PARTS and _fits(
            packed[off:off + packed_size(rows, k, fmt)], fmt, rows, k) for fmt, rows, off in parts))
    multiple = _k_multiple(bits)
    return multiple is not None and not k % multiple and packed.numel() == packed_size(n, k, bits)


class BoundWeight:
    """A packed weight bound to the kernel once: sizes checked and pointers taken when bound, so
    a call is one allocation and one ctypes call. (Checking everything on every call cost ~10 us
    of Python, 121 times per SmolLM2 decode step.) The weight and bias must not be replaced
    afterwards; ``Linear.pack_for_cpu`` binds them after loading."""

    __slots__ = ("_fn", "_packed", "_bias", "_wp", "_bp", "bits", "out_features", "in_features")

    def __init__(self, packed: torch.Tensor, bits: int, out_features: int, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        lib = _lib()
        assert lib is not None, "check supported() before pack()"
        if not _fits(packed, bits, out_features, in_features):
            raise ValueError(f"packed {bits}-bit weight of {packed.numel()} bytes does not fit "
                             f"[{out_features}, {in_features}]")
        gemm.check_bias(bias, out_features)
        self._fn = lib.gemm_packed_i8
        self._packed, self._bias = packed, bias  # kept alive with the pointers below
        self._wp, self._bp = packed.data_ptr(), None if bias is None else bias.data_ptr()
        self.bits, self.out_features, self.in_features = bits, out_features, in_features

    def pointers(self) -> list[int]:
        """``[weight, bias (0 for none), bits]`` as the kernel takes them (``kernels/decode_graph.c``)."""
        return [self._wp, self._bp or 0, self.bits]

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., K] @ W^T (+ bias)`` -> ``[..., out_features]``, x rounded to int8 per block;
        written into ``out`` (float32, contiguous, ``[rows, out_features]``, not overlapping x) if given."""
        k, n = self.in_features, self.out_features
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
            raise ValueError(f"x must be float32 [..., {k}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        if out is not None and (out.dtype != torch.float32 or out.device.type != "cpu" or out.shape != (m, n)
                                or not out.is_contiguous()):
            raise ValueError(f"out must be float32 [{m}, {n}] contiguous on the CPU, got {out.dtype} "
                             f"{tuple(out.shape)} on {out.device}")
        y = torch.empty(m, n) if out is None else out
        if m and self._fn(y.data_ptr(), n, x2.data_ptr(), x2.stride(0) if m > 1 else k, self._wp, self._bp,
                          m, n, k, self.bits) != 0:
            raise MemoryError("the int8 GEMM could not allocate its scratch for x")
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def kernel_address() -> int:
    """The GEMM kernel's address (``kernels/decode_graph.c`` calls it through a table)."""
    lib = _lib()
    assert lib is not None, "check supported() first"
    return kernels.address(lib.gemm_packed_i8)


def linear(x: torch.Tensor, packed: torch.Tensor, bits: int, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., out_features]`` for ``(packed, bits) = pack(W)``,
    with x rounded to int8 per block of 32 (float32 in and out); every check on every call (a
    layer's projections use :class:`BoundWeight`)."""
    return BoundWeight(packed, bits, out_features, x.shape[-1], bias)(x)
