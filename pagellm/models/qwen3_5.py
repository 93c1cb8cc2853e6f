"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next: gated DeltaNet layers between gated full-attention layers.

A DeltaNet layer (linear attention) projects its input to ``q, k, v`` (one ``in_proj_qkv``), an
output gate ``z`` and per-head ``b, a``; convolves ``q, k, v`` along the sequence, one channel at
a time (a causal kernel of ``linear_conv_kernel_dim`` taps, then SiLU); and runs the gated delta
rule over each value head's ``[key_dim, value_dim]`` recurrent state ``S``, token by token:
``S *= exp(g)``, ``S += k (beta (v - S^T k))^T``, ``o = S^T q``, where ``g = -exp(A_log)
softplus(a + dt_bias)``, ``beta = sigmoid(b)`` and q, k are L2-normed (q over sqrt(key_dim)).
Its output is RMS-normed per head, gated by ``silu(z)`` and projected out.

A request's two states (the recurrent ``S`` of every value head, and the last ``taps - 1``
convolution inputs) are a ``MambaSpec`` group's block, in float32 (``core/kv_cache_spec.py``). A
chunk continues from the states its request's last step left, its first chunk from zeros. Every
token takes the same per-token arithmetic (HF's recurrent form, which HF runs for decodes) in a
prefill, a chunk or a decode, so scheduling never changes a state's bits; HF's prefill takes the
chunked form, the same sums in another order (a float32 tie at most). On a CPU the per-token work
is C (``kernels/linear_attention.c``): PyTorch's elementwise sigmoid, softplus and SiLU round a
row differently as it falls in a vector or in a larger batch's scalar tail, which the kernels'
one order per token does not.

Full-attention layers put an output gate beside each head's queries (``q_proj``'s rows alternate
a head's queries and its gate: ``o * sigmoid(gate)`` before ``o_proj``), q/k norms, and rotary
on a quarter of each head (``partial_rotary_factor``). Norms are zero-centred (``1 + weight``,
loaded as such) except the DeltaNet's gated norm.
"""

from __future__ import annotations

import copy
import math
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
from pagellm.layers.moe import SparseMoeBlock
from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import ColumnParallelLinear, RowParallelLinear
from pagellm.models.decoder import MLP, Attention, DecoderForCausalLM, DecoderLayer, pre_norm
from pagellm.models.moe import MoeForCausalLM, is_sparse_layer


def _decoder_config(config: Any) -> Any:
    """The text config in the shared decoder's terms: one rotary table over plain positions (the
    M-RoPE sections of Qwen3.5's vision model are the same rotation where all three positions are
    the token's)."""
    c = copy.copy(config)
    params = dict(getattr(config, "rope_parameters", None) or {})
    for key in ("mrope_section", "mrope_interleaved"):
        params.pop(key, None)
    c.rope_parameters = params
    c.sliding_window = None
    return c


class GatedAttention(Attention):
    """Attention whose output is gated per feature by ``sigmoid(gate)``, the gate projected with
    each head's queries."""

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, layer: int = 0) -> None:
        super().__init__(config, qkv_bias, qk_norm, tp, layer)
        if tp.world_size != 1:
            raise ValueError("Qwen3.5's gated attention does not split across tensor-parallel ranks yet")
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [(0, 2 * self.q_size), (0, self.kv_size),
                                                                  (0, self.kv_size)], bias=qkv_bias)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                reuse_input: bool = False) -> torch.Tensor:
        t, hd = x.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(t, self.num_heads, 2 * hd)
        gate = qg[..., hd:].reshape(t, self.q_size)
        assert self.q_norm is not None and self.k_norm is not None
        q = self.q_norm(qg[..., :hd].contiguous())
        k = self.k_norm(k.reshape(t, self.num_kv_heads, hd))
        v = v.reshape(t, self.num_kv_heads, hd)
        q, k, written = meta.backend.rotary_and_write_kv(self.rotary, q, k, v, rope, kv_cache, meta)
        o = meta.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                 self.logit_softcap, kv_written=written)
        return self.o_proj(o.reshape(t, self.q_size) * torch.sigmoid(gate))


