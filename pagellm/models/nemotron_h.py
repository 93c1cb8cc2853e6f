"""Nemotron-H (``NemotronHForCausalLM``): Mamba2, attention and MLP layers, one mixer per layer.

Each layer is ``x + mixer(norm(x))``, its mixer one of (``config.layers_block_type``):
- ``linear_attention``: Granite 4's ``Mamba2Mixer`` (heads and their size given, not an expansion;
  each step's ``softplus(dt + dt_bias)`` clamped to ``time_step_limit``, as HF's scan clamps it:
  here every token's, prefilled or decoded, so a token's state does not depend on the schedule;
  ``time_step_min`` only sets ``dt_bias`` at initialisation);
- ``full_attention``: attention without rotary (NoPE), scaled by ``head_dim ** -0.5``;
- ``mlp``: ``down(relu(up(x)) ** 2)``. An MLP layer keeps nothing per request: it is in no KV cache
  group (``group_layers``' ``False``), and gets no cache tensors.
The routed-expert layers of Nemotron 3 (``moe``) are refused at start-up.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagellm.distributed import TensorParallelGroup
from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import ColumnParallelLinear, RowParallelLinear
from pagellm.models.decoder import DecoderForCausalLM, DecoderLayer, pre_norm
from pagellm.models.granite_hybrid import GraniteAttention, Mamba2Mixer, granite_names


def _decoder_config(config: Any) -> Any:
    """The checkpoint's config in the names the shared decoder and Granite's Mamba2 mixer read."""
    c = copy.copy(config)
    c.rms_norm_eps = config.layer_norm_epsilon
    c.sliding_window = None
    c.attention_multiplier = float(config.head_dim) ** -0.5
    c.position_embedding_type = None  # (NoPE)
    c.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}  # (a table no layer reads)
    c.mamba_n_heads, c.mamba_d_head = config.mamba_num_heads, config.mamba_head_dim
    c.mamba_d_state, c.mamba_n_groups = config.ssm_state_size, config.n_groups
    c.mamba_d_conv, c.mamba_conv_bias, c.mamba_proj_bias = config.conv_kernel, config.use_conv_bias, config.use_bias
    c.mamba_expand = None
    limit = tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
    if limit[1] != float("inf"):
        raise ValueError(f"time_step_limit {list(limit)} is not supported (only an unbounded top)")
    c.mamba_dt_min = float(limit[0])
    if "moe" in config.layers_block_type:
        raise ValueError("Nemotron-H's routed-expert layers ('moe': Nemotron 3) are not supported yet")
    return c


class ReluSquaredMLP(nn.Module):
    """``down(relu(up(x)) ** 2)``: no gate."""

    def __init__(self, config: Any, tp: TensorParallelGroup) -> None:
        super().__init__()
        part = tp.shard(config.intermediate_size)
        self.up_proj = ColumnParallelLinear(config.hidden_size, [part], bias=config.mlp_bias,
                                            full_sizes=[config.intermediate_size])
        self.down_proj = RowParallelLinear(part, config.hidden_size, config.mlp_bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHAttentionLayer(DecoderLayer):
    DECODE_GRAPH = False  # (a model with state layers runs layer by layer)

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, layer: int = 0) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GraniteAttention(config, qkv_bias, False, tp, layer)

    def forward(self, rope, x, residual, kv_cache, meta):
        x, residual = pre_norm(self.input_layernorm, x, residual)
        return self.self_attn(rope, x, kv_cache, meta), residual


class NemotronHMambaLayer(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = Mamba2Mixer(config, tp)

    @property
    def state_shapes(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        return self.mamba.state_shapes

    def forward(self, rope, x, residual, kv_cache, meta):
        x, residual = pre_norm(self.input_layernorm, x, residual)
        return self.mamba(x, kv_cache, meta), residual


class NemotronHMLPLayer(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = ReluSquaredMLP(config, tp)

    def forward(self, rope, x, residual, kv_cache, meta):
        x, residual = pre_norm(self.input_layernorm, x, residual)
        return self.mlp(x), residual


def nemotron_h_layer(config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, layer: int = 0) -> nn.Module:
    kind = config.layers_block_type[layer]
    if kind == "linear_attention":
        return NemotronHMambaLayer(config, tp)
    if kind == "mlp":
        return NemotronHMLPLayer(config, tp)
    return NemotronHAttentionLayer(config, qkv_bias, qk_norm, tp, layer)


_GLOBAL = {"model.embeddings.weight": "model.embed_tokens.weight", "model.norm_f.weight": "model.norm.weight"}
_MIXERS = {"linear_attention": "mamba", "full_attention": "self_attn", "mlp": "mlp"}


def _renamed(weights: Iterable[tuple[str, Any]], layer_types: list[str]) -> Iterator[tuple[str, Any]]:
    """HF's names (``backbone.`` or ``model.``) in ours: a layer's ``norm`` is its input norm, its
    ``mixer`` its ``mamba``, ``self_attn`` or ``mlp``; the Mamba2 mixer's own names as Granite's
    (``granite_hybrid.granite_names``: the convolution's shape, ``A`` from ``A_log``)."""
    def ours() -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            name = "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name
            parts = name.split(".")
            if parts[:2] == ["model", "layers"]:
                if parts[3] == "norm":
                    parts[3] = "input_layernorm"
                elif parts[3] == "mixer":
                    parts[3] = _MIXERS[layer_types[int(parts[2])]]
                name = ".".join(parts)
            yield _GLOBAL.get(name, name), tensor
    return granite_names(ours())


class NemotronHForCausalLM(DecoderForCausalLM):
    layer_cls = staticmethod(nemotron_h_layer)  # type: ignore[assignment]
    # (its MLP's up_proj is no gated MLP's half: only attention's projections are fused)
    packed_modules_mapping = {"qkv_proj": DecoderForCausalLM.packed_modules_mapping["qkv_proj"]}

    def __init__(self, config: Any, freq_factors: torch.Tensor | None = None, tp: Any = None, pp: Any = None) -> None:
        super().__init__(_decoder_config(config), freq_factors, tp, pp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded_elsewhere: Iterable[str] = ()) -> None:
        super().load_weights(_renamed(weights, list(self.config.layers_block_type)), loaded_elsewhere)
