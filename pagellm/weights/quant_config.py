"""A Hugging Face checkpoint's ``quantization_config`` (config.json), read and named.

pagellm runs GGUF files at their width (``quantization="gguf"``) and 16/32-bit checkpoints. A
directory quantized by AutoAWQ, GPTQ (AutoGPTQ / GPTQModel / optimum), llm-compressor
(compressed-tensors), FP8 or bitsandbytes holds packed tensors (``qweight``, ``qzeros``,
``scales``, ...) that no projection here reads yet: it is refused at start-up, before any weight is
read, with the method and every option that decides its layout named (what a port would need).
"""

from __future__ import annotations

from typing import Any

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


def _scheme(name: str, group: dict[str, Any]) -> str:
    def part(q: dict[str, Any] | None) -> str:
        if not q:
            return "none"
        bits = f"{q.get('type', 'int')}{q.get('num_bits')}"
        sym = "symmetric" if q.get("symmetric", True) else "asymmetric"
        size = f" {q['group_size']}" if q.get("group_size") else ""
        dynamic = ", dynamic" if q.get("dynamic") else ""
        return f"{bits} {sym} per {q.get('strategy')}{size}{dynamic}"

    return f"{name}: weights {part(group.get('weights'))}, activations {part(group.get('input_activations'))}"


def check_quantization(hf_config: Any, path: str) -> None:
    """Refuse a quantized HF checkpoint by name (``ValueError``); a plain one passes."""
    qc = quantization_config(hf_config)
    if qc is None:
        return
    raise ValueError(
        f"{path}: config.json's quantization_config {describe(qc)} is not supported yet. pagellm runs GGUF "
        "files at their width (quantization='gguf': Q4_0/Q4_1/Q5/Q8_0 and the K-quants) and 16/32-bit "
        "checkpoints: use the model's GGUF release (or a 16-bit copy) instead")
