"""When a decode step's decoder layers run as one call (``kernels/decode_graph.py``), its tables, and
the step through it: the runner's CPU execution policy, beside the CUDA graph runner (``cuda_graph.py``).

The graph replays exactly the kernels the Python layers call on a CPU, so it applies only where
every one of them is a compiled kernel: every projection packed for one of the GEMM kernels (int8
over GGUF blocks, float32 with its quantized copy for small batches, or bfloat16; ``Linear.matmul``'s
choice, made the same way in C), the compiled norms (per-head q/k norms included), rotary (whole
heads; a table per layer type, Gemma 3's) and SiLU or GELU (tanh) times up, the ``"cpu"`` attention
backend's K/V write and decode kernels (with a layer's sliding window and soft-cap), one process (no
tensor or pipeline split), no LoRA adapters. Layers are those whose class declares ``DECODE_GRAPH``
(a subclass must declare it itself) and names its norms in the graph's slots (``GRAPH_NORMS``:
Llama's two, Gemma 2 and 3's four); a step takes it when all its rows are decodes (one
``DECODE_KERNEL`` group); prefill and mixed steps run the model's forward, layer by layer. Outputs
are the same bits either way (tested), so nothing about scheduling can tell the two apart. The
model knows nothing of the graph: the runner asks ``DecodeGraphCapture.forward`` first.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, TypeGuard

import torch

from pagellm.attention.cpu_kernel import decode_kernel_address, element_type
from pagellm.attention.metadata import AttentionGroup, AttentionKind, AttentionMetadata
from pagellm.kernels import cpu_ops, decode_graph, gemm, gemm_int8
from pagellm.kernels.decode_graph import DecodeGraph

if TYPE_CHECKING:
    from pagellm.models.decoder import DecoderLayer, DecoderModel


def decode_group(meta: AttentionMetadata) -> AttentionGroup | None:
    """The step's one ``DECODE_KERNEL`` group if every row is a decode in it, else ``None`` (also
    where layers read the tables of several KV cache groups that the step does not hand over as one
    ``group_tables``)."""
    if len(meta.groups) != 1 or (meta.kv_groups is not None and meta.group_tables is None):
        return None
    grp = meta.groups[0]
    if grp.kind != AttentionKind.DECODE_KERNEL or grp.token_start != 0 or grp.token_end != meta.num_tokens \
            or grp.kv_blocks is None or grp.seq_lens is None or grp.prefill_chunks is not None:
        return None
    return grp


def graph_layer(layer: torch.nn.Module) -> TypeGuard[DecoderLayer]:
    """Whether ``layer``'s own class declares that the graph replays it (``DECODE_GRAPH`` in the
    class body: a subclass, which may change what forward does, must say so itself; MoE's does not)."""
    from pagellm.models.decoder import DecoderLayer

    return isinstance(layer, DecoderLayer) and bool(type(layer).__dict__.get("DECODE_GRAPH", False))


def capture(model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata) -> DecodeGraph | None:
    """The graph of ``model``'s layers over these caches, or ``None`` where it does not apply
    (see the module's docstring; every condition is checked here, once)."""
    from pagellm.attention.cpu_paged import CpuPagedAttention

    backend = meta.backend
    if not decode_graph.enabled() or not isinstance(backend, CpuPagedAttention) \
            or not (backend.decode_kernel and backend.write_kv_kernel):
        return None
    if not (model.pp.is_first and model.pp.is_last) or model.embed_tokens.tp.world_size != 1 \
            or model.embed_tokens.weight.dtype != torch.float32:
        return None  # (a tensor-parallel layer all-reduces between the kernels)
    layers = [la for la in model.layers if graph_layer(la)]
    if not kv_caches or len(kv_caches) != len(layers) or len(layers) != len(model.layers):
        return None
    key_cache = kv_caches[0][0]
    decode_fn = decode_kernel_address(key_cache)
    write_kv_fn = cpu_ops.write_kv_address(key_cache)
    if decode_fn is None or write_kv_fn is None:
        return None
    first = layers[0]
    attn, mlp = first.self_attn, first.mlp
    hidden, d = model.hidden_size, attn.head_dim
    inter = mlp.down_proj.in_features
    eps = first.input_layernorm.eps
    rope_keys = tuple(model.rotary_tables)
    if any(emb.head_dim != d for emb in model.rotary_tables.values()):
        return None  # (partial rotary: the layer rotates part of each head, off the kernel)
    rows: list[list[int]] = []
    keep: list[torch.Tensor] = []
    for i, layer in enumerate(layers):
        row = _layer_row(layer, attn, hidden, d, inter, eps, rope_keys, keep)
        if row is None:
            return None
        row[decode_graph.LAYER_FIELDS.index("kv_group")] = meta.layer_group[i] if meta.layer_group else 0
        rows.append(row)
    gemms = gemm.kernel_addresses()
    gemms["int8"] = gemm_int8.kernel_address() if gemm_int8.supported() else 0
    fns = [gemms.get(n.removeprefix("gemm_"), 0) for n in decode_graph.FNS if n.startswith("gemm_")]
    fns += [cpu_ops.address("rms_norm_f32"), cpu_ops.address("rotary_f32"), cpu_ops.address("silu_and_mul_f32"),
            write_kv_fn, decode_fn, cpu_ops.address("rms_norm_heads_f32"), cpu_ops.address("gelu_tanh_and_mul_f32"),
            decode_kernel_address(key_cache, windowed=True) or 0]
    try:
        graph = DecodeGraph(
            fns=torch.tensor(fns, dtype=torch.int64),
            dims=torch.tensor([hidden, attn.num_heads, attn.num_kv_heads, d, inter, meta.block_size,
                               element_type(key_cache.dtype), len(rope_keys)], dtype=torch.int64),
            layers=torch.tensor(rows, dtype=torch.int64), eps=eps, scale=attn.scale, keep=keep,
            cache_dtype=key_cache.dtype, cache_shape=tuple(key_cache.shape), rope_keys=rope_keys)
        graph.bind_caches(kv_caches)
    except ValueError:  # a kernel it needs is missing, or caches of mixed types or shapes
        return None
    return graph


