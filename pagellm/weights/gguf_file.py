"""GGUF files: config from metadata, tensors dequantized and renamed to Hugging Face names.

llama.cpp's converter permutes the rows of Llama's q/k projections (interleaved rotary layout);
``_reverse_permute`` undoes it so the weights fit HF's rotate-half rotary.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from pagellm.quantization.gguf_quant import GGUFBlocks
from pagellm.weights import gguf_hybrid

_FLOAT_TYPES = (T.F32, T.F16, T.BF16)
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
    # Mixture of experts: the router, Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# A layer's experts stacked in one 3-D tensor [experts, out, in]: each expert's slice under its own name.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Gemma's four norms per layer: llama.cpp's ffn_norm is the norm before the MLP there.
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's fused projections: llama.cpp's ffn_up holds gate and up, as HF's gate_up_proj does.
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# ``blk.N.<kind>[.weight|.bias]``: a kind may be dotted (LFM2's ``shortconv.conv``) or bare (``ssm_a``).
_BLK = re.compile(r"^blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?$")


@dataclass(slots=True)
class GGUFTensor:
    """One tensor of a GGUF file, as ``gguf.ReaderTensor`` has it: ``shape`` as stored (innermost
    first), ``data`` a read-only view of the file (bytes per row for block-quantized types)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(slots=True)
