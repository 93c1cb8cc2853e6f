"""Writing decoder GGUF files (``gguf.GGUFWriter``: Llama, Gemma 2 and 3, Phi-3) with llama.cpp's
tensor names, metadata and type choices, for checkpoints made locally: tests' K-quant models and
``benchmarks/scale.py``'s models at real size. The tokenizer is copied from another GGUF file (the
bundled SmolLM2's), its list padded with unused tokens up to a larger vocabulary."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from pagellm.quantization.gguf_quant import quantize_q4_k, quantize_q6_k

# The legacy type llama.cpp falls back to when a row is not a multiple of 256 (llama-quant.cpp).
K_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


@dataclass(frozen=True)
class DecoderShape:
    """A decoder's shape as llama.cpp's ``arch`` (``llama``, ``gemma2``, ``gemma3``, ``phi3``) stores it."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int = 49152
    context: int = 8192
    rope_theta: float = 100000.0
    tied: bool = True
    arch: str = "llama"
    head_dim: int | None = None  # hidden // heads unless set (Gemma's 256)
    sliding_window: int | None = None  # Gemma's sliding layers', Phi-3's every layer's
    attn_softcap: float | None = None  # Gemma 2's attention and final logit soft-caps
    final_softcap: float | None = None

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


def _use_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m(name: str, layers: int) -> T:
    """llama.cpp's Q4_K_M choice for a tensor (``llama_tensor_get_type``): Q6_K for the output (or
    a tied embedding) and for attn_v / ffn_down in the layers that get more bits, Q4_K elsewhere.
    (A fused attn_qkv, Phi-3's, gets Q5_K there; Q6_K here, which this module can write.)"""
    if name in ("output", "token_embd") or name.endswith(".attn_qkv"):
        return T.Q6_K
    parts = name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and _use_more_bits(int(parts[1]), layers):
        return T.Q6_K
    return T.Q4_K


def encode(w: np.ndarray, qtype: T) -> tuple[np.ndarray, T]:
    """``(bytes or floats, type)`` of a float32 matrix, with llama.cpp's fallback for K types on rows
    that are not a multiple of 256."""
    if qtype in K_FALLBACK and w.shape[-1] % 256:
        qtype = K_FALLBACK[qtype]
    if qtype == T.Q4_K:
        return quantize_q4_k(w), qtype
    if qtype == T.Q6_K:
        return quantize_q6_k(w), qtype
    if qtype in (T.F32, T.F16):
        return w.astype(np.float32 if qtype == T.F32 else np.float16), qtype
    return gguf.quantize(w, qtype), qtype


def _copy_tokenizer(w: gguf.GGUFWriter, source: str, vocab: int | None = None) -> None:
    """``source``'s tokenizer; with ``vocab`` larger than its list, unused tokens pad it (llama.cpp
    needs one per row of the embedding; Gemma's own vocabulary has thousands of them)."""
    src = gguf.GGUFReader(source)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        if key in src.fields:
            w.add_string(key, src.fields[key].contents())
    tokens, types = src.fields["tokenizer.ggml.tokens"].contents(), src.fields["tokenizer.ggml.token_type"].contents()
    pad = max(0, (vocab or 0) - len(tokens))
    w.add_token_list(tokens + [f"<unused{i}>" for i in range(pad)])
    w.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    w.add_token_merges(src.fields["tokenizer.ggml.merges"].contents())
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{key}" in src.fields:
            w.add_uint32(f"tokenizer.ggml.{key}", src.fields[f"tokenizer.ggml.{key}"].contents())
    w.add_bool("tokenizer.ggml.add_bos_token", False)


