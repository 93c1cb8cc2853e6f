"""``Linear``: ``nn.Linear`` whose weight is packed once for the CPU GEMM kernel.

``F.linear`` on a CPU calls MKL's sgemm, which re-packs the weight on every call; at decode
batch sizes that is a large share of the work. :meth:`Linear.pack_for_cpu` packs the weight once
(``kernels/gemm.py``) and every batch then takes the kernel, whose output row is the plain sum
over k whatever the batch: a row's result never depends on the rows beside it, in float32 as in
the other dtypes (MKL's result for a row changes with the batch's size, and a 16-bit or int8 K/V
cache turns such last-bit differences into different greedy tokens under chunking or preemption:
docs/performance.md, "Decisions in force"). The packed copy replaces the weight
(a meta tensor keeps its shape). A GGUF checkpoint's blocks go to the int8 kernel as the file
holds them (``pack_gguf``), with ``quantization="gguf"`` or where ``auto`` measures it faster. A weight whose values
are exactly GGUF blocks (a Q4_1 or Q8_0 model, dequantized: every projection of the bundled
SmolLM2 is Q4_1, its tied LM head Q8_0) is also packed in 4 or 8 bits (``gemm.pack_quantized``,
checked value by value): batches of up to ``QUANTIZED_MAX_ROWS`` rows read that copy, with results
identical bit for bit, as the weight stream is what such small batches wait for. Without the
kernel (neither AVX-512 nor AVX2, no compiler, ``PAGELLM_CPU_KERNELS=0``, a GPU, bfloat16) nothing is packed and
``F.linear`` runs as before. How each format packs and multiplies is ``quantization/weight_formats.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.quantization.gguf_quant import Q8_0OnPacking
from pagellm.quantization.quant_blocks import QuantizedBlocks
from pagellm.quantization.weight_formats import Int8Packed, KeptBlocks, WeightFormat, pack_weight


class Linear(nn.Linear):
    """``nn.Linear`` with an optional packed weight (inference only): ``weight_format``, once packed
    (the float weight is then dropped), else ``F.linear`` on the float weight.

    Packed for ``float32`` compute (the default; exact): a float32 copy, plus a 4- or 8-bit copy for
    small batches when the weight is exactly GGUF blocks. Packed for ``bfloat16`` compute: one
    bfloat16 copy that every batch size reads (AMX tiles where the machine has them), so a row's
    result never depends on its neighbours; activations, sums and outputs stay float32.
    """

    weight_format: WeightFormat | None = None
    # The int8 kernel bound to its weight and bias, which ``forward`` calls directly (a plain
    # attribute: a lookup through nn.Module.__getattr__ is itself a microsecond).
    bound_i8: Any = None
    # Multi-LoRA: the adapters' slots of this projection (``lora/layers.py``), when enabled.
    lora: Any = None
    # A quantized checkpoint's blocks (GGUF, AWQ, GPTQ) kept at their width until packed (the float weight is then never
    # written: ``materialize`` dequantizes if the int8 kernel does not take them).
    kept_blocks: KeptBlocks | None = None

    def reset_parameters(self) -> None:
        # A model is built on the meta device and loaded from its checkpoint: a random init there
        # has no values to write, and would import torch's Python meta kernels (and torch._dynamo
        # with them: ~70 MiB of RSS and a second of start-up).
        if not self.weight.is_meta:
            super().reset_parameters()

    def load_blocks(self, blocks: QuantizedBlocks, part: int | None) -> None:
        """Keep a quantized tensor (this projection, or part ``part`` of a fused one) at its width."""
        if self.kept_blocks is None:
            self.kept_blocks = KeptBlocks()
        self.kept_blocks.parts[part or 0] = blocks

    def shard_of_blocks(self, blocks: QuantizedBlocks, part: int | None) -> QuantizedBlocks:
        """This worker's share of a quantized checkpoint tensor (part ``part`` of a fused one), as
        ``weight_loader`` cuts a float one (``QuantizedBlocks.shard``)."""
        return blocks

    def blocks_format(self) -> int | None:
        """The int8 kernel format of the kept blocks (``None``: none kept, or no common format)."""
        return None if self.kept_blocks is None else self.kept_blocks.kernel_format()

    def quantize_to_q8_0(self) -> bool:
        """Replace the loaded weight (or the blocks kept for it: an AWQ checkpoint's 16-bit head) with
        its GGUF Q8_0 blocks (``gguf``'s quantizer: 8 bits per value, a half-precision scale per 32),
        made as :meth:`pack_for_cpu` packs them for the int8 kernel; ``False`` (nothing changed) for
        K not a multiple of 32."""
        if self.in_features % 32:
            return False
        kept = self.kept_blocks.ordered() if self.kept_blocks is not None else []
        dense = self.dense_weight() if len(kept) > 1 else self.weight.detach()

        def rows(lo: int, hi: int) -> torch.Tensor:
            return kept[0].take(lo, hi).dequantize() if len(kept) == 1 else dense[lo:hi].float()

        self.kept_blocks = None
        self.load_blocks(Q8_0OnPacking(rows, (self.out_features, self.in_features),
                                       source=kept[0] if len(kept) == 1 else None), None)
        self.weight = nn.Parameter(torch.empty(self.weight.shape, device="meta"), requires_grad=False)
        return True

    def dense_weight(self) -> torch.Tensor:
        """The float32 weight: the loaded one, or the kept blocks dequantized (a new tensor)."""
        return self.weight if self.kept_blocks is None else self.kept_blocks.dense()

    def materialize(self) -> None:
        """Write the kept blocks into the float weight (they have no int8 kernel here)."""
        if self.kept_blocks is not None:
            with torch.no_grad():
                self.weight.copy_(self.dense_weight())
            self.kept_blocks = None

    def pack_for_cpu(self, compute_dtype: torch.dtype = torch.float32, int8: bool = False) -> bool:
        """Pack the loaded weight for the GEMM kernel if it can run here; ``True`` if packed. With
        ``int8``, kept blocks of a format the kernel takes, or a weight that is exactly GGUF
        blocks, go to the int8 kernel, any other to ``compute_dtype``'s. Every batch then reads the
        packed copy, so the float weight is dropped (a meta tensor keeps its shape): a bfloat16
        model is not held in float32 as well, nor a float32 one twice."""
        if self.weight_format is not None:
            return True
        if int8 and self.blocks_format() is not None:
            assert self.kept_blocks is not None
            order = self.kept_blocks.input_order()
            packed, fmt = self.kept_blocks.pack()  # (the file's pages released as they were packed)
            self.kept_blocks = None
            self.weight_format = Int8Packed(packed, fmt, self.out_features, self.in_features, self.bias,
                                            None if order is None else torch.from_numpy(order))
        else:
            self.materialize()
            # (A projection loaded in bfloat16 is widened here, one at a time, for the packing only.)
            weight = self.weight if self.weight.dtype == torch.float32 else self.weight.float()
            self.weight_format = pack_weight(weight, self.bias, compute_dtype, int8)
        if self.weight_format is None:
            if self.weight.dtype != torch.float32:  # loaded in bfloat16 for a kernel that did not take it
                self.weight = nn.Parameter(self.weight.float(), requires_grad=False)
            return False
        self.bound_i8 = self.weight_format.bound if isinstance(self.weight_format, Int8Packed) \
            and self.weight_format.input_order is None else None  # (else matmul: x permuted first)
        self.weight = nn.Parameter(torch.empty(self.weight.shape, device="meta"), requires_grad=False)
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` through the packed format; ``F.linear`` (MKL) only for a weight never packed."""
        fmt = self.weight_format
        return fmt.matmul(x, bias) if fmt is not None else F.linear(x, self.weight, bias)

    def gemm_descriptor(self) -> list[int] | None:
        """How :meth:`matmul` runs this projection, as ``kernels/decode_graph.c`` takes it (fields
        ``decode_graph.W_FIELDS``); ``None`` if the weight is not packed or adapters update it."""
        if self.lora is not None or self.weight_format is None:
            return None
        return self.weight_format.descriptor(self.bias)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out``: a buffer the caller has no further use for (float32 ``[rows, out_features]``,
        contiguous), which the int8 kernel writes the result into (adapters then add to it in
        place); the other paths return a new tensor."""
        bound = self.bound_i8
        y = bound(x, out=out) if bound is not None else self.matmul(x, self.bias)
        if self.lora is not None and self.lora.ctx.active:  # adapter rows in this step
            self.lora.add(x, y)
        return y
