"""One decoder-only transformer shared by Llama, Mistral, Qwen2 and Qwen3.

The variants differ only in flags: bias on the fused qkv projection (Qwen2) and RMSNorm on each
head's q and k before rotary (Qwen3). Projections are fused (``qkv_proj``, ``gate_up_proj``);
``packed_modules_mapping`` lets HF checkpoints with separate q/k/v and gate/up load unchanged.
The model sees flat tokens, positions and ``AttentionMetadata`` — never sequences. Under tensor
parallelism (``layers/parallel.py``) each rank builds the same model over its share of the heads,
the MLP's intermediate features and the vocabulary. Under pipeline parallelism each stage builds
only its contiguous share of the layers (the others are empty placeholders, their weights never
read); the first stage embeds, the last normalises and computes logits, and the hidden states and
residual go from stage to stage.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention import AttentionMetadata
from pagellm.distributed import PipelineStage, TensorParallelGroup
from pagellm.kernels import gemm
from pagellm.layers.activation import SiluAndMul, gated_activation
from pagellm.layers.linear import Linear
from pagellm.layers.norm import RMSNorm
from pagellm.layers.parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, copy_shard
from pagellm.layers.rotary import ApplyRotary, MRotaryEmbedding, RotaryEmbedding
from pagellm.models.cpu_packing import keep_blocks
from pagellm.quantization.quant_blocks import QuantizedBlocks
from pagellm.quantization.weight_formats import Bfloat16Packed, Int8Packed


def rope_parameters(config: Any, layer_type: str | None = None) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from an HF config of transformers 4 (rope_scaling) or 5 (rope_parameters),
    for the layers of ``layer_type`` where the config keys them by type (Gemma 3)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type is not None:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = params if params.get("rope_type", "default") != "default" else None
    else:
        theta, scaling = float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        # vLLM's rule: the long factors whenever the served length passes the trained one.
        original = scaling.get("original_max_position_embeddings") or config.original_max_position_embeddings
        served = getattr(config, "max_model_len", None) or config.max_position_embeddings
        scaling = {**scaling, "original_max_position_embeddings": original, "_long": served > original}
    return theta, scaling


def mrope_section(config: Any) -> list[int] | None:
    """Qwen2-VL's M-RoPE sections (``rope_parameters`` / ``rope_scaling``), or None."""
    for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(params, dict) and params.get("mrope_section"):
            return list(params["mrope_section"])
    return None


def rotary_dim(config: Any, head_dim: int) -> int:
    """How many of a head's features are rotated (``partial_rotary_factor``, Phi-4-mini's 0.75)."""
    params = getattr(config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return int(head_dim * float(factor or getattr(config, "partial_rotary_factor", None) or 1.0))


def sliding_window(config: Any, layer: int) -> int | None:
    """Layer ``layer``'s sliding window: ``config.layer_types`` where the config has them (Gemma,
    Qwen2's ``max_window_layers``), else every layer's when ``sliding_window`` is set and not
    switched off by ``use_sliding_window`` (Mistral)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window:
        return None
    if types is not None:
        return int(window) if types[layer] == "sliding_attention" else None
    return int(window) if getattr(config, "use_sliding_window", True) is not False else None


def model_sliding_window(model: nn.Module) -> int | None:
    """The window every attention layer of ``model`` keeps (the widest), or ``None`` where some
    layer attends to the whole context: only then may K/V that left the window be dropped."""
    windows = [m.sliding_window for m in model.modules() if isinstance(m, Attention)]
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def state_shapes(layer: nn.Module) -> tuple[tuple[tuple[int, ...], str], ...]:
    """A state layer's states per request, ``(shape, dtype)`` each (``"cache"``: the K/V cache's
    dtype); ``()`` for an attention layer. The worker gives them a ``MambaSpec`` group's block."""
    return tuple(getattr(layer, "state_shapes", ()))


def rope_layer_type(config: Any, layer: int) -> str | None:
    """The key of ``layer``'s rotary table: its ``layer_types`` entry where the config keys rope
    parameters by layer type (Gemma 3's local and global bases), else ``None`` (one table)."""
    params = getattr(config, "rope_parameters", None)
    types = getattr(config, "layer_types", None)
    if isinstance(params, dict) and types is not None and types[layer] in params:
        return str(types[layer])
    return None


