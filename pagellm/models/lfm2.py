"""LFM2 (Liquid AI): attention layers between short-convolution layers.

A convolution layer projects its input to ``B, C, x`` (one ``in_proj``), convolves ``B * x`` along
the sequence, one channel at a time, with a causal kernel of ``conv_L_cache`` taps, multiplies by
``C`` and projects out. Its state per request is the last ``conv_L_cache - 1`` values of ``B * x``
(a ``MambaSpec`` group's block: ``core/kv_cache_spec.py``); a chunk continues from the state its
request's last step left, a request's first chunk from zeros. Every token's output is the same
sum in the same order (``taps`` below) in a prefill, a chunk or a decode, and ``B * x`` is rounded
to the cache's dtype before it is convolved, as it is when stored: scheduling never changes a
state's bits. Attention layers are the shared decoder's with Gemma-free q/k norms; norms are
``operator_norm`` / ``ffn_norm`` and the MLP's projections ``w1`` / ``w3`` / ``w2`` in the checkpoint.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagellm.attention.metadata import StateMetadata
from pagellm.distributed import TensorParallelGroup
from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import ColumnParallelLinear, RowParallelLinear
from pagellm.models.decoder import MLP, DecoderForCausalLM, DecoderLayer, pre_norm


def _decoder_config(config: Any) -> Any:
    """The checkpoint's config in the shared decoder's names: the norms' epsilon, and the MLP's
    width as LFM2 adjusts it (``block_auto_adjust_ff_dim``: two thirds, times a multiplier, rounded
    up to ``block_multiple_of``)."""
    c = copy.copy(config)
    c.rms_norm_eps = config.norm_eps
    inter = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        inter = int(2 * inter / 3)
        if config.block_ffn_dim_multiplier is not None:
            inter = int(config.block_ffn_dim_multiplier * inter)
            inter = config.block_multiple_of * ((inter + config.block_multiple_of - 1) // config.block_multiple_of)
    c.intermediate_size = inter
    c.sliding_window = None
    c.attention_bias = False
    return c


class ShortConv(nn.Module):
    """``out_proj(C * conv(B * x))`` with the convolution's state in its group's block."""

    def __init__(self, config: Any, tp: TensorParallelGroup) -> None:
        super().__init__()
        if tp.world_size != 1:
            raise ValueError("LFM2's convolution layers do not split across tensor-parallel ranks yet")
        h, self.taps = config.hidden_size, int(config.conv_L_cache)
        bias = bool(config.conv_bias)
        self.hidden_size = h
        self.in_proj = ColumnParallelLinear(h, [(0, 3 * h)], bias=bias)
        self.out_proj = RowParallelLinear((0, h), h, bias, tp)
        self.conv_weight = nn.Parameter(torch.zeros(h, self.taps), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.zeros(h), requires_grad=False) if bias else None

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.hidden_size, self.taps - 1)

    def forward(self, x: torch.Tensor, state: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """``x [T, hidden]`` over the step's sequences (``meta``'s rounds of spans); ``state [num_blocks, hidden,
        taps - 1]`` (the cache's dtype) read and rewritten at each sequence's block."""
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        bx = (b * v).to(state.dtype).to(x.dtype)  # (rounded as the state stores it)
        out = torch.empty_like(bx)
        w = self.conv_weight.to(x.dtype)
        keep = self.taps - 1
        for spans in meta.each_round(state):
            for row0, n, fresh, block in spans:
                past = torch.zeros(keep, self.hidden_size, dtype=x.dtype) if fresh else state[block].t().to(x.dtype)
                xp = torch.cat([past, bx[row0:row0 + n]])  # [keep + n, hidden]
                acc = xp[0:n] * w[:, 0]
                for k in range(1, self.taps):  # (one order for every token: prefill and decode alike)
                    acc = acc + xp[k:k + n] * w[:, k]
                if self.conv_bias is not None:
                    acc = acc + self.conv_bias.to(x.dtype)
                out[row0:row0 + n] = acc
                state[block] = xp[n:].t().to(state.dtype)
        return self.out_proj(c * out)


class Lfm2ConvLayer(nn.Module):
    """A convolution block: ``operator_norm`` -> ``ShortConv`` -> residual, ``ffn_norm`` -> MLP."""

    def __init__(self, config: Any, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.conv = ShortConv(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    @property
    def state_shapes(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        """This layer's state per request, in the cache's dtype (``decoder.state_shapes``)."""
        return ((self.conv.state_shape, "cache"),)

    def forward(self, rope, x, residual, kv_cache, meta):
        x, residual = pre_norm(self.input_layernorm, x, residual)
        x = self.conv(x, kv_cache[0], meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, reuse_input=True), residual


def lfm2_layer(config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, layer: int = 0) -> nn.Module:
    """Layer ``layer`` as ``config.layer_types`` names it."""
    if config.layer_types[layer] == "conv":
        return Lfm2ConvLayer(config, tp)
    return Lfm2AttentionLayer(config, qkv_bias, True, tp, layer)


class Lfm2AttentionLayer(DecoderLayer):
    DECODE_GRAPH = False  # (a model with convolution layers runs layer by layer)


# The checkpoint's names -> the shared decoder's.
_RENAMES = ((".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
            (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
            (".feed_forward.w2.", ".mlp.down_proj."), (".self_attn.out_proj.", ".self_attn.o_proj."),
            (".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."),
            (".conv.conv.weight", ".conv.conv_weight"), (".conv.conv.bias", ".conv.conv_bias"),
            ("model.embedding_norm.", "model.norm."))


def _renamed(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        if name.endswith(".conv.conv_weight"):
            tensor = tensor.reshape(tensor.shape[0], -1)  # [hidden, 1, taps] -> [hidden, taps]
        yield name, tensor


class Lfm2ForCausalLM(DecoderForCausalLM):
    layer_cls = staticmethod(lfm2_layer)  # type: ignore[assignment]
    qk_norm = True

    def __init__(self, config: Any, freq_factors: torch.Tensor | None = None, tp: Any = None, pp: Any = None) -> None:
        super().__init__(_decoder_config(config), freq_factors, tp, pp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded_elsewhere: Iterable[str] = ()) -> None:
        super().load_weights(_renamed(weights), loaded_elsewhere)
