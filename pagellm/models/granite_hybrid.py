"""Granite 4 hybrids (``GraniteMoeHybridForCausalLM``): Mamba2 layers with a few attention layers.

A Mamba2 layer projects its input to a gate ``z``, ``x | B | C`` and per-head ``dt`` (one
``in_proj``); convolves ``x | B | C`` along the sequence (a causal depthwise kernel with a bias, then
SiLU); and runs the selective state update over each head's ``[head_dim, d_state]`` state ``S``,
token by token: ``d = softplus(dt + dt_bias)``, ``S = exp(d A) S + (d B) x^T``, ``y = S C + D x``
(``A = -exp(A_log)``; heads share ``B`` and ``C`` within each of ``n_groups``). ``y * silu(z)`` is
RMS-normed per group and projected out. A request's two states (every head's ``S``, and the last
``d_conv - 1`` convolution inputs) are a ``MambaSpec`` group's block, in float32; every token
takes the same per-token arithmetic in a prefill, a chunk or a decode (on a CPU, C:
``kernels/linear_attention.c``; HF's prefill takes the chunked scan, the same sums in another
order).

Attention layers are Llama's without rotary (``position_embedding_type`` None; rope where set),
scaled by ``attention_multiplier``. Every layer ends in a shared MLP (``shared_mlp``: its gate and
up stored as one ``input_linear``), plus routed experts where the model has them
(``block_sparse_moe``: experts stored as ``[E, ...]`` tensors). Granite's muP multipliers: the
embeddings times ``embedding_multiplier``, each sublayer's output times ``residual_multiplier``,
the logits over ``logits_scaling``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention import AttentionMetadata
from pagellm.attention.causal_conv import causal_conv_native
from pagellm.attention.metadata import StateMetadata
from pagellm.distributed import TensorParallelGroup
from pagellm.kernels import linear_attention
from pagellm.layers.moe import SparseMoeBlock, num_experts
from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import ColumnParallelLinear, RowParallelLinear
from pagellm.models.decoder import MLP, Attention, DecoderLayer, pre_norm
from pagellm.models.moe import MoeForCausalLM


def _decoder_config(config: Any) -> Any:
    c = copy.copy(config)
    c.sliding_window = None
    limit = tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf")))
    if limit != (0.0, float("inf")):
        raise ValueError(f"time_step_limit {list(limit)} is not supported (only the default (0, inf))")
    return c


class GraniteAttention(Attention):
    """Llama's attention scaled by ``attention_multiplier``, rotary only where the config sets rope."""

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, layer: int = 0) -> None:
        super().__init__(config, qkv_bias, qk_norm, tp, layer)
        self.scale = float(config.attention_multiplier)
        self.nope = getattr(config, "position_embedding_type", None) != "rope"

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                reuse_input: bool = False) -> torch.Tensor:
        if not self.nope:
            return super().forward(rope, x, kv_cache, meta, reuse_input)
        q, k, v = self._project(x)
        o = meta.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                 self.logit_softcap)
        return self.o_proj(o)


class _GraniteBlock:
    """What both kinds of Granite layer do after their mixer: the residual multiplier on each
    sublayer's output, and the shared MLP plus the routed experts (where the model has them)."""

    residual_multiplier: float
    shared_mlp: MLP
    mlp: Any  # (the routed experts, a SparseMoeBlock, or None: named as MoeForCausalLM loads them)

    def _init_ffn(self, config: Any, tp: TensorParallelGroup) -> None:
        self.residual_multiplier = float(config.residual_multiplier)
        self.shared_mlp = MLP(config, tp, config.shared_intermediate_size)
        self.mlp = SparseMoeBlock(config, tp, MLP) if num_experts(config) > 0 else None

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared_mlp(x) if self.mlp is None else self.mlp(x) + self.shared_mlp(x)
        return out * self.residual_multiplier