class GGUFIndex:
    """A GGUF file's metadata (``fields``: plain Python values; arrays as lists or numpy arrays)
    and its tensors, read straight from the header.

    ``gguf.GGUFReader`` builds a numpy view for every part of every metadata value: SmolLM2's
    ~98,000 tokenizer strings cost it 2.4 s of start-up on a 2.6 GHz EPYC, this ~0.1 s. Files
    it does not expect (big-endian, an unknown value type) go to ``gguf.GGUFReader``."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]


_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class _Unsupported(ValueError):
    pass


def _strings(buf: memoryview, at: int, n: int) -> tuple[list[str], int]:
    """``n`` length-prefixed strings from ``at``, and the offset after them: a tokenizer's vocabulary
    in one tight loop (262,144 strings for Gemma 3: 0.88 s one call each, 0.15 s here)."""
    out, length = [], _U64.unpack_from
    for _ in range(n):
        (k,) = length(buf, at)
        out.append(str(buf[at + 8:at + 8 + k], "utf-8", "replace"))
        at += 8 + k
    return out, at


def _tensor_views(mm: np.ndarray, infos: list[tuple[str, tuple[int, ...], Any, int]], start: int) -> list[GGUFTensor]:
    """Each tensor as a view of the file: an array of its type, or (block-quantized) bytes per row."""
    import gguf

    q = gguf.GGMLQuantizationType
    plain = {q.F32: np.float32, q.F16: np.float16, q.F64: np.float64, q.I8: np.int8, q.I16: np.int16,
             q.I32: np.int32, q.I64: np.int64}
    tensors = []
    for name, dims, ttype, rel in infos:
        np_dims = tuple(reversed(dims))
        if ttype not in gguf.GGML_QUANT_SIZES:
            raise _Unsupported(f"GGUF tensor type {ttype.name}")
        block, type_size = gguf.GGML_QUANT_SIZES[ttype]
        nbytes = math.prod(dims) * type_size // block
        raw = mm[start + rel:start + rel + nbytes]
        if ttype in plain:
            data = raw.view(plain[ttype]).reshape(np_dims)
        else:  # blocks: bytes per row, as gguf.dequantize takes them
            data = raw.reshape(gguf.quant_shape_to_byte_shape(np_dims, ttype))
        tensors.append(GGUFTensor(name, ttype, tuple(dims), data))
    return tensors


def _parse_header(mm: np.ndarray) -> GGUFIndex:
    import gguf

    buf = memoryview(mm)  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs do not say so
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (bad magic)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise _Unsupported(f"GGUF version {version}")  # also a big-endian file's byte-swapped version
    offs = 24

    def string() -> str:
        nonlocal offs
        (n,) = struct.unpack_from("<Q", buf, offs)
        offs += 8 + n
        return bytes(buf[offs - n:offs]).decode("utf-8", errors="replace")

    def value(vtype: int) -> Any:
        nonlocal offs
        if vtype == _STRING:
            return string()
        if vtype == _ARRAY:
            etype, n = struct.unpack_from("<IQ", buf, offs)
            offs += 12
            if etype in _SCALARS:
                dt = np.dtype(_SCALARS[etype])
                arr = np.frombuffer(buf, dtype=dt, count=n, offset=offs)
                offs += n * dt.itemsize
                return arr
            if etype == _STRING:
                out, offs = _strings(buf, offs, n)
                return out
            return [value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise _Unsupported(f"GGUF value type {vtype}")
        dt = np.dtype(_SCALARS[vtype])
        v = np.frombuffer(buf, dtype=dt, count=1, offset=offs)[0].item()
        offs += dt.itemsize
        return v

    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, offs)
        offs += 4
        fields[key] = value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, offs)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, offs + 4)
        ttype, rel = struct.unpack_from("<IQ", buf, offs + 4 + 8 * n_dims)
        offs += 4 + 8 * n_dims + 12
        infos.append((name, dims, gguf.GGMLQuantizationType(ttype), rel))
    align = int(fields.get("general.alignment", 32))
    start = -(-offs // align) * align
    tensors = _tensor_views(mm, infos, start)
    return GGUFIndex(fields, tensors)


@lru_cache(maxsize=2)
def _reader(path: str) -> GGUFIndex:
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        return _parse_header(mm)
    except (_Unsupported, struct.error):
        import gguf

        r = gguf.GGUFReader(path)
        return GGUFIndex({k: f.contents() for k, f in r.fields.items()},
                         [GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data) for t in r.tensors])


def _field(reader: GGUFIndex, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


@dataclass(frozen=True, slots=True)
class GGUFFamily:
    """One llama.cpp ``general.architecture``: the Hugging Face architecture and ``transformers``
    config class its files load as, and how its tensors and metadata map onto them (what
    llama.cpp's converter renamed, permuted or changed). A new GGUF family is one row of
    ``GGUF_FAMILIES`` (and its model's row in ``models/``' table)."""

    hf_arch: str
    hf_config: str
    layer_names: Mapping[str, str]  # ``blk.N.<kind>`` -> our name under ``model.layers.N``
    config: Callable[[GGUFIndex, str, dict[str, Any]], dict[str, Any]] | None = None  # its own settings
    permute_qk: bool = False  # q/k rows permuted for llama.cpp's interleaved rotary (undone here)
    plus_one_norms: bool = False  # norms stored as 1 + w (Gemma's)
    hybrid: bool = False  # state layers: ``gguf_hybrid``'s config and tensor fix-ups
    with_experts: tuple[str, str] | None = None  # what a file of it with experts loads as (llama: Mixtral)
    needs_experts: bool = False  # a mixture-of-experts family: a file without experts is refused
    norm_topk: bool = True  # its router renormalises the top-k weights (llama.cpp's graph), unless the file says


def gguf_family(arch: str) -> GGUFFamily:
    family = GGUF_FAMILIES.get(arch)
    if family is None:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_FAMILIES)}")
    return family


def gguf_architecture(path: str) -> str:
    arch = _field(_reader(path), "general.architecture")
    gguf_family(arch)
    return arch


# What llama.cpp ends generation on (llama-vocab.cpp): the ids the file names, and the tokens whose
# text marks an end of turn in the families that use them (Llama 3, Qwen/ChatML, Phi-3, Gemma, ...).
_EOG_ID_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
_EOG_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                        "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>"))


def gguf_end_of_generation_ids(path: str) -> list[int]:
    """The token ids that end generation in this GGUF file as llama.cpp derives them: its
    ``tokenizer.ggml.{eos,eot,eom,fim_*}_token_id`` and every token whose text is an end-of-turn
    marker (Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``, ChatML's ``<|im_end|>``, ...)."""
    r = _reader(path)
    ids = {int(v) for k in _EOG_ID_KEYS if (v := _field(r, f"tokenizer.ggml.{k}_token_id")) is not None}
    ids.update(i for i, text in enumerate(_field(r, "tokenizer.ggml.tokens", ())) if text in _EOG_TEXTS)
    return sorted(ids)


def gguf_config(path: str):
    """An HF ``PretrainedConfig`` built from the GGUF metadata."""
    import transformers

    r = _reader(path)
    arch = gguf_architecture(path)
    p = f"{arch}."
    n_heads = int(_field(r, p + "attention.head_count"))
    hidden = int(_field(r, p + "embedding_length"))
    n_tokens = len(r.fields.get("tokenizer.ggml.tokens", ()))
    names = {t.name for t in r.tensors}
    kv_heads = _field(r, p + "attention.head_count_kv", n_heads)  # (per layer in the hybrid families)
    kwargs: dict[str, Any] = dict(
        hidden_size=hidden,
        intermediate_size=int(_field(r, p + "feed_forward_length")),
        num_hidden_layers=int(_field(r, p + "block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(kv_heads) if isinstance(kv_heads, (int, float)) else max(int(k) for k in kv_heads),
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
    family = gguf_family(arch)
    if family.config is not None:
        kwargs.update(family.config(r, arch, kwargs))
    hf_arch, hf_config = family.hf_arch, family.hf_config
    experts = int(_field(r, p + "expert_count", 0) or 0)
    if family.hybrid:
        kwargs.update(gguf_hybrid.hybrid_config(lambda key, default=None: _field(r, p + key, default), arch, kwargs,
                                                names))
    elif experts:
        kwargs.update(_moe_config(r, arch, experts, names, family.norm_topk))
        if family.with_experts is not None:
            hf_arch, hf_config = family.with_experts
    elif family.needs_experts:
        raise ValueError(f"GGUF {arch} file without {p}expert_count")
    config = getattr(transformers, hf_config)(**kwargs)
    config.architectures = [hf_arch]
    return config


def _phi3_config(r: GGUFIndex, arch: str, base: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's rotary as llama.cpp stores it: the rotated features per head, the trained length and,
    for longrope, its short and long factors as tensors; the window of every layer."""
    head_dim, theta = base["head_dim"], base.pop("rope_theta")
    rotated = int(_field(r, "phi3.rope.dimension_count", head_dim))
    original = _field(r, "phi3.rope.scaling.original_context_length")
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rotated / head_dim}
    factors = {t.name: _to_array(t).astype(np.float32).tolist() for t in r.tensors if t.name in _ROPE_TENSORS[1:]}
    if factors:
        params.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                      short_factor=factors["rope_factors_short.weight"],
                      original_max_position_embeddings=int(original or base["max_position_embeddings"]))
    out: dict[str, Any] = {"rope_parameters": params, "sliding_window": _field(r, "phi3.attention.sliding_window")}
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    return out


def _moe_config(r: GGUFIndex, arch: str, experts: int, names: set[str], norm_topk: bool) -> dict[str, Any]:
    """A mixture of experts' settings from llama.cpp's keys; a layer with a dense MLP (its
    ``ffn_gate`` where the others have ``ffn_gate_exps``) is one of HF's ``mlp_only_layers``."""
    p = f"{arch}."
    layers = int(_field(r, p + "block_count"))
    out: dict[str, Any] = {"num_experts_per_tok": int(_field(r, p + "expert_used_count")),
                           "norm_topk_prob": bool(_field(r, p + "expert_weights_norm", norm_topk))}
    if arch == "llama":
        out["num_local_experts"] = experts
        return out
    out["num_experts"] = experts
    out["moe_intermediate_size"] = int(_field(r, p + "expert_feed_forward_length"))
    out["decoder_sparse_step"] = 1
    out["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in names]
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = int(_field(r, p + "expert_shared_feed_forward_length", 0) or 0)
    return out


def _gemma_config(r: GGUFIndex, arch: str, base: dict[str, Any]) -> dict[str, Any]:
    """Gemma's settings as llama.cpp reads them: the window and soft-caps from the metadata; the
    query scale is the head size, except Gemma 2 27B's (46 layers: hidden / heads), which llama.cpp
    infers the same way; Gemma 3's sliding layers are 5 of every 6 with a local rotary base of
    10,000, the global base (and its linear scaling) on the others."""
    p = f"{arch}."
    layers = base["num_hidden_layers"]
    out: dict[str, Any] = {"sliding_window": int(_field(r, p + "attention.sliding_window", 4096)),
                           "query_pre_attn_scalar": base["head_dim"]}
    if arch == "gemma2":
        out["attn_logit_softcapping"] = _field(r, p + "attn_logit_softcapping")
        out["final_logit_softcapping"] = _field(r, p + "final_logit_softcapping")
        if layers == 46:
            out["query_pre_attn_scalar"] = base["hidden_size"] // base["num_attention_heads"]
        out["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    else:
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": base.pop("rope_theta")}
        if "rope_scaling" in base:
            full = {**full, **base.pop("rope_scaling")}
        out["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": full}
        out["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    return out


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _to_array(t) -> np.ndarray:
    import gguf

    shape = tuple(int(x) for x in reversed(t.shape))
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(t.data).reshape(shape)
    return gguf.dequantize(t.data, t.tensor_type).reshape(shape)


def _experts(t: GGUFTensor, layer: int, part: str,
             keep_blocks: bool) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """One layer's stacked experts (``[experts, out, in]``), each expert's matrix under its HF name:
    for a block-quantized type its rows of the file's blocks (a view: nothing is read until the
    expert is loaded, dequantized then unless ``keep_blocks``), else a float32 copy of its slice."""
    experts, out_features, in_features = (int(x) for x in reversed(t.shape))
    whole = _to_array(t) if t.tensor_type in _FLOAT_TYPES else None
    for e in range(experts):
        name = f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"
        if whole is not None:
            yield name, torch.from_numpy(np.array(whole[e], dtype=np.float32))
            continue
        blocks = GGUFBlocks(t.data.reshape(experts, out_features, -1)[e], t.tensor_type, (out_features, in_features))
        yield name, blocks if keep_blocks else blocks.dequantize()


def _layer_name(names: Mapping[str, str], layer: int, kind: str, suffix: str | None) -> str | None:
    """Our name of ``blk.<layer>.<kind>[.<suffix>]`` by ``names`` (a kind with its suffix first: the
    hybrid families' ``ssm_dt.bias``), or ``None`` where it has no such tensor."""
    full = names.get(f"{kind}.{suffix}") if suffix else None
    if full is not None:
        return f"model.layers.{layer}.{full}"
    stem = names.get(kind)
    if stem is None:
        return None
    return f"model.layers.{layer}.{stem}" + (f".{suffix}" if suffix else "")


def rope_freq_factors(path: str) -> torch.Tensor | None:
    for t in _reader(path).tensors:
        if t.name == "rope_freqs.weight":
            return torch.from_numpy(_to_array(t).astype(np.float32))
    return None


def iter_gguf_weights(path: str, config: Any,
                      keep_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Every tensor under its Hugging Face name, dequantized to float32; with ``keep_blocks``, a
    quantized matrix comes as its file's bytes (``GGUFBlocks``: packed for the int8 kernel if it
    takes the type, else dequantized once the numerics are chosen, and named in their log line)."""
    r = _reader(path)
    arch = gguf_architecture(path)
    family = gguf_family(arch)
    hybrid, permute, layer_names = family.hybrid, family.permute_qk, family.layer_names
    global_names = {**_GLOBAL_NAMES, **gguf_hybrid.GLOBAL_NAMES.get(arch, {})}
    for t in r.tensors:
        if t.name in _ROPE_TENSORS:  # (read with the config: rope_freq_factors, Phi-3's longrope factors)
            continue
        m = _BLK.match(t.name)
        if m and m.group(2) in _EXPERT_NAMES:
            yield from _experts(t, int(m.group(1)), _EXPERT_NAMES[m.group(2)], keep_blocks)
            continue
        arr: np.ndarray | GGUFBlocks
        if keep_blocks and t.tensor_type not in _FLOAT_TYPES and len(t.shape) == 2:
            arr = GGUFBlocks(t.data, t.tensor_type, (int(t.shape[1]), int(t.shape[0])))
        else:
            arr = _to_array(t)
        if m:
            layer, kind, suffix = m.groups()
            # (a kind without .weight / .bias: the hybrid families' ssm_a and ssm_d only)
            found = _layer_name(layer_names, int(layer), kind, suffix) if hybrid or suffix else None
            if found is None:
                raise ValueError(f"unexpected GGUF tensor {t.name!r}")
            name = found
            if permute and kind in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
                if isinstance(arr, GGUFBlocks):  # the same rows, in the same order: a row is its blocks
                    arr = arr.rows(_reverse_permute(np.arange(arr.shape[0]), heads))
                else:
                    arr = _reverse_permute(arr, heads)
        else:
            base, _, suffix = t.name.rpartition(".")
            if base not in global_names:
                raise ValueError(f"unexpected GGUF tensor {t.name!r}")
            name = f"{global_names[base]}.{suffix}"
            kind = base
        if isinstance(arr, GGUFBlocks):
            yield name, arr
        elif name.endswith(".shared_expert_gate.weight"):  # [hidden] in the file, HF's [1, hidden]
            yield name, torch.from_numpy(np.array(arr, dtype=np.float32).reshape(1, -1))
        elif (family.plus_one_norms and name.endswith("norm.weight")) or gguf_hybrid.centred_norm(arch, kind):
            # llama.cpp stores Gemma's norms (and Qwen3.5's zero-centred ones) as 1 + w; the model
            # adds its 1 to the checkpoint's w (as transformers' GGUF loader gives them back: exact
            # for 1 + w >= 0.5).
            yield name, torch.from_numpy(np.array(arr, dtype=np.float32) - np.float32(1.0))
        else:
            if hybrid:
                arr = gguf_hybrid.float_values(arch, kind, arr)
            yield name, torch.from_numpy(np.array(arr, dtype=np.float32))  # a writable copy
    del r
    _reader.cache_clear()  # the file's mapping goes once the last kept view of it is packed (or with the
    # embedding, where that keeps its blocks)


def _hybrid(hf_arch: str, hf_config: str, arch: str) -> GGUFFamily:
    return GGUFFamily(hf_arch, hf_config, {**_LAYER_NAMES, **gguf_hybrid.LAYER_NAMES[arch]},
                      permute_qk=gguf_hybrid.permutes_qk(arch), hybrid=True)


GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("LlamaForCausalLM", "LlamaConfig", _LAYER_NAMES, permute_qk=True,
                        with_experts=("MixtralForCausalLM", "MixtralConfig")),  # (llama.cpp writes Mixtral so)
    "phi3": GGUFFamily("Phi3ForCausalLM", "Phi3Config", _PHI3_LAYER_NAMES, _phi3_config),
    "qwen2": GGUFFamily("Qwen2ForCausalLM", "Qwen2Config", _LAYER_NAMES),
    "qwen3": GGUFFamily("Qwen3ForCausalLM", "Qwen3Config", _LAYER_NAMES),
    "gemma2": GGUFFamily("Gemma2ForCausalLM", "Gemma2Config", _GEMMA_LAYER_NAMES, _gemma_config, plus_one_norms=True),
    "gemma3": GGUFFamily("Gemma3ForCausalLM", "Gemma3TextConfig", _GEMMA_LAYER_NAMES, _gemma_config,
                         plus_one_norms=True),
    "qwen2moe": GGUFFamily("Qwen2MoeForCausalLM", "Qwen2MoeConfig", _LAYER_NAMES, needs_experts=True,
                           norm_topk=False),
    "qwen3moe": GGUFFamily("Qwen3MoeForCausalLM", "Qwen3MoeConfig", _LAYER_NAMES, needs_experts=True),
    "lfm2": _hybrid("Lfm2ForCausalLM", "Lfm2Config", "lfm2"),
    "qwen35": _hybrid("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", "qwen35"),
    "qwen35moe": _hybrid("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", "qwen35moe"),
    "granitehybrid": _hybrid("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", "granitehybrid"),
}
