"""GGUF's quantized blocks read as the integer fields the int8 kernels take, and a K-quant writer.

A projection stored as blocks reaches ``kernels/gemm_int8.c`` without a float round trip: the file's
bytes are split into scales, mins and integer quants here (vectorised, one tensor at a time) and
laid out for the kernel there. Legacy types (blocks of 32 with a half-precision scale) become the
kernel's 4- or 8-bit blocks; K types (super-blocks of 256 with 6- or 8-bit sub-block scales) its K4
or K6 super-blocks. Types without a kernel format are dequantized (``gguf.dequantize``).

``quantize_q4_k`` / ``quantize_q6_k`` write K-quant bytes (``gguf`` can only read them), with a plain
max-min fit rather than llama.cpp's iterative search: for benchmark checkpoints and tests, whose
reference is always ``gguf.dequantize`` of what was written.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, dequantize, quantize
from gguf import GGMLQuantizationType as T

from pagellm.kernels.gemm_int8 import K4, K6, Q4_BLOCKS, Q8_BLOCKS
from pagellm.mapped_files import read_memmap_rows
from pagellm.quantization.quant_blocks import QuantizedBlocks

_LEGACY_FORMAT = {T.Q4_0: Q4_BLOCKS, T.Q4_1: Q4_BLOCKS, T.Q5_0: Q8_BLOCKS, T.Q8_0: Q8_BLOCKS}
# (Q2_K and Q3_K widen to K6's 6 bits: 2.8x and 2.1x their bytes, against 12x and 9x as float32.)
_FORMAT = {**_LEGACY_FORMAT, T.Q4_K: K4, T.Q5_K: K6, T.Q6_K: K6, T.Q2_K: K6, T.Q3_K: K6}
KERNEL_TYPES = frozenset(_FORMAT)
QK = 256


# Up to this many ids, an embedding lookup of a legacy type reads its fields directly (``gather_rows``).
FEW_ROWS = 64
_LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0)


@dataclass(frozen=True)
class GGUFBlocks(QuantizedBlocks):
    """A 2-D GGUF tensor kept as its file's bytes: ``data [rows, bytes per row]`` (uint8), ``shape``
    the weight's ``(rows, K)`` in PyTorch order, and ``order``, the rows of ``data`` in the weight's
    order if they differ (llama's q / k permutation, applied as rows are read: no copy at load)."""

    data: np.ndarray
    qtype: T
    shape: tuple[int, int]
    order: np.ndarray | None = None

    row_lookup = True

    @property
    def type_name(self) -> str:
        return self.qtype.name

    def kernel_format(self) -> int | None:
        return part_format(self.qtype)

    def int8_fields(self) -> tuple[np.ndarray, ...]:
        return kquant_fields(self) if self.kernel_format() in (K4, K6) else legacy_fields(self)

    def array(self) -> np.ndarray:
        """The blocks in the weight's row order (a copy if ``order`` is set)."""
        return self.data if self.order is None else self.data[self.order]

    def take(self, lo: int, hi: int) -> GGUFBlocks:
        """Rows ``lo .. hi`` of the weight as blocks in order (only these rows read)."""
        data = self.data[lo:hi] if self.order is None else self.data[self.order[lo:hi]]
        return GGUFBlocks(data, self.qtype, (hi - lo, self.shape[1]))

    def take_inputs(self, lo: int, hi: int) -> GGUFBlocks | None:
        """Inputs ``lo .. hi`` of every row: the bytes of the blocks that hold them (a strided view;
        ``None`` where ``lo`` or ``hi`` falls inside a block: 32 values, or 256 for the K types)."""
        size, nbytes = GGML_QUANT_SIZES[self.qtype]
        if lo % size or hi % size:
            return None
        return replace(self, data=self.data[:, lo // size * nbytes:hi // size * nbytes], shape=(self.shape[0], hi - lo))

    def dequantize(self) -> torch.Tensor:
        return torch.from_numpy(np.array(dequantize(self.array(), self.qtype), dtype=np.float32).reshape(self.shape))

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [...]`` -> their rows, dequantized ``[..., K]`` float32 (an embedding lookup)."""
        flat = ids.reshape(-1).cpu().numpy()
        if flat.size <= FEW_ROWS and self.qtype in _LEGACY:
            # A decode step's few tokens: their blocks' fields directly (``gguf.dequantize``'s
            # grouping and a dedupe cost ~0.3 ms a step; the values are the same: d q is exact).
            blocks = GGUFBlocks(self._read(flat), self.qtype, (flat.size, self.shape[1]))
            d, m, q = legacy_fields(blocks)
            w = q.astype(np.float32).reshape(flat.size, -1, 32) * d[..., None] + m[..., None]
            return torch.from_numpy(w.reshape(*ids.shape, self.shape[1])).to(ids.device)
        uniq, inverse = np.unique(flat, return_inverse=True)
        rows = dequantize(self._read(uniq), self.qtype)
        out = torch.from_numpy(np.asarray(rows.reshape(len(uniq), self.shape[1]), dtype=np.float32))
        return out[torch.from_numpy(inverse.reshape(-1))].reshape(*ids.shape, self.shape[1]).to(ids.device)

    def _read(self, ids: np.ndarray) -> np.ndarray:
        """The blocks of rows ``ids`` of the weight, read from the file where it is mapped (no page of
        the mapping made resident: ``mapped_files.read_rows``)."""
        rows = ids if self.order is None else self.order[ids]
        read = read_memmap_rows(self.data, rows.tolist())
        return self.data[rows] if read is None else read

    def release(self) -> None:
        """Drop the file's pages from this process once read (they stay in the page cache): a mapped
        file's touched pages count in the RSS until unmapped, and loading touches all of them."""
        base: np.ndarray | None = self.data
        while base is not None and not isinstance(base, np.memmap):
            base = base.base
        mapping = getattr(base, "_mmap", None)
        if mapping is not None and hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_DONTNEED)

    def rows(self, order: np.ndarray) -> GGUFBlocks:
        """The rows in ``order`` (a row of blocks is a row of the weight), read lazily."""
        return GGUFBlocks(self.data, self.qtype, self.shape, order if self.order is None else self.order[order])


@dataclass(frozen=True)
class Q8_0OnPacking(QuantizedBlocks):  # noqa: N801 - GGUF's type name
    """A float weight as GGUF Q8_0 blocks (``gguf``'s quantizer), quantized a slice of rows at a time
    as they are packed or read: the whole weight's Q8_0 bytes are never held beside its packed
    copy (a 49k-token LM head's are 0.1 GB). ``rows(lo, hi)`` gives rows ``lo .. hi`` in float32,
    read from ``source`` where given (whose pages are released as they are packed)."""

    rows: Callable[[int, int], torch.Tensor]
    shape: tuple[int, int]
    lo: int = 0
    source: QuantizedBlocks | None = None

    @property
    def type_name(self) -> str:
        return T.Q8_0.name

    def kernel_format(self) -> int | None:
        return Q8_BLOCKS

    def blocks(self) -> GGUFBlocks:
        w = self.rows(self.lo, self.lo + self.shape[0]).numpy()
        return GGUFBlocks(quantize(w, T.Q8_0), T.Q8_0, self.shape)

    def int8_fields(self) -> tuple[np.ndarray, ...]:
        return legacy_fields(self.blocks())

    def take(self, lo: int, hi: int) -> Q8_0OnPacking:
        return replace(self, shape=(hi - lo, self.shape[1]), lo=self.lo + lo)

    def dequantize(self) -> torch.Tensor:
        return self.blocks().dequantize()

    def release(self) -> None:
        if self.source is not None:
            self.source.release()


def part_format(qtype: T) -> int | None:
    """The int8 kernel format of one tensor's blocks (``None``: no kernel for the type)."""
    return _FORMAT.get(qtype)


def _blocks(b: GGUFBlocks, size: int) -> np.ndarray:
    n, k = b.shape
    return b.array().reshape(n * k // (32 if b.qtype in _LEGACY_FORMAT else QK), size)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.copy().view(np.float16).astype(np.float32)


def legacy_fields(b: GGUFBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(d, m, q)``: per block of 32 ``w = d q + m`` (``m`` 0 for the 8-bit types), d and m float32
    ``[N, K / 32]``, q int32 ``[N, K]`` (0..15 for Q4_0 / Q4_1, -128..127 for Q5_0 / Q8_0)."""
    n, k = b.shape
    t = b.qtype
    size = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q8_0: 34}[t]
    blk = _blocks(b, size)
    d = _f16(blk[:, :2]).reshape(-1)
    m = np.zeros_like(d)
    if t == T.Q8_0:
        q = blk[:, 2:].view(np.int8).astype(np.int32)
    else:
        start = 4 if t == T.Q4_1 else 6 if t == T.Q5_0 else 2
        qs = blk[:, start:start + 16]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)
        if t == T.Q4_0:
            m = -8.0 * d  # w = d (q - 8): exact, a power of two
        elif t == T.Q4_1:
            m = _f16(blk[:, 2:4]).reshape(-1)
        else:  # Q5_0: the fifth bits in a 32-bit word, w = d (q - 16)
            qh = blk[:, 2:6].copy().view(np.uint32).reshape(-1, 1)
            q = (q | (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int32)) - 16
    return d.reshape(n, k // 32), m.reshape(n, k // 32), q.reshape(n, k)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 12 bytes of 6-bit scales and mins of 8 sub-blocks."""
    s = scales.reshape(-1, 3, 4)
    a, b, c = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1)
    return sc, mn


def kquant_fields(b: GGUFBlocks) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(d, dmin, sc, mn, q)``: per sub-block ``w = d sc q - dmin mn`` with d and dmin float32
    ``[N, K / 256]``, sc and mn int8 per 16 values ``[N, K / 16]``, q uint8 ``[N, K]`` (0..63), for
    Q2_K to Q6_K."""
    n, k = b.shape
    t = b.qtype
    blk = _blocks(b, {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210, T.Q2_K: 84, T.Q3_K: 110}[t])
    shift2 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)  # 2-bit fields of 32 bytes
    q: np.ndarray
    sc16: np.ndarray
    mn16: np.ndarray
    if t == T.Q2_K:  # w = (d sc) q - (dmin m), 4-bit sc and m per 16, q 2 bits
        scales, q2s, d, dmin = blk[:, :16], blk[:, 16:80], _f16(blk[:, 80:82]), _f16(blk[:, 82:84])
        q = (q2s.reshape(-1, 2, 1, 32) >> shift2) & 3
        sc16, mn16 = (scales & 0x0F).view(np.int8), (scales >> 4).view(np.int8)
    elif t == T.Q3_K:  # w = (d s) (q - 4), s 6-bit - 32 per 16, q 3 bits (the high one set means +0)
        hmask, q2s, scales, d = blk[:, :32], blk[:, 32:96], blk[:, 96:108], _f16(blk[:, 108:110])
        s_lo = (scales[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(-1, 16)
        s_hi = (scales[:, 8:].reshape(-1, 1, 4) >> shift2[0]).reshape(-1, 16)
        sc16 = (((s_lo & 0x0F) | ((s_hi & 3) << 4)).astype(np.int16) - 32).astype(np.int8)
        q_lo = ((q2s.reshape(-1, 2, 1, 32) >> shift2) & 3).reshape(-1, 256)
        q_hi = ((hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(-1, 256)
        q = q_lo + (q_hi << 2)  # q - 4 is gguf's ql - 4 (1 - qh)
        mn16, dmin = sc16, 4 * d  # w = d s q - (4 d) s: exact, a power of two
    elif t == T.Q6_K:
        ql, qh, scales, d = blk[:, :128], blk[:, 128:192], blk[:, 192:208], _f16(blk[:, 208:210])
        lo = np.stack([ql.reshape(-1, 2, 64) & 0x0F, ql.reshape(-1, 2, 64) >> 4], axis=2).reshape(-1, 8, 32)
        hi = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        q = lo | (hi.reshape(-1, 8, 32) << 4)
        sc16 = scales.view(np.int8)
        mn16, dmin = sc16, 32 * d  # w = d sc (q - 32) = d sc q - (32 d) sc: exact, a power of two
    else:
        d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
        sc8, mn8 = _scale_min_k4(blk[:, 4:16])
        qs = blk[:, -128:].reshape(-1, 4, 32)
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
        if t == T.Q5_K:
            qh = blk[:, 16:48].reshape(-1, 1, 32)
            q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4)
        sc16, mn16 = np.repeat(sc8, 2, axis=1).view(np.int8), np.repeat(mn8, 2, axis=1).view(np.int8)
    return (d.reshape(n, k // QK), dmin.reshape(n, k // QK), sc16.reshape(n, k // 16), mn16.reshape(n, k // 16),
            np.ascontiguousarray(q.reshape(n, k), dtype=np.uint8))


def _to_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K bytes ``[rows, K / 256 * 144]`` of a float ``[rows, K]`` (K a multiple of 256)."""
    x = np.asarray(w, dtype=np.float32).reshape(-1, 8, 32)
    lo = np.minimum(x.min(axis=2), 0.0)
    scale = (x.max(axis=2) - lo) / 15.0
    d = (scale.max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.rint(scale / d[:, None])), 0, 63).astype(np.uint8)
        mn = np.clip(np.nan_to_num(np.rint(-lo / dmin[:, None])), 0, 63).astype(np.uint8)
        step, off = (d[:, None] * sc)[..., None], (dmin[:, None] * mn)[..., None]
        q = np.clip(np.nan_to_num(np.rint((x + off) / step)), 0, 15).astype(np.uint8)
    packed = np.empty((x.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    qs = q.reshape(-1, 4, 2, 32)
    qs = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([_to_f16(d), _to_f16(dmin), packed, qs], axis=1)
    return out.reshape(np.shape(w)[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K bytes ``[rows, K / 256 * 210]`` of a float ``[rows, K]`` (K a multiple of 256)."""
    x = np.asarray(w, dtype=np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(axis=2) / 31.0
    d = (scale.max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.rint(scale / d[:, None])), -128, 127).astype(np.int8)
        step = (d[:, None] * sc)[..., None]
        q = (np.clip(np.nan_to_num(np.rint(x / step)), -32, 31) + 32).astype(np.uint8).reshape(-1, 8, 32)
    lo = (q & 0x0F).reshape(-1, 2, 2, 64)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    hi = (q >> 4).reshape(-1, 2, 4, 32)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(-1, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _to_f16(d)], axis=1)
    return out.reshape(np.shape(w)[0], -1)