def _layer_row(layer, first_attn, hidden: int, d: int, inter: int, eps: float, rope_keys: tuple[str | None, ...],
               keep: list[torch.Tensor]) -> list[int] | None:
    """One layer's row of the table, or ``None`` if some op of it is not the kernel the graph calls
    (or its shapes are not the first layer's)."""
    from pagellm.layers.activation import GeluTanhAndMul, SiluAndMul

    activations = (SiluAndMul, GeluTanhAndMul)  # (decode_graph.ACTIVATIONS' order)
    a, m = layer.self_attn, layer.mlp
    norms = {slot: getattr(layer, name) for slot, name in type(layer).GRAPH_NORMS.items()}
    if a.q_norm is not None and a.k_norm is not None:
        norms |= {"q_norm": a.q_norm, "k_norm": a.k_norm}
    elif a.q_norm is not None or a.k_norm is not None:
        return None
    if not a.rotary.use_kernel or type(m.act_fn) not in activations or not m.act_fn.use_kernel \
            or any(not n.use_kernel or n.eps != eps or n.weight.dtype != torch.float32 for n in norms.values()) \
            or (a.num_heads, a.num_kv_heads, a.head_dim, a.scale) != (first_attn.num_heads, first_attn.num_kv_heads,
                                                                      d, first_attn.scale):
        return None
    projections = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
    shapes = [((a.num_heads + 2 * a.num_kv_heads) * d, hidden), (hidden, a.num_heads * d), (2 * inter, hidden),
              (hidden, inter)]
    row = [0] * len(decode_graph.LAYER_FIELDS)
    for p, (n, k), name in zip(projections, shapes, decode_graph.PROJECTIONS, strict=True):
        fields = p.gemm_descriptor()
        if fields is None or (p.out_features, p.in_features) != (n, k):
            return None
        at = decode_graph.LAYER_FIELDS.index(f"{name}_kind")
        row[at:at + len(decode_graph.W_FIELDS)] = fields
    for name, norm in norms.items():
        w = norm.weight.detach().contiguous()
        keep.append(w)
        row[decode_graph.LAYER_FIELDS.index(name)] = w.data_ptr()
    row[decode_graph.LAYER_FIELDS.index("rope")] = rope_keys.index(a.rope_key)
    row[decode_graph.LAYER_FIELDS.index("window")] = a.sliding_window or 0
    softcap = struct.unpack("<i", struct.pack("<f", a.logit_softcap or 0.0))[0]
    row[decode_graph.LAYER_FIELDS.index("softcap")] = softcap
    row[decode_graph.LAYER_FIELDS.index("act")] = activations.index(type(m.act_fn))
    return row


class DecodeGraphCapture:
    """One model's decode graph, owned by the runner that runs the model: captured at the first
    decode-only step (the caches and kernels are known by then), rebound to the caches and handed
    to the model's forward at every later one; ``None`` where it does not apply."""

    def __init__(self, model: torch.nn.Module) -> None:
        inner = getattr(model, "model", None)  # the DecoderModel inside a causal LM
        from pagellm.models.decoder import DecoderModel

        self._model = inner if isinstance(inner, DecoderModel) else None
        self.graph: DecodeGraph | None = None
        self.captured = self._model is None

    def for_step(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata) -> DecodeGraph | None:
        """The graph bound to these caches if this step (all decodes) can take it."""
        if decode_group(meta) is None:
            return None
        if not self.captured:
            self.captured = True
            assert self._model is not None
            self.graph = capture(self._model, kv_caches, meta)
        graph = self.graph
        if graph is None or meta.block_size != graph.block_size:
            return None
        graph.bind_caches(kv_caches)
        return graph

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor | None:
        """The model's final hidden states for this step through the graph, or ``None``: the step
        does not take it (the caller runs the model's forward)."""
        graph = self.for_step(kv_caches, meta)
        if graph is None:
            return None
        model, group = self._model, decode_group(meta)
        assert model is not None and group is not None and group.kv_blocks is not None \
            and group.seq_lens is not None  # (for_step checked)
        x = model.embed(input_ids)
        t = x.shape[0]
        ropes = model.rope_tables(positions, x.dtype)
        # The tables stacked in the graph's order (each layer reads its own by index).
        cos, sin = (torch.stack([ropes[k][i].view(t, -1) for k in graph.rope_keys]) for i in (0, 1))
        slots, tables = (meta.slot_mapping, group.kv_blocks) if meta.group_tables is None \
            else (meta.group_slots, meta.group_tables)
        assert slots is not None  # (a step with group tables has their slots)
        x, residual = graph.run(x, cos, sin, slots, tables, group.seq_lens)
        x, _ = model.norm(x, residual)
        return x

    def disable(self) -> None:
        """From now on every step runs layer by layer (tests compare the two paths)."""
        self.graph, self.captured = None, True
