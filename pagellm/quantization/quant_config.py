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

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from pagellm.quantization.compressed_tensors import CompressedTensorsScheme, describe_args
from pagellm.quantization.group_quant import GroupQuantScheme


class QuantScheme(Protocol):
    """A quantized checkpoint's packing, read from its ``quantization_config``."""

    @property
    def method(self) -> str: ...  # the config's quant_method

    @property
    def name(self) -> str: ...  # as the start-up numerics line names it

    @property
    def note(self) -> str | None: ...  # what of the checkpoint runs another way, for the log

    def gather(self, weights: Iterator[tuple[str, Any]], keep: bool) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors with each quantized module's parts gathered into its weight
        (kept at their width with ``keep``, else dequantized)."""


# One row per checkpoint quantization method: its config read into a scheme, or a string naming
# what of it is not built (the refusal quotes it). A new method is its module and its row here.
QUANT_METHODS: dict[str, Callable[[dict[str, Any]], QuantScheme | str]] = {
    "awq": GroupQuantScheme.from_config,
    "gptq": GroupQuantScheme.from_config,
    "compressed-tensors": CompressedTensorsScheme.from_config,
}

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
    return (f"{name}: weights {describe_args(group.get('weights'))}, "
            f"activations {describe_args(group.get('input_activations'))}")


def quant_scheme(hf_config: Any, path: str) -> QuantScheme | None:
    """The packing of a quantized HF checkpoint (``None``: not quantized); any other is refused by
    name (``ValueError``)."""
    qc = quantization_config(hf_config)
    if qc is None:
        return None
    read = QUANT_METHODS.get(qc.get("quant_method", ""))
    got = read(qc) if read is not None else "the method"
    if isinstance(got, str):
        raise ValueError(
            f"{path}: config.json's quantization_config {describe(qc)} is not supported yet ({got}). pagellm "
            "runs AWQ (gemm, 4-bit), GPTQ (4-bit, 8-bit symmetric), compressed-tensors (pack-quantized int4/int8, "
            "int-quantized int8, float-quantized FP8), GGUF files (quantization='gguf') and 16/32-bit checkpoints: "
            "use the model's release in one of those instead")
    return got
