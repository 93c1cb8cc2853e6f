"""``Linear``: ``nn.Linear`` whose weight is packed once for the CPU GEMM kernel.

``F.linear`` on a CPU calls MKL's sgemm, which re-packs the weight on every call; at decode
batch sizes that is a large share of the work. :meth:`Linear.pack_for_cpu` packs the weight once
(``kernels/gemm.py``) and every batch then takes the kernel, whose output row is the plain sum
over k whatever the batch: a row's result never depends on the rows beside it, in float32 as in
the other dtypes (MKL's result for a row changes with the batch's size, and a 16-bit or int8 K/V
cache turns such last-bit differences into different greedy tokens under chunking or preemption:
docs/performance.md, "Measurements behind code choices"). The packed copy replaces the weight
(a meta tensor keeps its shape). A GGUF checkpoint's blocks go to the int8 kernel as the file
holds them (``pack_gguf``), with ``quantization="gguf"`` or where ``auto`` measures it faster. A weight whose values
are exactly GGUF blocks (a Q4_1 or Q8_0 model, dequantized: every projection of the bundled
SmolLM2 is Q4_1, its tied LM head Q8_0) is also packed in 4 or 8 bits (``gemm.pack_quantized``,
checked value by value): batches of up to ``QUANTIZED_MAX_ROWS`` rows read that copy, with results
identical bit for bit, as the weight stream is what such small batches wait for. Without the
kernel (no AVX-512 or compiler, ``PAGELLM_CPU_KERNELS=0``, a GPU, bfloat16) nothing is packed and
``F.linear`` runs as before.
"""

from __future__ import annotations

import itertools
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from torch import nn

from pagellm.kernels import decode_graph, gemm, gemm_int8
from pagellm.weights.gguf_quant import GGUFBlocks, int8_format, kquant_fields, legacy_fields, part_format

# Rows up to which a quantized copy beats the float32 kernel. benchmarks/gemm.py --quantized, all
# 120 projections of SmolLM2 in 4 bits: 2.8x at 1 row, 1.9x at 8, 1.1-1.2x at 16, 0.98x at 20;
# its 49,152 x 576 LM head alone in 8 bits: 2.2x at 1 row, 1.2x at 8, 0.88x at 16.
QUANTIZED_MAX_ROWS = {4: 16, 8: 8}


PACK_ROWS = 2048  # outputs whose fields are unpacked at a time (a multiple of 32): a 100M-weight
# embedding's fields at once were ~240 MiB of transient memory at load


def _pack_blocks(parts: list[GGUFBlocks], fmt: int) -> torch.Tensor:
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
        if fmt in (gemm_int8.K4, gemm_int8.K6):
            d, dmin, sc, mn, q = (np.concatenate(f) for f in zip(*map(kquant_fields, rows), strict=True))
            gemm_int8.pack_kquant(d, dmin, sc, mn, q, fmt, out, row0)
        else:
            d, m, q = (np.concatenate(f) for f in zip(*map(legacy_fields, rows), strict=True))
            gemm_int8.pack_blocks(d, m, q, fmt, out, row0)
        for b in parts:  # the file's pages read so far, out of the RSS (a 100 MB embedding's too)
            b.release()
    return out