def decoder_tensor_shapes(s: DecoderShape) -> Iterable[tuple[str, tuple[int, ...]]]:
    """llama.cpp's tensor names and PyTorch-order shapes of a decoder of shape ``s``."""
    hd = s.head_size
    yield "token_embd", (s.vocab, s.hidden)
    yield "output_norm", (s.hidden,)
    if not s.tied:
        yield "output", (s.vocab, s.hidden)
    norms: list[tuple[str, tuple[int, ...]]] = [("attn_norm", (s.hidden,)), ("ffn_norm", (s.hidden,))]
    if s.arch in ("gemma2", "gemma3"):
        norms += [("post_attention_norm", (s.hidden,)), ("post_ffw_norm", (s.hidden,))]
    if s.arch == "gemma3":
        norms += [("attn_q_norm", (hd,)), ("attn_k_norm", (hd,))]
    if s.arch == "phi3":  # fused: q, k and v; gate and up
        mats = [("attn_qkv", ((s.heads + 2 * s.kv_heads) * hd, s.hidden)), ("attn_output", (s.hidden, s.heads * hd)),
                ("ffn_up", (2 * s.intermediate, s.hidden)), ("ffn_down", (s.hidden, s.intermediate))]
    else:
        mats = [("attn_q", (s.heads * hd, s.hidden)), ("attn_k", (s.kv_heads * hd, s.hidden)),
                ("attn_v", (s.kv_heads * hd, s.hidden)), ("attn_output", (s.hidden, s.heads * hd)),
                ("ffn_gate", (s.intermediate, s.hidden)), ("ffn_up", (s.intermediate, s.hidden)),
                ("ffn_down", (s.hidden, s.intermediate))]
    for i in range(s.layers):
        yield from ((f"blk.{i}.{n}", shape) for n, shape in norms + mats)


def _add_arch_metadata(w: gguf.GGUFWriter, s: DecoderShape) -> None:
    """The keys llama.cpp (and ``gguf_file.gguf_config``) read for ``s.arch`` beyond the shape."""
    w.add_rope_freq_base(s.rope_theta)
    if s.arch == "llama" or s.arch == "phi3":
        w.add_rope_dimension_count(s.head_size)
    if s.arch in ("gemma2", "gemma3"):
        w.add_key_length(s.head_size)
        w.add_value_length(s.head_size)
    if s.sliding_window is not None:
        w.add_sliding_window(s.sliding_window)
    if s.attn_softcap is not None:
        w.add_float32(f"{s.arch}.attn_logit_softcapping", s.attn_softcap)
    if s.final_softcap is not None:
        w.add_float32(f"{s.arch}.final_logit_softcapping", s.final_softcap)


def add_decoder_metadata(w: gguf.GGUFWriter, context: int, hidden: int, layers: int, intermediate: int, heads: int,
                         kv_heads: int, rms_eps: float, vocab: int) -> None:
    """The shape keys every decoder architecture's GGUF has (under the writer's architecture)."""
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_vocab_size(vocab)


def write_decoder_gguf(path: str, s: DecoderShape, tensor: Callable[[str, tuple[int, ...]], np.ndarray],
                       qtype_for: Callable[[str], T], tokenizer_from: str) -> dict[str, int]:
    """Write a GGUF of ``s.arch`` whose tensors come from ``tensor(name, shape)`` (float32), matrices
    encoded as ``qtype_for(name)`` says (norms stay float32); returns how many tensors of each type."""
    w = gguf.GGUFWriter(path, s.arch)
    add_decoder_metadata(w, s.context, s.hidden, s.layers, s.intermediate, s.heads, s.kv_heads, 1e-5, s.vocab)
    _add_arch_metadata(w, s)
    _copy_tokenizer(w, tokenizer_from, s.vocab)
    counts: dict[str, int] = {}
    for name, shape in decoder_tensor_shapes(s):
        values = tensor(name, shape)
        data, qtype = (values.astype(np.float32), T.F32) if len(shape) == 1 else encode(values, qtype_for(name))
        w.add_tensor(f"{name}.weight", data, raw_dtype=qtype if qtype not in (T.F32, T.F16) else None)
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return counts
