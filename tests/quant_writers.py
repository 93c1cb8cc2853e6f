"""Quantized HF checkpoints written from float weights for the tests.

compressed-tensors' by the library's own compressor (``write_compressed``, ``compress_one``): its
decompression is the oracle. AWQ and GPTQ checkpoints following each format's published layout
(AutoAWQ's ``WQLinear_GEMM.from_linear``, AutoGPTQ's ``QuantLinear.pack``), written here and not
by pagellm: the tests' oracle is the float64 ``s (q - z)`` of the integers chosen here.

Quantization as those tools round (not their error-minimising search: the layout is what is
tested): per group of inputs a 16-bit scale and an integer zero point, asymmetric from the
group's min and max, or symmetric around ``2^(bits-1)``.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # word nibble i holds output AWQ_PACK_ORDER[i] of its 8
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_columns(x: np.ndarray, bits: int, order: list[int] | None = None) -> np.ndarray:
    """int ``[R, C]`` -> int32 ``[R, C bits / 32]``: field i of each word (from the low bits) holds
    column ``order[i]`` of its run of ``32 / bits`` columns (in order without ``order``)."""
    per = 32 // bits
    runs = np.asarray(x, dtype=np.uint64).reshape(x.shape[0], -1, per)
    if order is not None:
        runs = runs[:, :, order]
    words = sum(runs[:, :, i] << np.uint64(bits * i) for i in range(per))
    return np.asarray(words, dtype=np.uint64).astype(np.uint32).view(np.int32)


def quantize(w: np.ndarray, bits: int, group: int, sym: bool, perm: np.ndarray | None = None):
    """``(q [N, K], s [G, N] float16, z [G, N], g_idx [K])`` for a float ``w [N, K]``: inputs taken in
    ``perm``'s order (act-order) in groups of ``group`` (-1: one group)."""
    n, k = w.shape
    perm = np.arange(k) if perm is None else perm
    g = k if group == -1 else group
    maxq = (1 << bits) - 1
    x = w[:, perm].astype(np.float64).reshape(n, k // g, g)
    if sym:
        s = np.abs(x).max(axis=2) / (maxq // 2)
        z = np.full(s.shape, (maxq + 1) // 2)
    else:
        lo, hi = np.minimum(x.min(axis=2), 0), np.maximum(x.max(axis=2), 0)
        s = (hi - lo) / maxq
    s = np.maximum(s, 1e-6).astype(np.float16)
    if not sym:
        z = np.clip(np.rint(-lo / s.astype(np.float64)), 0, maxq)
    qp = np.clip(np.rint(x / s.astype(np.float64)[..., None]) + z[..., None], 0, maxq).reshape(n, k)
    q = np.empty_like(qp)
    q[:, perm] = qp
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[perm] = np.arange(k) // g
    return q.astype(np.int64), s.T.copy(), z.astype(np.int64).T.copy(), g_idx


def dequantize64(q: np.ndarray, s: np.ndarray, z: np.ndarray, g_idx: np.ndarray) -> np.ndarray:
    """The oracle: ``w[n, k] = s[g(k), n] (q[n, k] - z[g(k), n])`` in float64."""
    return s.astype(np.float64)[g_idx].T * (q - z[g_idx].T)


def awq_tensors(q, s, z) -> dict[str, torch.Tensor]:
    return {"qweight": torch.from_numpy(pack_columns(q.T, 4, AWQ_PACK_ORDER)),
            "qzeros": torch.from_numpy(pack_columns(z, 4, AWQ_PACK_ORDER)),
            "scales": torch.from_numpy(s)}


def gptq_tensors(q, s, z, g_idx, bits: int, v2: bool) -> dict[str, torch.Tensor]:
    return {"qweight": torch.from_numpy(pack_columns(q, bits).T.copy()),
            "qzeros": torch.from_numpy(pack_columns(z - (0 if v2 else 1), bits)),  # (AutoGPTQ stores z - 1)
            "scales": torch.from_numpy(s), "g_idx": torch.from_numpy(g_idx)}


def write_quantized(src: str, dst: str, deq: str, method: str, bits: int = 4, group: int = 32, sym: bool = False,
                    v2: bool = False, act_order: bool | str = False, seed: int = 0) -> None:
    """``src``'s projections quantized into an AWQ or GPTQ checkpoint ``dst``, and the same weights
    dequantized in float64 (stored float32: exact) into a plain checkpoint ``deq`` for HF. Every
    other tensor is stored in float16, as AutoAWQ and AutoGPTQ save them (``deq`` holds the same
    values in float32). ``act_order``: inputs taken in a random order, one per input the
    projections read (GPTQ's comes from that input's Hessian: q, k and v share it, gate and up
    too), or with ``"per-module"`` one per projection."""
    rng = np.random.default_rng(seed)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    packed, dense = {}, {}
    perms: dict[str, np.ndarray] = {}
    reads = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or prefix.rpartition(".")[2] not in PROJECTIONS:
            packed[name] = t.half()
            dense[name] = packed[name].float()
            continue
        w = t.double().numpy()
        layer, _, module = prefix.rsplit(".", 2)  # (model.layers.0, self_attn, q_proj)
        key = prefix if act_order == "per-module" else f"{layer}.{reads.get(module, module)}"
        perm = perms.setdefault(key, rng.permutation(w.shape[1])) if act_order else None
        q, s, z, g_idx = quantize(w, bits, group, sym, perm)
        dense[name] = torch.from_numpy(dequantize64(q, s, z, g_idx).astype(np.float32))
        parts = awq_tensors(q, s, z) if method == "awq" else gptq_tensors(q, s, z, g_idx, bits, v2)
        packed.update({f"{prefix}.{p}": v for p, v in parts.items()})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    qc = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
          if method == "awq" else
          {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
           "checkpoint_format": "gptq_v2" if v2 else "gptq"})
    for out, weights, quant in ((dst, packed, qc), (deq, dense, None)):
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors*", "config.json"))
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "model.safetensors"),
                  metadata={"format": "pt"})
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**config, **({"quantization_config": quant} if quant else {})}, f)


