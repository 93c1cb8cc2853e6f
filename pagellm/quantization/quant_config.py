"""A Hugging Face checkpoint's ``quantization_config`` (config.json), read and named.

AWQ (version ``gemm``, 4-bit, zero points) and GPTQ (4-bit, or 8-bit symmetric; AutoGPTQ's or
GPTQModel's zero points; ``desc_act``) are read by ``group_quant.py``; compressed-tensors (its
``pack-quantized``, ``int-quantized`` and ``float-quantized`` formats, one weight scheme) by
``compressed_tensors.py``. Any other method or option (bitsandbytes, FP8 of other tools, AWQ's other
packings, GPTQ's 2/3 bits or quantized LM head, compressed-tensors' sparsity, transforms or
quantized KV cache) holds tensors no projection here reads: it is refused at start-up, before any
weight is read, with the method and every option that decides its layout named (what a port would
need).
"""

from __future__ import annotations

from typing import Any

from pagellm.quantization.compressed_tensors import CompressedTensorsScheme
from pagellm.quantization.group_quant import GroupQuantScheme

QuantScheme = GroupQuantScheme | CompressedTensorsScheme

# The options that decide a method's tensor layout, in the order they are named.
_LAYOUT_KEYS = ("bits", "group_size", "zero_point", "sym", "desc_act", "version", "checkpoint_format", "format",
                "activation_scheme", "weight_block_size", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type")


def quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a dict (``None``: not quantized)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None and hasattr(hf_config, "get_text_config"):  # (a vision-language model's text part)
        qc = getattr(hf_config.get_text_config(), "quantization_config", None)
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, dict) else qc.to_dict()


def describe(qc: dict[str, Any]) -> str:
    """``quant_method='awq' (bits=4, group_size=128, zero_point=True, version='gemm')``, and for
    compressed-tensors each scheme's weights and activations."""
    method = qc.get("quant_method", "unknown")
    if method == "compressed-tensors":
        opts = [f"format={qc.get('format')!r}"] + [_scheme(name, g) for name, g in
                                                   (qc.get("config_groups") or {}).items()]
    else:
        opts = [f"{k}={qc[k]!r}" for k in _LAYOUT_KEYS if qc.get(k) is not None]
    return f"quant_method={method!r}" + (f" ({', '.join(opts)})" if opts else "")


def _args(q: dict[str, Any] | None) -> str:
    """One compressed-tensors ``QuantizationArgs``: ``int4 asymmetric per group 128``."""
    if not q:
        return "none"
    bits = f"{q.get('type', 'int')}{q.get('num_bits')}"
    sym = "symmetric" if q.get("symmetric", True) else "asymmetric"
    size = f" {q['group_size']}" if q.get("group_size") else ""
    dynamic = ", dynamic" if q.get("dynamic") else ""
    return f"{bits} {sym} per {q.get('strategy')}{size}{dynamic}"


def _scheme(name: str, group: dict[str, Any]) -> str:
    return f"{name}: weights {_args(group.get('weights'))}, activations {_args(group.get('input_activations'))}"


def _checkpoint_format(qc: dict[str, Any]) -> str:
    """GPTQ's zero-point convention: ``gptq`` (AutoGPTQ's z - 1, the default) or ``gptq_v2`` (z)."""
    return str(qc.get("checkpoint_format", "gptq")).lower()


def _unsupported(qc: dict[str, Any]) -> str | None:
    """What of an AWQ / GPTQ config is not built (``None``: all of it is), as the refusal names it."""
    method, bits, group = qc.get("quant_method"), qc.get("bits"), qc.get("group_size", -1)
    if method not in ("awq", "gptq"):
        return "the method"
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
        return "group_size (32, 64, 128, ... or -1 are)"
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm":
            return "AWQ's version (gemm is)"
        if bits != 4 or not qc.get("zero_point", True):
            return "AWQ other than 4-bit with zero points"
        return None
    if qc.get("lm_head") or qc.get("is_marlin_format"):
        return "a quantized LM head" if qc.get("lm_head") else "the Marlin packing"
    if _checkpoint_format(qc) not in ("gptq", "gptq_v2"):
        return "checkpoint_format (gptq and gptq_v2 are)"
    if bits not in (4, 8) or (bits == 8 and not qc.get("sym", True)):
        return "GPTQ other than 4-bit or 8-bit symmetric"
    return None


