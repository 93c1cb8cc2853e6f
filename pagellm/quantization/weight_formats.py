"""A projection's weight as a kernel reads it: one object per format, owning its packing, its
matmul, its decode-graph descriptor and its name on the start-up numerics line.

- ``Float32Packed``: packed once for ``kernels/gemm.c`` (exact: a row's sum runs over k whatever
  the batch), plus a 4- or 8-bit copy read by small batches where the weight is exactly GGUF blocks.
- ``Bfloat16Packed``: one bfloat16 copy every batch size reads (AMX tiles where the machine has them).
- ``Int8Packed``: GGUF blocks for ``kernels/gemm_int8.c``, packed from the file's own fields, from a
  weight that is exactly such blocks, or from ``quantization="q8_0"``; the bias bound once.
- ``KeptBlocks``: a quantized checkpoint's blocks (GGUF, AWQ, GPTQ, ...) kept at their width until
  the numerics are chosen (the float weight is never written unless they go to a float kernel: ``dense``).
- ``GroupedExperts``: a mixture-of-experts layer's experts, all of one float format, in one call.

``Linear`` (``layers/linear.py``) holds one of the first three once packed, else runs ``F.linear``.
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import numpy as np
import torch

from pagellm.kernels import decode_graph, gemm, gemm_int8
from pagellm.quantization.quant_blocks import QuantizedBlocks, combined_format

# Rows up to which a quantized copy beats the float32 kernel. benchmarks/gemm.py --quantized, all
# 120 projections of SmolLM2 in 4 bits: 2.8x at 1 row, 1.9x at 8, 1.1-1.2x at 16, 0.98x at 20;
# its 49,152 x 576 LM head alone in 8 bits: 2.2x at 1 row, 1.2x at 8, 0.88x at 16.
QUANTIZED_MAX_ROWS = {4: 16, 8: 8}

PACK_ROWS = 2048  # outputs whose fields are unpacked at a time (a multiple of 32): a 100M-weight
# embedding's fields at once were ~240 MiB of transient memory at load


def _kind(name: str) -> int:
    return decode_graph.GEMM_KINDS.index(name)


def _bias_ptr(bias: torch.Tensor | None, out_features: int) -> int:
    gemm.check_bias(bias, out_features)
    return 0 if bias is None else bias.data_ptr()


class WeightFormat:
    """One packed weight: ``matmul(x, bias)`` is ``x W^T (+ bias)`` with the format's bits."""

    name: ClassVar[str]  # as the numerics line and the decode graph's GEMM kinds say it
    out_features: int

    @property
    def kind(self) -> str:
        """The format with its kernel layout (``int8 K4 super-blocks``), as a worker reports it."""
        return self.name

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def descriptor(self, bias: torch.Tensor | None) -> list[int]:
        """The fields ``kernels/decode_graph.c`` runs this projection from (``decode_graph.W_FIELDS``)."""
        raise NotImplementedError


class Float32Packed(WeightFormat):
    name = "float32"

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = gemm.pack(weight)
        self.quantized: torch.Tensor | None = None
        self.q_bits = 0
        for bits in (4, 8):  # a float32 weight fails each check on its first block
            self.quantized = gemm.pack_quantized(weight, bits)
            if self.quantized is not None:
                self.q_bits = bits
                break

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is not None and x.numel() <= QUANTIZED_MAX_ROWS[self.q_bits] * self.in_features:
            return gemm.linear(x, self.quantized, self.out_features, bias, bits=self.q_bits)
        return gemm.linear(x, self.packed, self.out_features, bias)

    def descriptor(self, bias: torch.Tensor | None) -> list[int]:
        quantized = [0, 0, 0] if self.quantized is None else \
            [self.quantized.data_ptr(), self.q_bits, QUANTIZED_MAX_ROWS[self.q_bits]]
        return [_kind(self.name), self.packed.data_ptr(), _bias_ptr(bias, self.out_features), 32, *quantized]