class Linear(nn.Linear):
    """``nn.Linear`` with an optional packed weight (inference only).

    Packed for ``float32`` compute (the default; exact): a float32 copy, plus a 4- or 8-bit copy for
    small batches when the weight is exactly GGUF blocks. Packed for ``bfloat16`` compute: one
    bfloat16 copy that every batch size reads (AMX tiles where the machine has them), so a row's
    result never depends on its neighbours; activations, sums and outputs stay float32.
    """

    packed: torch.Tensor | None
    packed_q: torch.Tensor | None  # the 4- or 8-bit copy, if the weight is exactly such blocks
    packed_bf16: torch.Tensor | None
    packed_i8: torch.Tensor | None  # GGUF blocks for the int8 kernel (quantization="gguf")
    q_bits: int
    i8_bits: int
    amx: bool
    # Multi-LoRA: the adapters' slots of this projection (``lora/layers.py``), when enabled.
    lora: Any = None
    # The int8 weight and the bias bound to the kernel (a plain attribute: a buffer's lookup through
    # nn.Module.__getattr__ is itself a microsecond), which ``forward`` calls directly.
    bound_i8: gemm_int8.BoundWeight | None = None
    # A GGUF checkpoint's blocks, per fused part, kept at their width until packed (the float
    # weight is then never written: ``materialize`` dequantizes if the int8 kernel does not take them).
    gguf_parts: dict[int, GGUFBlocks] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("packed", None, persistent=False)
        self.register_buffer("packed_q", None, persistent=False)
        self.register_buffer("packed_bf16", None, persistent=False)
        self.register_buffer("packed_i8", None, persistent=False)
        self.q_bits = self.i8_bits = 0
        self.amx = False

    def reset_parameters(self) -> None:
        # A model is built on the meta device and loaded from its checkpoint: a random init there
        # has no values to write, and would import torch's Python meta kernels (and torch._dynamo
        # with them: ~70 MiB of RSS and a second of start-up).
        if not self.weight.is_meta:
            super().reset_parameters()

    def load_gguf_blocks(self, blocks: GGUFBlocks, part: int | None) -> None:
        """Keep a GGUF tensor (this projection, or part ``part`` of a fused one) at its width."""
        if self.gguf_parts is None:
            self.gguf_parts = {}
        self.gguf_parts[part or 0] = blocks

    def gguf_format(self) -> int | None:
        """The int8 kernel format of the kept GGUF blocks (``None``: none kept, or no common format)."""
        if not self.gguf_parts or not gemm_int8.supported():
            return None
        return int8_format([b.qtype for b in self.gguf_parts.values()])

    def pack_gguf(self) -> tuple[torch.Tensor, int]:
        """``(packed, format)`` of the kept blocks for the int8 kernel, from the file's own fields."""
        fmt = self.gguf_format()
        assert self.gguf_parts and fmt is not None, "no GGUF blocks the int8 kernel takes"
        parts = [self.gguf_parts[i] for i in sorted(self.gguf_parts)]
        if fmt != gemm_int8.PARTS:
            return _pack_blocks(parts, fmt), fmt
        runs = []  # consecutive parts of one format packed together (a q and k beside a v)
        for run_fmt, run in itertools.groupby(parts, key=lambda b: part_format(b.qtype)):
            blocks = list(run)
            assert run_fmt is not None
            runs.append((_pack_blocks(blocks, run_fmt), run_fmt, sum(b.shape[0] for b in blocks)))
        return gemm_int8.pack_parts(runs), fmt

    def quantize_to_q8_0(self) -> bool:
        """Replace the loaded weight with its GGUF Q8_0 blocks (``gguf``'s quantizer: 8 bits per
        value, a half-precision scale per 32), which :meth:`pack_for_cpu` then packs for the int8
        kernel; ``False`` (nothing changed) for K not a multiple of 32."""
        if self.in_features % 32:
            return False
        w = self.weight.detach().float().numpy()
        self.gguf_parts = {0: GGUFBlocks(gguf.quantize(w, T.Q8_0), T.Q8_0, (self.out_features, self.in_features))}
        self.weight = nn.Parameter(torch.empty(self.weight.shape, device="meta"), requires_grad=False)
        return True

    def dense_weight(self) -> torch.Tensor:
        """The float32 weight: the loaded one, or the kept GGUF blocks dequantized (a new tensor)."""
        if not self.gguf_parts:
            return self.weight
        return torch.cat([self.gguf_parts[i].dequantize() for i in sorted(self.gguf_parts)])

    def materialize(self) -> None:
        """Write the kept GGUF blocks into the float weight (they have no int8 kernel here)."""
        if self.gguf_parts:
            with torch.no_grad():
                self.weight.copy_(self.dense_weight())
            self.gguf_parts = None

    def pack_for_cpu(self, compute_dtype: torch.dtype = torch.float32, int8: bool = False) -> bool:
        """Pack the loaded weight for the GEMM kernel if it can run here; ``True`` if packed. With
        ``int8``, kept GGUF blocks of a type the kernel takes, or a weight that is exactly GGUF
        blocks, go to the int8 kernel, any other to ``compute_dtype``'s. Every batch then reads the
        packed copy, so the float weight is dropped (a meta tensor keeps its shape): a bfloat16
        model is not held in float32 as well, nor a float32 one twice."""
        if self.packed is not None or self.packed_bf16 is not None or self.packed_i8 is not None:
            return True
        packed = self._pack(compute_dtype, int8)
        if packed:
            self.weight = nn.Parameter(torch.empty(self.weight.shape, device="meta"), requires_grad=False)
        elif self.weight.dtype != torch.float32:  # loaded in bfloat16 for a kernel that did not take it
            self.weight = nn.Parameter(self.weight.float(), requires_grad=False)
        return packed

    def _pack(self, compute_dtype: torch.dtype, int8: bool) -> bool:
        if int8 and self.gguf_format() is not None:
            blocks, fmt = self.pack_gguf()  # (the file's pages released as they were packed)
            self.packed_i8, self.i8_bits = blocks, fmt
            self.bound_i8 = gemm_int8.BoundWeight(blocks, fmt, self.out_features, self.in_features, self.bias)
            self.gguf_parts = None
            return True
        self.materialize()
        # (A projection loaded in bfloat16 is widened here, one at a time, for the packing only.)
        weight = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
        if int8 and gemm_int8.supported():  # (before the float32 kernel's check: int8 runs without AVX-512)
            packed = gemm_int8.pack(weight)
            if packed is not None:
                self.packed_i8, self.i8_bits = packed
                self.bound_i8 = gemm_int8.BoundWeight(packed[0], packed[1], self.out_features, self.in_features,
                                                      self.bias)
                return True
        if not gemm.usable(weight):
            return False
        if compute_dtype == torch.bfloat16:
            if not gemm.bf16_supported():
                return False
            self.packed_bf16 = gemm.pack_bf16(weight)
            self.amx = gemm.amx_supported()
            return True
        self.packed = gemm.pack(weight)
        for bits in (4, 8):  # a float32 weight fails each check on its first block
            self.packed_q = gemm.pack_quantized(weight, bits)
            if self.packed_q is not None:
                self.q_bits = bits
                break
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` through the kernel once packed (the smallest batches over the quantized
        copy if there is one, with the same bits); ``F.linear`` (MKL) only for a weight never packed."""
        if self.packed_i8 is not None:
            return gemm_int8.linear(x, self.packed_i8, self.i8_bits, self.out_features, bias)
        if self.packed_bf16 is not None:
            return gemm.linear(x, self.packed_bf16, self.out_features, bias, bits=16, amx=self.amx)
        if self.packed_q is not None and x.numel() <= QUANTIZED_MAX_ROWS[self.q_bits] * self.in_features:
            return gemm.linear(x, self.packed_q, self.out_features, bias, bits=self.q_bits)
        if self.packed is not None:
            return gemm.linear(x, self.packed, self.out_features, bias)
        return F.linear(x, self.weight, bias)

    def gemm_descriptor(self) -> list[int] | None:
        """How :meth:`matmul` runs this projection, as ``kernels/decode_graph.c`` takes it (fields
        ``decode_graph.W_FIELDS``); ``None`` if the weight is not packed or adapters update it."""
        if self.lora is not None:
            return None
        kind = decode_graph.GEMM_KINDS.index
        if self.bound_i8 is not None:
            return [kind("int8"), *self.bound_i8.pointers(), 0, 0, 0]
        if self.packed_bf16 is None and self.packed is None:
            return None
        gemm.check_bias(self.bias, self.out_features)
        bias = 0 if self.bias is None else self.bias.data_ptr()
        if self.packed_bf16 is not None:
            return [kind("bfloat16_amx" if self.amx else "bfloat16"), self.packed_bf16.data_ptr(), bias, 16, 0, 0, 0]
        assert self.packed is not None
        quantized = [0, 0, 0] if self.packed_q is None else \
            [self.packed_q.data_ptr(), self.q_bits, QUANTIZED_MAX_ROWS[self.q_bits]]
        return [kind("float32"), self.packed.data_ptr(), bias, 32, *quantized]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bound = self.bound_i8
        y = bound(x) if bound is not None else self.matmul(x, self.bias)
        if self.lora is not None and self.lora.ctx.active:  # adapter rows in this step
            self.lora.add(x, y)
        return y