_CT_FORMATS = {"pack-quantized": ("int", (4, 8), ("group", "channel", "tensor")),
               "int-quantized": ("int", (8,), ("group", "channel", "tensor")),
               "float-quantized": ("float", (8,), ("tensor", "channel", "block"))}


def _compressed_scheme(qc: dict[str, Any]) -> CompressedTensorsScheme | str:
    """A compressed-tensors config's one weight scheme, or what of it is not built."""
    groups = list((qc.get("config_groups") or {}).values())
    for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms"),
                      ("kv_cache_scheme", "a quantized KV cache")):
        if qc.get(key):
            return f"{what} ({key})"
    if qc.get("quantization_status", "compressed") != "compressed":
        return "quantization_status other than compressed"
    if len({repr(sorted((k, g.get(k)) for k in ("weights", "input_activations", "format"))) for g in groups}) != 1:
        return "config_groups with different schemes" if groups else "no config_groups"
    group = groups[0]
    w, a = group.get("weights") or {}, group.get("input_activations")
    fmt, kind = group.get("format") or qc.get("format"), w.get("type", "int")
    if fmt == "naive-quantized":  # (the weight stored in its quantized dtype, as int- or float-quantized)
        fmt = "float-quantized" if kind == "float" else "int-quantized"
    if fmt not in _CT_FORMATS:
        return "the format (pack-quantized, int-quantized and float-quantized are)"
    want, bits, strategies = _CT_FORMATS[fmt]
    strategy, size, block = w.get("strategy"), w.get("group_size"), w.get("block_structure")
    if kind != want or w.get("num_bits") not in bits or strategy not in strategies or w.get("dynamic"):
        return f"{fmt} weights other than {want}{'/'.join(map(str, bits))} per {', '.join(strategies)}"
    if strategy == "group" and (not isinstance(size, int) or size <= 0 or size % 32):
        return "group_size (multiples of 32 are)"
    if group.get("output_activations") or (a and (a.get("num_bits") != 8
                                                  or a.get("strategy") not in ("token", "tensor"))):
        return "activations other than 8-bit per token or per tensor"
    return CompressedTensorsScheme(
        fmt, kind, int(w["num_bits"]), strategy, bool(w.get("symmetric", True)),
        size if strategy == "group" and isinstance(size, int) else -1,
        tuple(block) if strategy == "block" and block else None, w.get("actorder") == "group", _args(a) if a else None)


def quant_scheme(hf_config: Any, path: str) -> QuantScheme | None:
    """The packing of a quantized HF checkpoint (``None``: not quantized); any other is refused by
    name (``ValueError``)."""
    qc = quantization_config(hf_config)
    if qc is None:
        return None
    got = _compressed_scheme(qc) if qc.get("quant_method") == "compressed-tensors" else _unsupported(qc)
    if isinstance(got, str):
        raise ValueError(
            f"{path}: config.json's quantization_config {describe(qc)} is not supported yet ({got}). pagellm "
            "runs AWQ (gemm, 4-bit), GPTQ (4-bit, 8-bit symmetric), compressed-tensors (pack-quantized int4/int8, "
            "int-quantized int8, float-quantized FP8), GGUF files (quantization='gguf') and 16/32-bit checkpoints: "
            "use the model's release in one of those instead")
    if isinstance(got, CompressedTensorsScheme):
        return got
    v1 = qc["quant_method"] == "gptq" and _checkpoint_format(qc) == "gptq"
    return GroupQuantScheme(qc["quant_method"], int(qc["bits"]), int(qc.get("group_size", -1)), int(v1))