def write_compressed(src: str, dst: str, deq: str, fmt: str, weights: dict, activations: dict | None = None) -> None:
    """``src``'s Linear layers (but the LM head) quantized by compressed-tensors' own code into a
    ``fmt`` checkpoint ``dst`` (bfloat16 otherwise, as llm-compressor saves a bfloat16 model), and
    the library's own decompression of it (its scales widened to float32, so that nothing is
    rounded to bfloat16 on the way) into a plain float32 checkpoint ``deq`` for HF.

    The scales come from each group's min and max (the library's ``calculate_qparams``: what its
    default observer computes on the weights), not from calibration."""
    import transformers
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=QuantizationArgs(**activations) if activations else None)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=fmt)
    apply_quantization_config(model, config)
    quantized = {n: m for n, m in model.named_modules() if hasattr(m, "weight_scale")}
    for m in quantized.values():
        _set_qparams(m, m.quantization_scheme.weights)
        if hasattr(m, "input_scale"):  # (a static activation scale: stored, and not what pagellm uses)
            m.input_scale.data.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    dense = {}
    for name, t in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix not in quantized:
            dense[name] = t.float()
        elif leaf == "weight_scale":
            parts = {k: v for k, v in model.get_submodule(prefix).state_dict().items() if k.startswith("weight")}
            parts["weight_scale"] = parts["weight_scale"].float()
            dense[f"{prefix}.weight"] = BaseCompressor.get_value_from_registry(fmt).decompress(
                parts, quantized[prefix].quantization_scheme)["weight"].float()
    shutil.copytree(src, deq, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({k: v.contiguous() for k, v in dense.items()}, os.path.join(deq, "model.safetensors"),
              metadata={"format": "pt"})
    for f in os.listdir(src):  # (the tokenizer)
        if f.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(src, f), dst)


def qparams(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, zero point)`` of ``w [N, K]`` from each tensor's, channel's, group's or block's min
    and max, by the library's ``calculate_qparams`` (shaped as ``apply_quantization_config`` makes them)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = w.shape
    if args.strategy == "block":
        r, c = args.block_structure
        x = w.reshape(n // r, r, k // c, c).permute(0, 2, 1, 3).reshape(n // r, k // c, r * c)
    elif args.strategy == "group":
        x = w.reshape(n, k // args.group_size, args.group_size)
    else:
        x = w.reshape(1 if args.strategy == "tensor" else n, 1, -1)
    return calculate_qparams(x.amin(-1), x.amax(-1), args)


def compress_one(w: torch.Tensor, fmt: str, weights: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(the library's compressed tensors of w, its own decompression of them in float32)``, for one
    bfloat16 weight ``w [N, K]``."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    s, z = qparams(w.float(), scheme.weights)
    if scheme.weights.strategy == "tensor":
        s, z = s.reshape(1), z.reshape(1)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    parts = compressor.compress({"weight": w, "weight_scale": s.to(w.dtype), "weight_zero_point": z}, scheme)
    return parts, compressor.decompress({**parts, "weight_scale": parts["weight_scale"].float()}, scheme)["weight"]


def _set_qparams(module, args) -> None:
    s, z = qparams(module.weight.detach().float(), args)
    module.weight_scale.data.copy_(s.reshape(module.weight_scale.shape).to(module.weight_scale.dtype))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(z.reshape(module.weight_zero_point.shape))
