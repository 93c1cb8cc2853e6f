"""GGUF files of the families with state layers, as llama.cpp's converter writes them: ``lfm2``
(short convolutions), ``qwen35`` / ``qwen35moe`` (gated DeltaNet) and ``granitehybrid`` (Mamba2).

Their configs come from the metadata (which layers are recurrent: ``attention.head_count_kv`` 0 or
``attention.recurrent_layers``), their tensors back under the names our models load, in Hugging
Face's values where the converter changed them:
- Qwen3.5's zero-centred norms are stored as ``1 + w`` (given back as ``w``, as Gemma's), and its
  DeltaNet value heads tiled instead of grouped by key head (``_reorder_v_heads``): every tensor's
  rows move alike, so the model reads them in that order (``linear_value_heads_tiled``) instead of
  permuting blocks back: a block-quantized ``ssm_out`` cannot have its columns reordered.
- ``ssm_a`` is ``-exp(A_log)``, what the models keep (``A``); Mamba2's ``ssm_a`` / ``ssm_d`` /
  ``ssm_norm`` are reshaped (``[H, 1]``, ``[G, I / G]``) and flattened back here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_DELTANET = {"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
             "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
             "ssm_conv1d": "linear_attn.conv1d", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A",
             "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
             "post_attention_norm": "post_attention_layernorm"}
_MAMBA2 = {"ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_dt.bias": "mamba.dt_bias",
           "ssm_a": "mamba.A", "ssm_d": "mamba.D", "ssm_norm": "mamba.norm", "ssm_out": "mamba.out_proj"}
# A GGUF tensor's kind (``blk.N.<kind>[.weight|.bias]``; a kind with its suffix first) -> our name,
# over the decoders' table (``gguf_file._LAYER_NAMES``: attention, MLP, router, Qwen's shared expert).
LAYER_NAMES: dict[str, dict[str, str]] = {
    "lfm2": {"shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj"},
    "qwen35": _DELTANET,
    "qwen35moe": _DELTANET,
    # Granite's shared MLP (with experts: the ``_shexp`` tensors; a dense hybrid's is its ``ffn_*``).
    "granitehybrid": {**_MAMBA2, "ffn_gate_shexp": "shared_mlp.gate_proj", "ffn_up_shexp": "shared_mlp.up_proj",
                      "ffn_down_shexp": "shared_mlp.down_proj", "ffn_gate": "shared_mlp.gate_proj",
                      "ffn_up": "shared_mlp.up_proj", "ffn_down": "shared_mlp.down_proj"},
}
GLOBAL_NAMES = {"lfm2": {"token_embd_norm": "model.norm"}}  # (LFM2's final norm: its ``embedding_norm``)
# Norms llama.cpp stores as ``1 + w`` (Qwen3.5's zero-centred ones; not the DeltaNet's gated norm).
_CENTRED = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")


def centred_norm(arch: str, kind: str) -> bool:
    """Whether llama.cpp stores this norm as ``1 + w`` (Qwen3.5's zero-centred ones)."""
    return arch in ("qwen35", "qwen35moe") and kind in _CENTRED


def float_values(arch: str, kind: str, arr: np.ndarray) -> np.ndarray:
    """A float tensor's values in the shape our model loads (Mamba2's ``[H, 1]`` / ``[G, I / G]`` flat)."""
    if arch == "granitehybrid" and kind in ("ssm_a", "ssm_d", "ssm_norm"):
        return np.asarray(arr).reshape(-1)
    return arr


def permutes_qk(arch: str) -> bool:
    """Whether the converter permuted q/k rows for llama.cpp's interleaved rotary (Granite's
    ``undo_permute``, inherited from its Llama converter; harmless under NoPE, undone anyway)."""
    return arch == "granitehybrid"


def _per_layer(value: Any, layers: int) -> list[int]:
    if isinstance(value, (int, float)):
        return [int(value)] * layers
    return [int(v) for v in value]


def hybrid_config(field, arch: str, base: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The family's config keys from llama.cpp's: ``field(key, default)`` reads ``<arch>.<key>``."""
    layers = base["num_hidden_layers"]
    kv = _per_layer(field("attention.head_count_kv", base["num_attention_heads"]), layers)
    out: dict[str, Any] = {}
    if arch == "lfm2":
        out.update(layer_types=["conv" if n == 0 else "full_attention" for n in kv],
                   conv_L_cache=int(field("shortconv.l_cache")), norm_eps=base["rms_norm_eps"],
                   block_auto_adjust_ff_dim=False,
                   conv_bias=any(n.startswith("blk.") and ".shortconv." in n and n.endswith(".bias") for n in names))
    elif arch in ("qwen35", "qwen35moe"):
        out.update(_qwen35_config(field, base, layers))
    else:
        out.update(_granite_config(field, base, kv, names))
    return out


def _qwen35_config(field, base: dict[str, Any], layers: int) -> dict[str, Any]:
    k_heads, v_heads = int(field("ssm.group_count")), int(field("ssm.time_step_rank"))
    recurrent = field("attention.recurrent_layers")
    if recurrent is None:  # (older files: every full_attention_interval-th layer is attention)
        every = int(field("full_attention_interval", 4))
        recurrent = [(i + 1) % every != 0 for i in range(layers)]
    rotated = int(field("rope.dimension_count", base["head_dim"]))
    out: dict[str, Any] = {
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
        "linear_num_key_heads": k_heads, "linear_num_value_heads": v_heads,
        "linear_key_head_dim": int(field("ssm.state_size")),
        "linear_value_head_dim": int(field("ssm.inner_size")) // v_heads,
        "linear_conv_kernel_dim": int(field("ssm.conv_kernel")),
        "linear_value_heads_tiled": v_heads != k_heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": base.pop("rope_theta"),
                            "partial_rotary_factor": rotated / base["head_dim"]},
    }
    experts = int(field("expert_count", 0) or 0)
    if experts:
        out.update(num_experts=experts, num_experts_per_tok=int(field("expert_used_count")),
                   moe_intermediate_size=int(field("expert_feed_forward_length")),
                   shared_expert_intermediate_size=int(field("expert_shared_feed_forward_length", 0) or 0))
    return out


def _granite_config(field, base: dict[str, Any], kv: list[int], names: set[str]) -> dict[str, Any]:
    heads, inner = int(field("ssm.time_step_rank")), int(field("ssm.inner_size"))
    ffn = int(field("feed_forward_length"))
    return {
        "layer_types": ["mamba" if n == 0 else "attention" for n in kv],
        "num_local_experts": int(field("expert_count", 0) or 0),
        "num_experts_per_tok": int(field("expert_used_count", 0) or 0),
        "intermediate_size": ffn,
        "shared_intermediate_size": int(field("expert_shared_feed_forward_length", ffn) or ffn),
        "attention_multiplier": float(field("attention.scale", 1.0 / base["head_dim"] ** 0.5)),
        "embedding_multiplier": float(field("embedding_scale", 1.0)),
        "residual_multiplier": float(field("residual_scale", 1.0)),
        "logits_scaling": float(field("logit_scale", 1.0)),
        "mamba_n_heads": heads, "mamba_d_head": inner // heads, "mamba_expand": inner // base["hidden_size"],
        "mamba_d_state": int(field("ssm.state_size")), "mamba_n_groups": int(field("ssm.group_count")),
        "mamba_d_conv": int(field("ssm.conv_kernel")),
        "mamba_conv_bias": any(n.endswith(".ssm_conv1d.bias") for n in names),
        "mamba_proj_bias": any(n.endswith(".ssm_in.bias") for n in names),
        # (the converter's sign of rotary: Bamba's, and non-hybrid files'; Granite 4's hybrids are NoPE)
        "position_embedding_type": "rope" if field("rope.scaling.finetuned", False) else "nope",
    }
