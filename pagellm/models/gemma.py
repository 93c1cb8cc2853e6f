"""Gemma 2 and Gemma 3 (text): the shared decoder with Gemma's differences.

Structure: each sublayer's output is normalised again before the residual add (four norms per
layer: ``input``, ``post_attention``, ``pre_feedforward``, ``post_feedforward``). Flags handled by
the shared decoder: GeGLU (``hidden_activation``), embeddings times sqrt(hidden_size), attention
scaled by ``query_pre_attn_scalar``, logits soft-capped in attention and at the head, and a
sliding window on the layers ``layer_types`` names. Gemma's RMSNorm multiplies by ``1 + weight``:
the checkpoint's weights get their 1 added once, at load (GGUF files hold ``1 + weight`` already;
``weights/gguf_file.py`` gives them back in the checkpoint's form, as transformers' loader does).
Gemma 3 adds Gemma-style q/k norms, and rotary bases per layer type (local on its sliding layers,
global, maybe scaled, on the others); it has no soft-caps.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagellm.layers.norm import RMSNorm
from pagellm.models.decoder import DecoderForCausalLM, DecoderLayer


class Gemma2DecoderLayer(DecoderLayer):
    DECODE_GRAPH = True
    GRAPH_NORMS = {**DecoderLayer.GRAPH_NORMS, "pre_ff_norm": "pre_feedforward_layernorm",
                   "post_ff_norm": "post_feedforward_layernorm"}

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: Any, layer: int = 0) -> None:
        super().__init__(config, qkv_bias, qk_norm, tp, layer)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, x, residual, kv_cache, meta):
        x, residual = self.input_norm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope, x, kv_cache, meta, reuse_input=True))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.feed_forward(x)), residual


def _plus_one_norms(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Every RMSNorm weight ``w`` as ``1 + w`` (in float32, as Gemma's norm computes it)."""
    for name, tensor in weights:
        if name.endswith("norm.weight"):
            tensor = tensor.narrow(0, 0, tensor.shape[0]).float() + 1.0
        yield name, tensor


class Gemma2ForCausalLM(DecoderForCausalLM):
    layer_cls = Gemma2DecoderLayer
    embed_scale = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded_elsewhere: Iterable[str] = ()) -> None:
        super().load_weights(_plus_one_norms(weights), loaded_elsewhere)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True