class Qwen3_5AttentionLayer(DecoderLayer):
    DECODE_GRAPH = False  # (its gate is not the graph's; a model with state layers runs layer by layer)

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, layer: int = 0) -> None:
        super().__init__(config, qkv_bias, qk_norm, tp, layer)
        self.self_attn = GatedAttention(config, qkv_bias, True, tp, layer)


def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                     beta: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule for ``m`` sequences at once: ``state [m, H, K, V]`` updated
    in place from ``q, k [m, H, K]``, ``v [m, H, V]``, ``decay`` (``exp(g)``) and ``beta [m, H]``;
    returns the token's output ``[m, H, V]``. Each sequence's arithmetic is its own (elementwise,
    and sums over K in one order), so a sequence gets the same bits in any batch."""
    state.mul_(decay[..., None, None])
    delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return (state * q[..., None]).sum(-2)


class GatedDeltaNet(nn.Module):
    """Linear attention by the gated delta rule, its states in its group's block."""

    def __init__(self, config: Any, tp: TensorParallelGroup) -> None:
        super().__init__()
        if tp.world_size != 1:
            raise ValueError("Qwen3.5's gated DeltaNet layers do not split across tensor-parallel ranks yet")
        h = config.hidden_size
        self.num_k_heads, self.num_v_heads = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        self.head_k_dim, self.head_v_dim = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_k_heads})")
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.taps = int(config.linear_conv_kernel_dim)
        hv = self.num_v_heads
        self.in_proj = ColumnParallelLinear(h, [(0, self.conv_dim), (0, self.value_dim), (0, hv), (0, hv)], bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, self.taps), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(hv), requires_grad=False)
        self.A = nn.Parameter(torch.zeros(hv), requires_grad=False)  # (-exp(A_log), as HF computes it)
        # Value head h reads key head h // (Hv / Hk), or h % Hk in llama.cpp's GGUF order ("tiled").
        self.tiled = bool(getattr(config, "linear_value_heads_tiled", False))
        self.norm = RMSNorm(self.head_v_dim, config.rms_norm_eps)  # (times silu(z): ``_gated_norm``)
        self.out_proj = RowParallelLinear((0, self.value_dim), h, False, tp)

    @property
    def state_shapes(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        return (((self.num_v_heads, self.head_k_dim, self.head_v_dim), "float32"),
                ((self.conv_dim, self.taps - 1), "float32"))

    def forward(self, x: torch.Tensor, states: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        """``x [T, hidden]`` over the step's sequences (``meta``'s rounds of spans); ``states``: the
        recurrent ``[num_blocks, H, K, V]`` and convolution ``[num_blocks, conv_dim, taps - 1]``
        states, read and rewritten at each span's block. On a CPU the kernels (``kernels/linear_attention``)
        take every token; elsewhere this module's PyTorch code, their reference."""
        recurrent, conv = states
        hv = self.num_v_heads
        qkv, z, b, a = self.in_proj(x).float().split([self.conv_dim, self.value_dim, hv, hv], dim=-1)
        if x.device.type == "cpu" and linear_attention.available():
            t = x.shape[0]
            mixed = torch.empty(t, self.conv_dim)
            for spans in meta.each_round(conv):
                linear_attention.causal_conv(qkv, conv, self.conv_weight, spans, silu=True, out=mixed)
            out = torch.empty(t, self.value_dim)
            for spans in meta.each_round(recurrent):
                linear_attention.gated_delta_rule(mixed, z, b, a, self.A, self.dt_bias, self.norm.weight,
                                                  self.norm.eps, recurrent, spans, self.num_k_heads, self.tiled,
                                                  out=out)
        else:
            out = self.forward_native(qkv, z, b, a, states, meta)
        return self.out_proj(out.to(x.dtype))

    def forward_native(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       states: tuple[torch.Tensor, ...], meta: StateMetadata) -> torch.Tensor:
        """The layer between its projections in PyTorch, HF's arithmetic token by token (float32):
        ``[T, value_dim]`` from the in-projection's parts."""
        recurrent, conv = states
        t, hv = qkv.shape[0], self.num_v_heads
        mixed = F.silu(causal_conv_native(qkv, conv, self.conv_weight, None, meta))
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = self._per_value_head(_l2norm(q.reshape(t, self.num_k_heads, self.head_k_dim))) / math.sqrt(self.head_k_dim)
        k = self._per_value_head(_l2norm(k.reshape(t, self.num_k_heads, self.head_k_dim)))
        v = v.reshape(t, hv, self.head_v_dim)
        beta = b.sigmoid()
        decay = (self.A.float() * F.softplus(a + self.dt_bias.float())).exp()
        out = self._delta_rule(recurrent, q, k, v, decay, beta, meta)
        return self._gated_norm(out, z.reshape(t, hv, self.head_v_dim)).reshape(t, -1)

    def _per_value_head(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, Hk, K]`` -> ``[T, Hv, K]``: each value head's key head (grouped, or tiled)."""
        rep = self.num_v_heads // self.num_k_heads
        return x.repeat(1, rep, 1) if self.tiled else x.repeat_interleave(rep, dim=1)

    def _delta_rule(self, recurrent: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    decay: torch.Tensor, beta: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """Every sequence's tokens in order, the sequences with a token at step ``i`` together (the
        longest first, so they are a prefix of the batch): a decode step is one batched step."""
        out = torch.empty_like(v)
        for round_spans in meta.each_round(recurrent):
            spans = sorted(round_spans, key=lambda s: -s[1])
            blocks = torch.tensor([s[3] for s in spans], dtype=torch.long)
            state = recurrent.index_select(0, blocks)
            fresh = [j for j, s in enumerate(spans) if s[2]]
            if fresh:
                state[fresh] = 0.0
            first = torch.tensor([s[0] for s in spans], dtype=torch.long)
            m = len(spans)
            for i in range(spans[0][1]):
                while spans[m - 1][1] <= i:
                    m -= 1
                rows = first[:m] + i
                out[rows] = gated_delta_step(state[:m], q[rows], k[rows], v[rows], decay[rows], beta[rows])
            recurrent.index_copy_(0, blocks, state)
        return out

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``weight * rmsnorm(o) * silu(z)`` per head, in float32 as HF's ``RMSNormGated``."""
        h = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm.eps)
        return self.norm.weight.float() * h * F.silu(z.float())


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


class GatedDeltaNetLayer(nn.Module):
    """A linear-attention block: ``input_layernorm`` -> ``GatedDeltaNet`` -> residual,
    ``post_attention_layernorm`` -> MLP."""

    def __init__(self, config: Any, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.linear_attn = GatedDeltaNet(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    @property
    def state_shapes(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        return self.linear_attn.state_shapes

    def forward(self, rope, x, residual, kv_cache, meta):
        x, residual = pre_norm(self.input_layernorm, x, residual)
        x = self.linear_attn(x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return (self.mlp(x, reuse_input=True) if isinstance(self.mlp, MLP) else self.mlp(x)), residual


def qwen3_5_layer(config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, layer: int = 0) -> nn.Module:
    """Layer ``layer`` as ``config.layer_types`` names it."""
    if config.layer_types[layer] == "linear_attention":
        return GatedDeltaNetLayer(config, tp)
    return Qwen3_5AttentionLayer(config, qkv_bias, True, tp, layer)


def qwen3_5_moe_layer(config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup,
                      layer: int = 0) -> nn.Module:
    """Qwen3.5-MoE's layer ``layer``: Qwen3.5's, its MLP a mixture of experts with a shared expert."""
    la = qwen3_5_layer(config, qkv_bias, qk_norm, tp, layer)
    la.mlp = SparseMoeBlock(config, tp, MLP)
    return la


# Zero-centred norms: HF multiplies by ``1 + weight`` (the DeltaNet's gated norm by its weight).
_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")


def _renamed(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        if name.startswith(("mtp.", "model.visual.")):
            continue  # (multi-token prediction and vision weights: not this text model's)
        if name.endswith(".linear_attn.conv1d.weight"):
            name, tensor = name.replace(".conv1d.weight", ".conv_weight"), tensor.reshape(tensor.shape[0], -1)
        elif name.endswith(".linear_attn.A_log"):
            name, tensor = name.removesuffix("_log"), -tensor.float().exp()
        elif name.endswith(_CENTRED) or name == "model.norm.weight":
            tensor = tensor.float() + 1.0
        yield name, tensor


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    layer_cls = staticmethod(qwen3_5_layer)  # type: ignore[assignment]
    qk_norm = True
    packed_modules_mapping = {
        **DecoderForCausalLM.packed_modules_mapping,
        "in_proj": [("in_proj_qkv", 0), ("in_proj_z", 1), ("in_proj_b", 2), ("in_proj_a", 3)],
    }

    def __init__(self, config: Any, freq_factors: torch.Tensor | None = None, tp: Any = None, pp: Any = None) -> None:
        super().__init__(_decoder_config(config), freq_factors, tp, pp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded_elsewhere: Iterable[str] = ()) -> None:
        super().load_weights(_renamed(weights), loaded_elsewhere)


class Qwen3_5MoeForCausalLM(MoeForCausalLM, Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: every layer's MLP routed (top-k renormalised) beside a gated shared expert."""

    layer_cls = staticmethod(qwen3_5_moe_layer)  # type: ignore[assignment]


def qwen3_next_layer(config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup,
                     layer: int = 0) -> nn.Module:
    """Qwen3-Next's layer ``layer``: Qwen3.5's, its MLP routed where Qwen's MoE rule says."""
    la = qwen3_5_layer(config, qkv_bias, qk_norm, tp, layer)
    if is_sparse_layer(config, layer):
        la.mlp = SparseMoeBlock(config, tp, MLP)
    return la


def _qwen3_next_weights(weights: Iterable[tuple[str, Any]], config: Any) -> Iterator[tuple[str, Any]]:
    """Qwen3-Next's DeltaNet projections in Qwen3.5's names and row order: its ``in_proj_qkvz`` and
    ``in_proj_ba`` hold each key head's rows together (q, k, then its value heads' v and z; b then a),
    Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` every head's q, then k ..."""
    hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    k, v, rep = int(config.linear_key_head_dim), int(config.linear_value_head_dim), hv // hk
    for name, tensor in weights:
        if name.endswith(".linear_attn.in_proj_qkvz.weight"):
            q, key, val, z = tensor.view(hk, 2 * k + 2 * rep * v, -1).split([k, k, rep * v, rep * v], dim=1)
            stem = name.removesuffix("in_proj_qkvz.weight")
            yield stem + "in_proj_qkv.weight", torch.cat([x.reshape(-1, x.shape[-1]) for x in (q, key, val)])
            yield stem + "in_proj_z.weight", z.reshape(-1, z.shape[-1])
        elif name.endswith(".linear_attn.in_proj_ba.weight"):
            b, a = tensor.view(hk, 2 * rep, -1).split([rep, rep], dim=1)
            stem = name.removesuffix("in_proj_ba.weight")
            yield stem + "in_proj_b.weight", b.reshape(-1, b.shape[-1])
            yield stem + "in_proj_a.weight", a.reshape(-1, a.shape[-1])
        else:
            yield name, tensor


class Qwen3NextForCausalLM(MoeForCausalLM, Qwen3_5ForCausalLM):
    """Qwen3-Next: Qwen3.5-MoE's layers (Qwen's ``decoder_sparse_step`` / ``mlp_only_layers`` rule for
    which are routed), its DeltaNet projections stored per key head (``_qwen3_next_weights``)."""

    layer_cls = staticmethod(qwen3_next_layer)  # type: ignore[assignment]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded_elsewhere: Iterable[str] = ()) -> None:
        super().load_weights(_qwen3_next_weights(weights, self.config), loaded_elsewhere)
