"""GGUF files: config from metadata, tensors dequantized and renamed to Hugging Face names.

llama.cpp's converter permutes the rows of Llama's q/k projections (interleaved rotary layout);
``_reverse_permute`` undoes it so the weights fit HF's rotate-half rotary.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np
import torch

_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


@lru_cache(maxsize=2)
def _reader(path: str):
    import gguf

    return gguf.GGUFReader(path)


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_architecture(path: str) -> str:
    arch = _field(_reader(path), "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHS)}")
    return arch


def gguf_config(path: str):
    """An HF ``PretrainedConfig`` built from the GGUF metadata."""
    import transformers

    r = _reader(path)
    arch = gguf_architecture(path)
    p = f"{arch}."
    n_heads = int(_field(r, p + "attention.head_count"))
    hidden = int(_field(r, p + "embedding_length"))
    # Only the count: decoding the ~50k token strings (``contents()``) would cost seconds.
    tokens_field = r.fields.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens_field.data) if tokens_field is not None else 0
    names = {t.name for t in r.tensors}
    kwargs: dict[str, Any] = dict(
        hidden_size=hidden,
        intermediate_size=int(_field(r, p + "feed_forward_length")),
        num_hidden_layers=int(_field(r, p + "block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(_field(r, p + "attention.head_count_kv", n_heads)),
        head_dim=int(_field(r, p + "attention.key_length", hidden // n_heads)),
        rms_norm_eps=float(_field(r, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(r, p + "rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(r, p + "context_length", 2048)),
        vocab_size=int(_field(r, p + "vocab_size", n_tokens)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(r, "tokenizer.ggml.eos_token_id"),
    )
    scaling = _field(r, p + "rope.scaling.type")
    if scaling == "linear":
        kwargs["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(r, p + "rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch]
    config = cls(**kwargs)
    config.architectures = [_ARCHS[arch]]
    return config


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _to_array(t) -> np.ndarray:
    import gguf

    shape = tuple(int(x) for x in reversed(t.shape))
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(t.data).reshape(shape)
    return gguf.dequantize(t.data, t.tensor_type).reshape(shape)


def rope_freq_factors(path: str) -> torch.Tensor | None:
    for t in _reader(path).tensors:
        if t.name == "rope_freqs.weight":
            return torch.from_numpy(_to_array(t).astype(np.float32))
    return None


def iter_gguf_weights(path: str, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor dequantized to float32, under its Hugging Face name."""
    r = _reader(path)
    permute = gguf_architecture(path) == "llama"
    for t in r.tensors:
        if t.name == "rope_freqs.weight":
            continue
        arr = _to_array(t)
        m = _BLK.match(t.name)
        if m:
            layer, kind, suffix = m.groups()
            if kind not in _LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {t.name!r}")
            name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
            if permute and kind == "attn_q":
                arr = _reverse_permute(arr, config.num_attention_heads)
            elif permute and kind == "attn_k":
                arr = _reverse_permute(arr, config.num_key_value_heads)
        else:
            base, _, suffix = t.name.rpartition(".")
            if base not in _GLOBAL_NAMES:
                raise ValueError(f"unexpected GGUF tensor {t.name!r}")
            name = f"{_GLOBAL_NAMES[base]}.{suffix}"
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
