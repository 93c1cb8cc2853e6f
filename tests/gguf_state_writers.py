"""GGUF files of the state-layer families, written from tiny HF checkpoints as llama.cpp's converter
writes them (its ``conversion/lfm2.py``, ``qwen.py``'s Qwen3.5 classes, ``granite.py``'s
``GraniteHybridModel``, at llama-cpp-python 0.3.36): its tensor names, its changes to the values
(Qwen3.5's norms as ``1 + w``, ``-exp(A_log)``, the DeltaNet's value heads tiled, Granite's q/k rows
permuted for interleaved rotary, Mamba2's reshaped ``A`` / ``D`` / norm, Granite's experts split
into gate and up) and the metadata its readers take. These files were checked tensor for tensor
against that converter's output on the same checkpoints (float32 tensors)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file

from pagellm.weights.gguf_write import _copy_tokenizer

ARCH = {"lfm2": "lfm2", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "granitemoehybrid": "granitehybrid"}
_COMMON = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
_NAMES = {
    "lfm2": {**_COMMON, "operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "self_attn.out_proj": "attn_output",
             "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
             "feed_forward.w1": "ffn_gate", "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down",
             "conv.conv": "shortconv.conv", "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj"},
    "qwen35": {**_COMMON, "post_attention_layernorm": "post_attention_norm",
               "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
               "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
               "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
               "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp"},
    "granitehybrid": {**_COMMON, "post_attention_layernorm": "ffn_norm", "mamba.in_proj": "ssm_in",
                      "mamba.conv1d": "ssm_conv1d", "mamba.norm": "ssm_norm", "mamba.out_proj": "ssm_out",
                      "block_sparse_moe.router.layer": "ffn_gate_inp", "shared_mlp.output_linear": "ffn_down_shexp"},
}
_NAMES["qwen35moe"] = _NAMES["qwen35"]
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "model.embedding_norm.weight": "token_embd_norm.weight", "lm_head.weight": "output.weight"}


def _tile_rows(x: np.ndarray, k_heads: int, v_heads: int, head: int, axis: int = 0) -> np.ndarray:
    """Value heads grouped by key head -> tiled along ``axis`` (the converter's ``_reorder_v_heads``)."""
    x = np.moveaxis(x, axis, 0)
    shape = x.shape
    x = x.reshape(k_heads, v_heads // k_heads, head, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(x, 0, axis))


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation for interleaved rotary (``LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(w: gguf.GGUFWriter, arch: str, c: dict) -> None:
    layers = c["num_hidden_layers"]
    w.add_block_count(layers)
    # (NoPE Granite hybrids: the converter writes 2**20 as their context)
    w.add_context_length(2 ** 20 if arch == "granitehybrid" else c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_layer_norm_rms_eps(c.get("norm_eps", c.get("rms_norm_eps")))
    if arch in ("lfm2", "granitehybrid"):
        w.add_vocab_size(c["vocab_size"])
    rope = c.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    if arch == "lfm2":
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count_kv([c["num_key_value_heads"] if t != "conv" else 0 for t in c["layer_types"]])
        w.add_shortconv_l_cache(c["conv_L_cache"])
    elif arch in ("qwen35", "qwen35moe"):
        hd = c["head_dim"]
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
        w.add_ssm_state_size(c["linear_key_head_dim"])
        w.add_ssm_group_count(c["linear_num_key_heads"])
        w.add_ssm_time_step_rank(c["linear_num_value_heads"])
        w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
        # (gguf 0.19 has no add_recurrent_layers: the key the converter's newer gguf-py writes)
        w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in c["layer_types"]])
        w.add_full_attention_interval(c.get("full_attention_interval", 4))
        w.add_rope_dimension_count(int(hd * rope.get("partial_rotary_factor", 0.25)))
        w.add_rope_dimension_sections([11, 11, 10, 0])
        if arch == "qwen35moe":
            w.add_expert_count(c["num_experts"])
            w.add_expert_used_count(c["num_experts_per_tok"])
            w.add_expert_feed_forward_length(c["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    else:
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count_kv([c["num_key_value_heads"] if t == "full_attention" else 0 for t in c["layer_types"]])
        if c.get("num_local_experts"):
            w.add_expert_count(c["num_local_experts"])
            w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_attention_scale(c["attention_multiplier"])
        w.add_embedding_scale(c["embedding_multiplier"])
        w.add_residual_scale(c["residual_multiplier"])
        w.add_logit_scale(c["logits_scaling"])
        w.add_expert_shared_feed_forward_length(c["shared_intermediate_size"])
        w.add_ssm_conv_kernel(c["mamba_d_conv"])
        w.add_ssm_state_size(c["mamba_d_state"])
        w.add_ssm_group_count(c["mamba_n_groups"])
        w.add_ssm_inner_size(c["mamba_expand"] * c["hidden_size"])
        w.add_ssm_time_step_rank(c["mamba_n_heads"])
        w.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
        w.add_rope_scaling_finetuned(False)


def _tensors(arch: str, c: dict, hf: dict[str, np.ndarray]):
    """``(gguf name, float32 array in the file's layout)`` for each of the checkpoint's tensors."""
    names = _NAMES[arch]
    qwen35 = arch in ("qwen35", "qwen35moe")
    if qwen35:
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        kd, vd = c["linear_key_head_dim"], c["linear_value_head_dim"]
        tile = (lambda x, head, axis=0: _tile_rows(x, hk, hv, head, axis)) if hk != hv else (lambda x, h, a=0: x)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in hf.items():
        t = t.astype(np.float32)
        if name in _GLOBAL:
            yield _GLOBAL[name], (t + np.float32(1.0)) if qwen35 and name == "model.norm.weight" else t
            continue
        _, _, layer, rest = name.split(".", 3)
        stem, _, suffix = rest.rpartition(".")
        blk = f"blk.{layer}."
        if qwen35 and stem.startswith("mlp.experts."):  # (one expert's matrix: stacked, [E, out, in])
            _, _, e, part = stem.split(".")
            experts.setdefault((layer, part), {})[int(e)] = t
            continue
        if arch == "granitehybrid" and rest.endswith("input_linear.weight"):  # (experts' and the shared MLP's)
            gate, up = np.split(t, 2, axis=-2)
            kind = "exps" if rest.startswith("block") else "shexp"
            yield blk + f"ffn_gate_{kind}.weight", gate
            yield blk + f"ffn_up_{kind}.weight", up
            continue
        if rest == "block_sparse_moe.output_linear.weight":
            yield blk + "ffn_down_exps.weight", t
            continue
        if rest.endswith("A_log"):
            a = -torch.exp(torch.from_numpy(t)).numpy()  # (torch's exp, as the converter's: its bits)
            if qwen35:
                yield blk + "ssm_a", tile(a[:, None], 1)[:, 0]
            else:
                yield blk + "ssm_a", a[:, None]
            continue
        if rest.endswith("dt_bias"):
            yield blk + "ssm_dt.bias", tile(t[:, None], 1)[:, 0] if qwen35 else t
            continue
        if rest == "mamba.D":
            yield blk + "ssm_d", t[:, None]
            continue
        if stem.endswith("conv1d") or stem == "conv.conv":
            if suffix == "weight":
                t = t.reshape(t.shape[0], -1)
            if qwen35:
                qk = 2 * hk * kd
                t = np.concatenate([t[:qk], tile(t[qk:], vd)])
        elif qwen35 and stem == "linear_attn.in_proj_qkv":
            qk = 2 * hk * kd
            t = np.concatenate([t[:qk], tile(t[qk:], vd)])
        elif qwen35 and stem == "linear_attn.in_proj_z":
            t = tile(t, vd)
        elif qwen35 and stem in ("linear_attn.in_proj_b", "linear_attn.in_proj_a"):
            t = tile(t, 1)
        elif qwen35 and stem == "linear_attn.out_proj":
            t = tile(t, vd, axis=1)
        elif qwen35 and stem.endswith(("layernorm", "q_norm", "k_norm")):
            t = t + np.float32(1.0)
        elif arch == "granitehybrid" and stem == "mamba.norm":
            t = t.reshape(c["mamba_n_groups"], -1)
        elif arch == "granitehybrid" and stem == "self_attn.q_proj":
            t = _permute(t, c["num_attention_heads"])
        elif arch == "granitehybrid" and stem == "self_attn.k_proj":
            t = _permute(t, c["num_key_value_heads"])
        yield blk + f"{names[stem]}.{suffix}", t
    for (layer, part), mats in experts.items():
        yield f"blk.{layer}.ffn_{part.removesuffix('_proj')}_exps.weight", np.stack([mats[e] for e in sorted(mats)])


def write_state_gguf(hf_dir: str, path: str, tokenizer_from: str,
                     quantize: Callable[[str], T | None] = lambda name: None) -> dict[str, np.ndarray]:
    """Write ``hf_dir``'s checkpoint to ``path`` as llama.cpp does; a 2-D tensor that
    ``quantize(gguf name)`` names a type for is stored in it (by ``gguf.quantize``). Returns each
    tensor's values as the file holds them (dequantized by ``gguf``), in the file's layout."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    arch = ARCH[c["model_type"]]
    w = gguf.GGUFWriter(path, arch)
    _metadata(w, arch, c)
    _copy_tokenizer(w, tokenizer_from)
    held = {}
    for name, t in _tensors(arch, c, load_file(os.path.join(hf_dir, "model.safetensors"))):
        qtype = quantize(name) if t.ndim == 2 else None
        if qtype is None:
            w.add_tensor(name, t)
            held[name] = t
        else:
            q = gguf.quantize(t, qtype)
            w.add_tensor(name, q, raw_dtype=qtype)
            held[name] = gguf.dequantize(q, qtype).reshape(t.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    return held