class Bfloat16Packed(WeightFormat):
    name = "bfloat16"

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features = weight.shape[0]
        self.packed = gemm.pack_bf16(weight)
        self.amx = gemm.amx_supported()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return gemm.linear(x, self.packed, self.out_features, bias, bits=16, amx=self.amx)

    def descriptor(self, bias: torch.Tensor | None) -> list[int]:
        kind = _kind("bfloat16_amx" if self.amx else "bfloat16")
        return [kind, self.packed.data_ptr(), _bias_ptr(bias, self.out_features), 16, 0, 0, 0]


class Int8Packed(WeightFormat):
    name = "int8"

    def __init__(self, packed: torch.Tensor, fmt: int, out_features: int, in_features: int,
                 bias: torch.Tensor | None, input_order: torch.Tensor | None = None) -> None:
        self.packed, self.fmt, self.out_features = packed, fmt, out_features
        # The weight and the bias bound to the kernel once: ``Linear.forward`` calls it directly.
        self.bound = gemm_int8.BoundWeight(packed, fmt, out_features, in_features, bias)
        # Blocks packed with their inputs in this order (GPTQ's act-order): x is gathered alike.
        assert input_order is None or (input_order.dtype == torch.int64 and input_order.is_contiguous())
        self.input_order = input_order

    @property
    def kind(self) -> str:
        return f"int8 {gemm_int8.format_name(self.fmt)}"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        return gemm_int8.linear(x, self.packed, self.fmt, self.out_features, bias)

    def descriptor(self, bias: torch.Tensor | None) -> list[int]:
        order = 0 if self.input_order is None else self.input_order.data_ptr()
        return [_kind(self.name), *self.bound.pointers(), order, 0, 0]


def _pack_blocks(parts: list[QuantizedBlocks], fmt: int) -> torch.Tensor:
    """Tensors of one kernel format, stacked along the outputs, packed from their fields
    ``PACK_ROWS`` outputs at a time, the file's pages released as they are read."""
    n, k = sum(b.shape[0] for b in parts), parts[0].shape[1]
    out = torch.empty(gemm_int8.packed_size(n, k, fmt), dtype=torch.uint8)
    for row0 in range(0, n, PACK_ROWS):
        rows, at = [], 0  # the parts' slices that make outputs row0 .. row0 + PACK_ROWS
        for b in parts:
            lo, hi = max(row0 - at, 0), min(row0 + PACK_ROWS - at, b.shape[0])
            if lo < hi:
                rows.append(b.take(lo, hi))
            at += b.shape[0]
        fields = [np.concatenate(f) for f in zip(*(b.int8_fields() for b in rows), strict=True)]
        if fmt in (gemm_int8.K4, gemm_int8.K6):
            d, dmin, sc, mn, q = fields
            gemm_int8.pack_kquant(d, dmin, sc, mn, q, fmt, out, row0)
        else:
            d, m, q = fields
            gemm_int8.pack_blocks(d, m, q, fmt, out, row0)
        for b in parts:  # the file's pages read so far, out of the RSS (a 100 MB embedding's too)
            b.release()
    return out