class GraniteAttentionLayer(_GraniteBlock, DecoderLayer):
    DECODE_GRAPH = False  # (its multipliers are not the graph's; a model with state layers runs layer by layer)

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, layer: int = 0) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GraniteAttention(config, qkv_bias, False, tp, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._init_ffn(config, tp)

    def forward(self, rope, x, residual, kv_cache, meta):
        x, residual = self.input_norm(x, residual)
        x = self.self_attn(rope, x, kv_cache, meta) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        return self._ffn(x), residual


class Mamba2Mixer(nn.Module):
    """Mamba2's selective state space, its states in its group's block."""

    def __init__(self, config: Any, tp: TensorParallelGroup) -> None:
        super().__init__()
        if tp.world_size != 1:
            raise ValueError("Mamba2 layers do not split across tensor-parallel ranks yet")
        h = config.hidden_size
        self.num_heads, self.head_dim = int(config.mamba_n_heads), int(config.mamba_d_head)
        self.state_size, self.num_groups = int(config.mamba_d_state), int(config.mamba_n_groups)
        self.inner = self.num_heads * self.head_dim
        expand = getattr(config, "mamba_expand", None)  # (Granite's; Nemotron-H gives heads and their size)
        if (expand is not None and int(expand * h) != self.inner) or self.num_heads % self.num_groups:
            raise ValueError(f"mamba_expand * hidden_size must be mamba_n_heads * mamba_d_head "
                             f"({self.num_heads} * {self.head_dim}), mamba_n_heads a multiple of mamba_n_groups")
        self.dt_min = float(getattr(config, "mamba_dt_min", 0.0))  # (Nemotron-H's time_step_limit floor)
        self.conv_dim = self.inner + 2 * self.num_groups * self.state_size
        self.taps = int(config.mamba_d_conv)
        bias = bool(config.mamba_proj_bias)
        self.in_proj = ColumnParallelLinear(h, [(0, self.inner + self.conv_dim + self.num_heads)], bias=bias)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, self.taps), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim), requires_grad=False) \
            if config.mamba_conv_bias else None
        self.dt_bias = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.A = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)  # (-exp(A_log), as HF's)
        self.D = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
        self.norm = RMSNorm(self.inner, config.rms_norm_eps)  # (the gated group norm's weight)
        self.out_proj = RowParallelLinear((0, self.inner), h, bias, tp)

    @property
    def state_shapes(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        return (((self.num_heads, self.head_dim, self.state_size), "float32"),
                ((self.conv_dim, self.taps - 1), "float32"))

    def forward(self, x: torch.Tensor, states: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        """``x [T, hidden]`` over the step's sequences (``meta``'s rounds of spans); ``states``: the
        recurrent ``[num_blocks, H, head_dim, d_state]`` and convolution ``[num_blocks, conv_dim,
        d_conv - 1]`` states, read and rewritten at each span's block."""
        recurrent, conv = states
        z, xbc, dt = self.in_proj(x).float().split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        group = self.inner // self.num_groups
        if x.device.type == "cpu" and linear_attention.available():
            t = x.shape[0]
            conv_out = torch.empty(t, self.conv_dim)
            for spans in meta.each_round(conv):
                linear_attention.causal_conv(xbc, conv, self.conv_weight, spans, True, self.conv_bias, out=conv_out)
            y = torch.empty(t, self.inner)
            for spans in meta.each_round(recurrent):
                linear_attention.mamba2_ssm(conv_out, dt, self.A, self.dt_bias, self.D, recurrent, spans,
                                            self.num_groups, out=y, dt_min=self.dt_min)
            out = linear_attention.gated_group_norm(y, z, self.norm.weight, group, self.norm.eps)
        else:
            out = self.forward_native(z, xbc, dt, states, meta)
        return self.out_proj(out.to(x.dtype))

    def forward_native(self, z: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, states: tuple[torch.Tensor, ...],
                       meta: StateMetadata) -> torch.Tensor:
        """The layer between its projections in PyTorch, HF's recurrent arithmetic token by token."""
        recurrent, conv = states
        t = xbc.shape[0]
        xbc = F.silu(causal_conv_native(xbc, conv, self.conv_weight, self.conv_bias, meta))
        xs, b, c = xbc.split([self.inner, self.num_groups * self.state_size, self.num_groups * self.state_size], -1)
        rep = self.num_heads // self.num_groups
        xs = xs.reshape(t, self.num_heads, self.head_dim)
        b = b.reshape(t, self.num_groups, self.state_size).repeat_interleave(rep, dim=1)
        c = c.reshape(t, self.num_groups, self.state_size).repeat_interleave(rep, dim=1)
        d = F.softplus(dt + self.dt_bias.float())
        if self.dt_min > 0:  # (HF clamps its scan's steps at time_step_limit's floor: every token's here)
            d = d.clamp(min=self.dt_min)
        da = torch.exp(d * self.A.float())
        y = torch.empty_like(xs)
        for spans in meta.each_round(recurrent):
            for row0, n, fresh, block in spans:
                s = torch.zeros_like(recurrent[block]) if fresh else recurrent[block].clone()
                for i in range(row0, row0 + n):
                    s = s * da[i, :, None, None] + (d[i, :, None] * b[i])[:, None, :] * xs[i, :, :, None]
                    y[i] = (s * c[i, :, None, :]).sum(-1) + xs[i] * self.D.float()[:, None]
                recurrent[block] = s
        h = y.reshape(t, -1) * F.silu(z)
        h = h.view(t, self.num_groups, -1)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm.eps)
        return self.norm.weight.float() * h.reshape(t, -1)


class MambaLayer(_GraniteBlock, nn.Module):
    """A Mamba2 block: ``input_layernorm`` -> ``Mamba2Mixer`` -> residual, ``post_attention_layernorm``
    -> shared MLP (+ experts)."""

    def __init__(self, config: Any, tp: TensorParallelGroup) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mamba = Mamba2Mixer(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._init_ffn(config, tp)

    @property
    def state_shapes(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        return self.mamba.state_shapes

    def forward(self, rope, x, residual, kv_cache, meta):
        x, residual = pre_norm(self.input_layernorm, x, residual)
        x = self.mamba(x, kv_cache, meta) * self.residual_multiplier
        x, residual = self.post_attention_layernorm(x, residual)
        return self._ffn(x), residual


def granite_hybrid_layer(config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup,
                         layer: int = 0) -> nn.Module:
    """Layer ``layer`` as ``config.layer_types`` names it (``mamba`` / ``linear_attention`` or attention)."""
    if config.layer_types[layer] in ("mamba", "linear_attention"):
        return MambaLayer(config, tp)
    return GraniteAttentionLayer(config, qkv_bias, qk_norm, tp, layer)


_STACKED = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.(input|output)_linear\.weight")
_RENAMES = ((".shared_mlp.input_linear.", ".shared_mlp.gate_up_proj."),
            (".shared_mlp.output_linear.", ".shared_mlp.down_proj."),
            (".block_sparse_moe.router.layer.", ".mlp.gate."),
            (".mamba.conv1d.weight", ".mamba.conv_weight"), (".mamba.conv1d.bias", ".mamba.conv_bias"))


def granite_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """HF's names in ours; experts stored stacked (``[E, 2I, H]`` gate and up, ``[E, H, I]`` down)
    become one name per expert, as ``MoeForCausalLM`` loads them."""
    for name, tensor in weights:
        stacked = _STACKED.fullmatch(name)
        if stacked is not None:
            layer, which = stacked.groups()
            for e in range(tensor.shape[0]):
                prefix = f"model.layers.{layer}.mlp.experts.{e}"
                if which == "input":
                    gate, up = tensor[e].chunk(2, dim=0)
                    yield f"{prefix}.gate_proj.weight", gate
                    yield f"{prefix}.up_proj.weight", up
                else:
                    yield f"{prefix}.down_proj.weight", tensor[e]
            continue
        for old, new in _RENAMES:
            name = name.replace(old, new)
        if name.endswith(".mamba.conv_weight"):
            tensor = tensor.reshape(tensor.shape[0], -1)  # [conv_dim, 1, taps] -> [conv_dim, taps]
        elif name.endswith(".mamba.A_log"):
            name, tensor = name.removesuffix("_log"), -torch.exp(tensor.float())
        yield name, tensor


class GraniteMoeHybridForCausalLM(MoeForCausalLM):
    layer_cls = staticmethod(granite_hybrid_layer)  # type: ignore[assignment]

    def __init__(self, config: Any, freq_factors: torch.Tensor | None = None, tp: Any = None, pp: Any = None) -> None:
        super().__init__(_decoder_config(config), freq_factors, tp, pp)
        self.model.embed_scale = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded_elsewhere: Iterable[str] = ()) -> None:
        super().load_weights(granite_names(weights), loaded_elsewhere)
