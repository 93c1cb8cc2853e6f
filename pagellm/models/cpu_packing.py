"""A decoder's weights made ready for the CPU's GEMM kernels after loading: which quantized tensors stay
at their stored width (``keep_blocks``, while loading) and every projection and the LM head
packed into its weight format (``pack_for_cpu``, once the numerics are chosen). The decoder itself
holds architecture only; each format's packing is ``quantization/weight_formats.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagellm.kernels import gemm_int8
from pagellm.layers.linear import Linear
from pagellm.layers.parallel import VocabParallelEmbedding
from pagellm.quantization.quant_blocks import QuantizedBlocks
from pagellm.quantization.weight_formats import Int8Packed

if TYPE_CHECKING:
    from pagellm.models.decoder import DecoderForCausalLM


def pack_for_cpu(model: DecoderForCausalLM, compute_dtype: torch.dtype = torch.float32, int8: bool = False,
                 after_each: Callable[[], None] | None = None, head_q8_0: bool = False) -> int:
    """After ``load_weights``: pack every projection and the LM head for the CPU GEMM kernel
    (``layers/linear.py``) where it can run, for ``compute_dtype`` GEMMs (float32 or
    bfloat16; with ``int8``, the int8 kernel for weights stored as GGUF blocks); a tied head's
    packed copy is held here. Returns how many weights the int8 kernel took. ``after_each``
    runs after each projection (the worker hands the heap's free memory back there, so the
    transient fields of packing do not pile up into the load's peak). ``head_q8_0``: a float LM
    head is quantized to Q8_0 blocks for the int8 kernel (an AWQ / GPTQ checkpoint's 16-bit head:
    in float32 it would be read at 4x the bytes of every 4-bit projection's share)."""
    embed = model.model.embed_tokens
    tied = model.tied_head_blocks
    # The embedding's rows are kept only where no float copy is needed: no LM head here (a pipeline
    # stage before the last), the LM head is its own weight, takes the same blocks on the int8
    # kernel, or is quantized from them to Q8_0.
    keep_embed = int8 and gemm_int8.supported() and (not model.has_head or model.lm_head is not None or head_q8_0
                                                     or (tied is not None and tied.kernel_format() is not None))
    if not keep_embed:
        embed.materialize()
    if head_q8_0 and model.lm_head is not None and model.lm_head.blocks_format() is None:
        model.lm_head.quantize_to_q8_0()
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack_for_cpu(compute_dtype, int8)
            if after_each is not None:
                after_each()
    if model.lm_head is None and model.tied_head is None and model.has_head:
        with torch.device("meta"):
            head = Linear(embed.embedding_dim, embed.num_embeddings, bias=False)
        head.weight = embed.weight  # shared: batches past the kernel's read the embedding itself
        if model.tied_head_blocks is not None and int8:
            head.load_blocks(model.tied_head_blocks, None)
        model.tied_head_blocks = None
        if head_q8_0 and head.blocks_format() is None:
            head.quantize_to_q8_0()  # (from the kept rows or the embedding's floats: the head's own weight)
        elif head.blocks_format() is None:
            head.kept_blocks = None  # (the embedding holds its floats already)
        if head.pack_for_cpu(compute_dtype, int8):
            model.tied_head = head
    if embed.kept_rows is not None:
        embed.weight = nn.Parameter(torch.empty(embed.weight.shape, device="meta"), requires_grad=False)
    return sum(isinstance(m.weight_format, Int8Packed) for m in model.modules()
               if isinstance(m, Linear))  # tied_head included


def keep_blocks(module: nn.Module, param: torch.Tensor, target: str, shard_idx: int | None,
                blocks: QuantizedBlocks) -> list[str]:
    """Hand a quantized tensor's blocks (this worker's share of them) to its module at their width;
    the loaded names, or none where the module needs a float copy. (An embedding kept as GGUF
    blocks or 16-bit rows reads its rows from the file as tokens need them, without mapping them:
    ``mapped_files.read_memmap_rows``.)"""
    if isinstance(module, VocabParallelEmbedding):
        if blocks.shape != (sum(module.vocab_sizes), param.shape[1]):
            return []  # (a float copy names the shapes)
        rows = blocks.shard(0, *module.vocab_range)  # (a tensor-parallel rank's rows)
        if blocks.row_lookup:
            module.kept_rows = rows
        else:
            with torch.no_grad():
                param.copy_(rows.dequantize())
        return [target]
    if not isinstance(module, Linear):
        return []
    fused_sizes = getattr(module, "full_sizes", None)
    if shard_idx is None and fused_sizes is not None and len(fused_sizes) > 1 \
            and blocks.shape == (sum(fused_sizes), module.in_features):
        at = 0  # a fused layer stored fused (Phi-3): each part its rows' blocks (this worker's share)
        for i, size in enumerate(fused_sizes):
            module.load_blocks(module.shard_of_blocks(blocks.take(at, at + size), i), i)
            at += size
        return [f"{target}#{i}" for i in range(len(fused_sizes))]
    share = module.shard_of_blocks(blocks, shard_idx)
    if share.shape[1] != param.shape[1]:
        return []  # (a float copy checks the shape)
    module.load_blocks(share, shard_idx)
    return [target if shard_idx is None else f"{target}#{shard_idx}"]