class KeptBlocks:
    """A quantized checkpoint's blocks for one projection, per fused part, at the stored width."""

    def __init__(self) -> None:
        self.parts: dict[int, QuantizedBlocks] = {}

    def ordered(self) -> list[QuantizedBlocks]:
        return [self.parts[i] for i in sorted(self.parts)]

    def input_order(self) -> np.ndarray | None:
        """The inputs' order the blocks pack in (``QuantizedBlocks.input_order``): every part's, which
        must be one (a fused projection's parts read one input; else :meth:`kernel_format` is ``None``)."""
        return self.ordered()[0].input_order() if self.parts else None

    def _packing(self) -> list[QuantizedBlocks] | None:
        """The parts as they pack (in :meth:`input_order`), ``None`` where their orders differ."""
        parts = self.ordered()
        orders = [b.input_order() for b in parts]  # (each an argsort: found once per call)
        order = orders[0]
        if order is None:
            return parts if all(o is None for o in orders) else None
        if not all(o is not None and np.array_equal(o, order) for o in orders):
            return None
        return [b.in_input_order(order) for b in parts]

    def kernel_format(self) -> int | None:
        """The int8 kernel format of the blocks (``None``: no kernel here, or none for a type)."""
        parts = self._packing() if self.parts and gemm_int8.supported() else None
        return None if parts is None else combined_format(b.kernel_format() for b in parts)

    def pack(self) -> tuple[torch.Tensor, int]:
        """``(packed, format)`` for the int8 kernel, from the checkpoint's own fields (in
        :meth:`input_order`)."""
        parts = self._packing()
        fmt = None if parts is None else combined_format(b.kernel_format() for b in parts)
        assert fmt is not None and parts is not None, "no blocks the int8 kernel takes"
        if fmt != gemm_int8.PARTS:
            return _pack_blocks(parts, fmt), fmt
        runs = []  # consecutive parts of one format packed together (a q and k beside a v)
        for run_fmt, run in itertools.groupby(parts, key=lambda b: b.kernel_format()):
            blocks = list(run)
            assert run_fmt is not None
            runs.append((_pack_blocks(blocks, run_fmt), run_fmt, sum(b.shape[0] for b in blocks)))
        return gemm_int8.pack_parts(runs), fmt

    def dense(self) -> torch.Tensor:
        """The blocks dequantized to float32 (exactly, in the stored order; a new tensor)."""
        return torch.cat([b.dequantize() for b in self.ordered()])


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype,
                int8: bool) -> WeightFormat | None:
    """A float weight packed for the kernel the numerics chose, or ``None`` where no kernel takes it
    here: with ``int8``, a weight that is exactly GGUF blocks goes to the int8 kernel (which runs
    on every CPU, so it is asked first), else to ``compute_dtype``'s."""
    if int8 and gemm_int8.supported():
        packed = gemm_int8.pack(weight)
        if packed is not None:
            return Int8Packed(packed[0], packed[1], weight.shape[0], weight.shape[1], bias)
    if not gemm.usable(weight):
        return None
    if compute_dtype == torch.bfloat16:
        return Bfloat16Packed(weight) if gemm.bf16_supported() else None
    return Float32Packed(weight)


class GroupedExperts:
    """A mixture-of-experts layer's projections as one table of packed weights per projection, run
    in one ``gemm.linear_grouped`` call over every expert's rows: possible where every expert is
    packed for the same float kernel (int8 or unpacked experts run one by one)."""

    def __init__(self, bits: int, amx: bool, w13: list[torch.Tensor], w2: list[torch.Tensor]) -> None:
        self.bits, self.amx = bits, amx
        self.w13 = torch.tensor([w.data_ptr() for w in w13], dtype=torch.int64)
        self.w2 = torch.tensor([w.data_ptr() for w in w2], dtype=torch.int64)

    @classmethod
    def of(cls, w13: list[WeightFormat | None], w2: list[WeightFormat | None]) -> GroupedExperts | None:
        kinds = {(16, f.amx) if isinstance(f, Bfloat16Packed) else (32, False) if isinstance(f, Float32Packed)
                 else None for f in (*w13, *w2)}
        if len(kinds) != 1 or None in kinds:
            return None
        (kind,) = kinds
        assert kind is not None
        packed = [[f.packed for f in fs if isinstance(f, (Bfloat16Packed, Float32Packed))] for fs in (w13, w2)]
        return cls(kind[0], kind[1], packed[0], packed[1])

    def run(self, rows: torch.Tensor, offsets: torch.Tensor, act_fn: Any, n13: int, hidden: int) -> torch.Tensor:
        """``rows`` grouped by expert (``offsets [E + 1]``) through w13, the activation and w2."""
        h = gemm.linear_grouped(rows, self.w13, offsets, n13, self.bits, self.amx)
        return gemm.linear_grouped(act_fn(h), self.w2, offsets, hidden, self.bits, self.amx)
