"""``LoRARequest``: which adapter a request runs with (vLLM's shape), and checking a PEFT adapter
directory without loading it (its config and the safetensors header: names, shapes), so the
engine can refuse a bad adapter before any request of it reaches the loop; the worker reads the
tensors (``lora/adapter.py``).

PEFT stores ``base_model.model.model.layers.{i}.{self_attn|mlp}.{q,k,v,o,gate,up,down}_proj.
lora_{A,B}.weight`` (``A [r, in]``, ``B [out, r]``) with ``r``, ``lora_alpha``, ``use_rslora`` in
``adapter_config.json``; the update is ``x A^T B^T * scaling``, ``scaling = lora_alpha / r``
(rsLoRA: ``lora_alpha / sqrt(r)``). pagellm's projections are fused (``qkv_proj``,
``gate_up_proj``): each PEFT module is one part of one fused module.

An adapter's identity for the prefix cache is a hash of its files (not its name): an adapter
reloaded with other weights under the same name never reuses stale K/V.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field

# PEFT module name -> (pagellm's fused module, part index).
MODULE_PARTS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0), "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
ADAPTER_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served: missing, malformed, or not fitting the base model."""


class LoRAInUse(LoRAError):
    """Unloading an adapter that live requests still use (the server answers 409)."""


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) under a
    name and a positive integer id; requests naming the same id share the loaded adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A checked adapter: where it is, its rank and scaling, and its identity (file hash)."""

    name: str
    path: str
    rank: int
    scaling: float
    fingerprint: str
    # (layer, fused module, part) -> safetensors names of A and B
    tensors: dict[tuple[int, str, int], tuple[str, str]] = field(default_factory=dict)


def _safetensors_header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 * 2**20:
            raise LoRAError(f"{path!r}: not a safetensors file (header of {n} bytes)")
        return json.loads(f.read(n))


def inspect_adapter(name: str, path: str, max_lora_rank: int, module_shapes: dict[str, list[tuple[int, int]]],
                    num_layers: int) -> AdapterSpec:
    """Check a PEFT adapter directory against the base model (``module_shapes``: each fused
    module's parts as ``(in_features, out_features)``) without loading its tensors."""
    cfg_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} is not a directory")
    for p in (cfg_path, weights_path):
        if not os.path.isfile(p):
            raise LoRAError(f"LoRA adapter {name!r}: {p!r} does not exist (a PEFT adapter directory has "
                            "adapter_config.json and adapter_model.safetensors)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
        header = _safetensors_header(weights_path)
    except (OSError, ValueError, struct.error) as e:
        raise LoRAError(f"LoRA adapter {name!r}: unreadable: {e}") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("modules_to_save") or cfg.get("bias", "none") != "none" or cfg.get("fan_in_fan_out"):
        raise LoRAError(f"LoRA adapter {name!r}: modules_to_save, trained biases and fan_in_fan_out are not "
                        "supported")
    if cfg.get("alpha_pattern") or cfg.get("rank_pattern"):
        raise LoRAError(f"LoRA adapter {name!r}: per-module rank_pattern / alpha_pattern are not supported")
    r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    if r > max_lora_rank:
        raise LoRAError(f"LoRA adapter {name!r} has rank {r}, above max_lora_rank={max_lora_rank}")
    pairs: dict[tuple[int, str, int], dict[str, str]] = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        m = ADAPTER_KEY.match(key)
        if m is None or m.group(3) not in MODULE_PARTS:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} targets no projection pagellm has "
                            f"(supported: {', '.join(MODULE_PARTS)})")
        layer = int(m.group(1))
        if layer >= num_layers:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer}, but the base model has {num_layers}")
        module, part = MODULE_PARTS[m.group(3)]
        in_f, out_f = module_shapes[module][part]
        want = [r, in_f] if m.group(4) == "A" else [out_f, r]
        if list(meta["shape"]) != want:
            raise LoRAError(f"LoRA adapter {name!r}: {key} has shape {meta['shape']}; the base model needs {want}")
        pairs.setdefault((layer, module, part), {})[m.group(4)] = key
    for (layer, module, part), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} part {part} lacks lora_A or lora_B")
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: no LoRA weights in {weights_path!r}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    digest = hashlib.sha256(f"{scaling!r}".encode())
    with open(weights_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return AdapterSpec(name, path, r, scaling, digest.hexdigest(),
                       {k: (v["A"], v["B"]) for k, v in sorted(pairs.items())})