class Attention(nn.Module):
    """Fused qkv projection, optional q/k norm, rotary, paged attention, output projection."""

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, layer: int = 0) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = hd = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        if total_kv_heads < tp.world_size:
            raise ValueError(f"tensor_parallel_size={tp.world_size} exceeds the model's {total_kv_heads} KV heads")
        # Whole GQA groups per rank: KV head j serves query heads j*group ... (j+1)*group - 1.
        kv_start, self.num_kv_heads = tp.shard(total_kv_heads)
        group = total_heads // total_kv_heads
        self.num_heads = self.num_kv_heads * group
        self.q_size = self.num_heads * hd
        self.kv_size = self.num_kv_heads * hd
        # (Gemma scales by its ``query_pre_attn_scalar`` rather than the head size.)
        self.scale = float(getattr(config, "query_pre_attn_scalar", None) or hd) ** -0.5
        q_part, kv_part = (kv_start * group * hd, self.q_size), (kv_start * hd, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_part, kv_part, kv_part], bias=qkv_bias,
                                             full_sizes=[total_heads * hd, total_kv_heads * hd, total_kv_heads * hd])
        self.o_proj = RowParallelLinear(q_part, config.hidden_size, getattr(config, "attention_bias", False), tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = ApplyRotary()
        self.sliding_window = sliding_window(config, layer)
        self.logit_softcap: float | None = getattr(config, "attn_logit_softcapping", None)
        self.rope_key = rope_layer_type(config, layer)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                reuse_input: bool = False) -> torch.Tensor:
        """``reuse_input``: the caller has no further use for ``x``, so a long prefill's queries and
        the output may be written over it (a layer whose block reads x again leaves it ``False``)."""
        if x.shape[0] > QKV_CHUNK_MIN_ROWS and self._sliceable(meta):
            q = self._queries_in_slices(rope, x, kv_cache, meta, reuse_input)
            o = meta.backend.forward(q, None, None, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                     self.logit_softcap, kv_written=True)
        else:
            q, k, v = self._project(x)
            q, k, written = meta.backend.rotary_and_write_kv(self.rotary, q, k, v, rope, kv_cache, meta)
            o = meta.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                     self.logit_softcap, kv_written=written)
            del k, v  # (the qkv output they view is not held through the output projection)
        del q
        # (x, or the queries over it, is dead by now)
        return self.o_proj(o, out=x if reuse_input and x.is_contiguous() else None)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of rows ``x`` (views into one qkv output), q/k-normed where the
        model norms them."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _sliceable(self, meta: AttentionMetadata) -> bool:
        """Whether a long prefill's projection may run in slices: over the int8 kernels (a row's
        output is the same bits in any batch), without adapters (their rows are mapped over the
        whole step), where every group of the step reads its K/V from the cache."""
        return rows_slice_exactly(self.qkv_proj) and meta.backend.reads_kv_from_cache(meta)

    def _queries_in_slices(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor,
                           kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                           over_input: bool) -> torch.Tensor:
        """The rotated queries of a long prefill, projected ``QKV_CHUNK_ROWS`` rows at a time, each
        slice's K/V written to the cache as it is made: the step holds its queries, not the whole
        qkv output (48 MiB at 2,048 tokens of a 1.7B, the largest activation of its step).
        ``over_input``: written into x's memory where its rows hold them (a query row is no wider
        than an input row, so slice ``i``'s queries land on input rows slices ``0..i`` have read)."""
        t, width = x.shape[0], self.num_heads * self.head_dim
        if over_input and x.is_contiguous() and width <= x.shape[1]:
            queries = x.view(-1)[:t * width].view(t, self.num_heads, self.head_dim)
        else:
            queries = torch.empty(t, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        for r0 in range(0, x.shape[0], QKV_CHUNK_ROWS):
            rows = slice(r0, r0 + QKV_CHUNK_ROWS)
            q, k, v = self._project(x[rows])
            q, k = self.rotary(q, k, (rope[0][rows], rope[1][rows]))
            meta.backend.write_kv(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping[rows])
            queries[rows] = q
        return queries


# Rows per slice of a long prefill through the MLP (``MLP.forward``): 128 rows of SmolLM2's gate/up
# output are 1.5 MiB, within a 2 MiB L2; 64-192 measured close, 128 best. At 512 rows slicing gains
# no time (measured), but a default prefill chunk's whole gate/up and activation were its step's
# largest tensors (48 MiB at 512 rows of a 1.7B), so steps of more than 256 rows take slices.
MLP_CHUNK_ROWS = 128
MLP_CHUNK_MIN_ROWS = 256
# The same for a long prefill's qkv projection (``Attention.forward``), sliced for memory: its
# 128-row slices ran as fast as one call (measured at 2,048 rows of a 1.7B). From 512 rows, where
# the qkv output outgrows the MLP's slices.
QKV_CHUNK_ROWS, QKV_CHUNK_MIN_ROWS = MLP_CHUNK_ROWS, 512


def rows_slice_exactly(*projections: Linear) -> bool:
    """Whether these projections give a row the same bits in a slice as in the whole batch: on the
    int8 kernels (every batch size runs through them), without adapters (mapped over the step)."""
    return all(isinstance(p.weight_format, Int8Packed) and p.lora is None for p in projections)


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up fused (SwiGLU, or Gemma's GeGLU)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        full = intermediate_size or config.intermediate_size
        part = tp.shard(full)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [part, part], bias=bias, full_sizes=[full, full])
        self.act_fn = gated_activation(config)
        self.down_proj = RowParallelLinear(part, config.hidden_size, bias, tp)

    def forward(self, x: torch.Tensor, reuse_input: bool = False) -> torch.Tensor:
        """``reuse_input``: the caller has no further use for ``x``, so a long prefill's output may
        be written over it, slice by slice as each slice's input is read."""
        packed = self._packed_for_amx()
        if packed is not None:
            g = self.gate_up_proj
            return gemm.mlp_silu_amx(x, *packed, g.in_features, g.out_features // 2)
        if x.shape[0] > MLP_CHUNK_MIN_ROWS and self._sliceable():
            # A long prefill in slices whose gate/up output stays in cache for SiLU*mul and the
            # down projection (2048 rows of SmolLM2 write and re-read 25 MiB otherwise).
            over_input = reuse_input and x.is_contiguous() and x.dtype == torch.float32
            out = x if over_input else torch.empty(x.shape[0], self.down_proj.out_features)
            for rows, c in zip(out.split(MLP_CHUNK_ROWS), x.split(MLP_CHUNK_ROWS), strict=True):
                rows.copy_(self._forward(c))  # (into one output: no slices held for a concatenation)
            return out
        return self._forward(x)

    def _packed_for_amx(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The packed gate/up and down weights where both projections are on the AMX bfloat16 kernel
        with SiLU's kernel between them, no biases, adapters or all-reduce: then one call gives the
        same bits (``gemm.mlp_silu_amx``)."""
        g, d = self.gate_up_proj, self.down_proj
        gf, df = g.weight_format, d.weight_format
        if (not isinstance(gf, Bfloat16Packed) or not isinstance(df, Bfloat16Packed) or not gf.amx or not df.amx
                or not isinstance(self.act_fn, SiluAndMul) or not self.act_fn.use_kernel
                or g.bias is not None or d.bias is not None or g.lora is not None or d.lora is not None
                or d.tp.world_size != 1 or g.out_features % 64):
            return None
        return gf.packed, df.packed

    def _sliceable(self) -> bool:
        """Only over the int8 kernels: every batch size runs through them, so a row's output is the
        same bits sliced or not, and they gain (the 30 MLPs 1.18x at 1024 rows, 1.28x at 2048; the
        bfloat16 kernel 0.96-0.99x, the float32 one 0.95x at 2048 rows). Not with adapters, whose
        rows are mapped over the whole step."""
        return rows_slice_exactly(self.gate_up_proj, self.down_proj)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def pre_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's normalised input and the residual stream it continues (the first layer's starts it):
    every block kind's first step, attention or state layer alike."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class DecoderLayer(nn.Module):
    # Whether a decode step may run this class's layers as one C call (worker/decode_graph.py), which
    # replays Llama's block op for op. Read from the class itself, never inherited: a subclass runs
    # layer by layer until it declares that its forward is what the graph replays.
    DECODE_GRAPH: ClassVar[bool] = True
    # The block's norms in the graph's slots (kernels/decode_graph.py LAYER_FIELDS): which of them a
    # layer has is what its block does (Gemma's four: each sublayer's output normed too).
    GRAPH_NORMS: ClassVar[dict[str, str]] = {"in_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, qkv_bias, qk_norm, tp, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def input_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return pre_norm(self.input_layernorm, x, residual)

    def forward(self, rope, x, residual, kv_cache, meta):
        x, residual = self.input_norm(x, residual)
        x = self.self_attn(rope, x, kv_cache, meta, reuse_input=True)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.feed_forward(x), residual

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of the normed ``x``, which the block does not read again (a mixture of experts
        reads it once per expert: given no leave to write over it)."""
        return self.mlp(x, reuse_input=True) if isinstance(self.mlp, MLP) else self.mlp(x)


class DecoderModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, freq_factors: torch.Tensor | None,
                 tp: TensorParallelGroup, pp: PipelineStage, layer_cls: type[DecoderLayer] | None = None,
                 embed_scale: bool = False) -> None:
        super().__init__()
        self.pp = pp
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        # Gemma multiplies the embeddings by sqrt(hidden_size), rounded to the model's dtype as HF does.
        self.embed_scale = config.hidden_size ** 0.5 if embed_scale else None
        self.start, self.end = pp.layer_range(config.num_hidden_layers)
        cls = layer_cls or DecoderLayer
        self.layers = nn.ModuleList(
            cls(config, qkv_bias, qk_norm, tp, i) if self.start <= i < self.end else nn.Identity()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        rd = rotary_dim(config, self.first_layer.self_attn.head_dim)
        # One rotary table per key the layers use (``None``: the model's one table; a layer type where
        # the config keys rope by type, Gemma 3): each step computes each once, none that no layer reads.
        keys = {la.self_attn.rope_key for la in self.layers if isinstance(la, DecoderLayer)}
        mrope = mrope_section(config)
        self.rotary_tables: dict[str | None, RotaryEmbedding] = {
            k: RotaryEmbedding(rd, config.max_position_embeddings, *rope_parameters(config, k), freq_factors)
            if mrope is None else  # (Qwen2-VL: positions [3, T] where images are)
            MRotaryEmbedding(rd, config.max_position_embeddings, *rope_parameters(config, k), mrope)
            for k in keys}

    @property
    def first_layer(self) -> DecoderLayer:
        """This pipeline stage's first attention layer (its shapes are every attention layer's; a
        state layer, LFM2's convolution, is none)."""
        return next(la for la in self.layers[self.start:self.end] if isinstance(la, DecoderLayer))

    def embed(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input: the tokens' embeddings, or ``inputs_embeds`` given (a
        vision-language model's, images' rows written in), scaled where the family scales them."""
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # (HF scales given embeddings too)
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str | None, Any]:
        """Each rotary table's ``(cos, sin)`` at ``positions`` (a layer reads its own by key)."""
        return {k: emb.cos_sin(positions, dtype) for k, emb in self.rotary_tables.items()}

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds: torch.Tensor | None = None):
        """The last stage's final hidden states; ``None`` on the stages before it (theirs went on).
        ``inputs_embeds``: the first layer's input given."""
        pp = self.pp
        if pp.is_first:
            x, residual = self.embed(input_ids, inputs_embeds), None
        else:
            shape = (input_ids.shape[0], self.hidden_size)
            x, residual = pp.recv([shape, shape], self.embed_tokens.weight.dtype, input_ids.device)
        ropes = self.rope_tables(positions, x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers[self.start:self.end], kv_caches, strict=True)):
            rope = ropes[layer.self_attn.rope_key] if isinstance(layer, DecoderLayer) else None
            x, residual = layer(rope, x, residual, kv_cache, meta.for_layer(i))
        assert residual is not None  # (every layer returns it)
        if not pp.is_last:
            pp.send([x, residual])
            return None
        x, _ = self.norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    """Causal LM over ``DecoderModel``; subclasses set ``qkv_bias`` / ``qk_norm``."""

    qkv_bias = False
    qk_norm = False
    layer_cls: type[DecoderLayer] | None = None  # (None: ``DecoderLayer``)
    embed_scale = False  # embeddings times sqrt(hidden_size) (Gemma)
    # Fused parameter -> (HF checkpoint name, shard index) pairs.
    packed_modules_mapping = {
        "qkv_proj": [("q_proj", 0), ("k_proj", 1), ("v_proj", 2)],
        "gate_up_proj": [("gate_proj", 0), ("up_proj", 1)],
    }

    def __init__(self, config: Any, freq_factors: torch.Tensor | None = None,
                 tp: TensorParallelGroup | None = None, pp: PipelineStage | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallelGroup()
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        self.model = DecoderModel(config, qkv_bias, self.qk_norm, freq_factors, tp, pp or PipelineStage(),
                                  self.layer_cls, self.embed_scale)
        self.final_logit_softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        vocab = self.model.embed_tokens.vocab_range  # the LM head's rows are the embedding's
        # Only the last pipeline stage computes logits: the others hold no LM head (tied or not).
        self.has_head = pp is None or pp.is_last
        self.lm_head = None if self.tie_word_embeddings or not self.has_head else \
            ColumnParallelLinear(config.hidden_size, [vocab], False)
        # A tied LM head, made by ``cpu_packing.pack_for_cpu`` to hold the embedding's packed copy.
        self.tied_head: Linear | None = None
        self.tied_head_blocks: QuantizedBlocks | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds)

    @staticmethod
    def rope_positions(layout: list[tuple[int, int, int, int, int]] | None, start: int, n: int) -> list[list[int]]:
        """The positions rotary embedding reads for tokens ``[start, start + n)``, one row per rotary
        section (a model's own hook, so the runner needs no model's rule): plain positions here,
        three rows; Qwen2-VL's M-RoPE derives them from the request's image ``layout``."""
        return [list(range(start, start + n)) for _ in range(3)]  # (three lists: no row aliases another)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings (a vision-language model's runner writes image rows over some)."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (each rank computes its rows; every rank gets all)."""
        embed = self.model.embed_tokens
        head = self.lm_head if self.lm_head is not None else self.tied_head
        logits = F.linear(hidden, embed.weight) if head is None else head(hidden)
        if self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return self.tp.all_gather_last_dim(logits, embed.vocab_sizes)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded_elsewhere: Iterable[str] = ()) -> None:
        """Copy HF-named tensors into the (fused, sharded) parameters; missing or unexpected names raise.

        Sharded layers cut this rank's slice out of each full tensor (``weight_loader``).
        ``loaded_elsewhere``: parameters a subclass loads itself (and checks)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        stage = range(self.model.start, self.model.end)
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name.startswith("model.layers.") and int(name.split(".")[2]) not in stage:
                continue  # another pipeline stage's layer
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes store the copy anyway
            target, shard = name, None
            for fused, parts in self.packed_modules_mapping.items():
                for part, idx in parts:
                    if f".{part}." in name:
                        target, shard = name.replace(f".{part}.", f".{fused}."), (fused, idx)
                        break
                if shard is not None:
                    break
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            module = self.get_submodule(target.rsplit(".", 1)[0])
            shard_idx = None if shard is None else shard[1]
            loader = getattr(module, "weight_loader", None)
            if isinstance(tensor, QuantizedBlocks):
                if name == "model.embed_tokens.weight" and self.lm_head is None and self.has_head:
                    # The tied LM head may take the file's blocks (this rank's rows of them).
                    self.tied_head_blocks = tensor.shard(0, *self.model.embed_tokens.vocab_range)
                kept = keep_blocks(module, param, target, shard_idx, tensor)
                if kept:
                    loaded.update(kept)
                    continue
                tensor = tensor.dequantize()  # (an embedding, or a shape only a copy checks)
            with torch.no_grad():
                try:
                    if loader is not None:
                        loader(param, tensor, shard_idx)
                    else:
                        copy_shard(param, tensor, None, 0, 0)
                except ValueError as e:
                    raise ValueError(f"weight {name}: {e}") from None
            fused_parts = getattr(module, "parts", ())
            if shard_idx is None and len(fused_parts) > 1:  # a fused layer stored fused (Phi-3)
                loaded.update(f"{target}#{i}" for i in range(len(fused_parts)))
            else:
                loaded.add(target if shard_idx is None else f"{target}#{shard_idx}")
        expected: set[str] = set()
        for pname in params:
            fused_name = next((f for f in self.packed_modules_mapping if f".{f}." in pname), None)
            if fused_name is None:
                expected.add(pname)
            else:
                expected.update(f"{pname}#{i}" for _, i in self.packed_modules_mapping[fused_name])
        missing = sorted(expected - loaded - set(loaded_elsewhere))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match {type(self).__name__}: "
                f"missing {len(missing)} {missing[:8]}, unexpected {len(unexpected)} {unexpected[:8]}"
            )
