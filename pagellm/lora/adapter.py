"""An adapter's tensors, read from the directory ``lora_request.inspect_adapter`` checked:
``(layer, fused module) -> {part: (A [r, in], B [out, r] * scaling)}`` (the scaling folded into
``B``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from pagellm.lora_request import AdapterSpec


@dataclass(slots=True)
class LoRAAdapter:
    spec: AdapterSpec
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]


def load_adapter(spec: AdapterSpec) -> LoRAAdapter:
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    with safe_open(os.path.join(spec.path, "adapter_model.safetensors"), framework="pt") as f:
        for (layer, module, part), (a_key, b_key) in spec.tensors.items():
            a = f.get_tensor(a_key).float().contiguous()
            b = (f.get_tensor(b_key).float() * spec.scaling).contiguous()
            weights.setdefault((layer, module), {})[part] = (a, b)
    return LoRAAdapter(spec, weights)
