"""vLLM's ``load_format="dummy"``: a model's weights filled with small random values instead of read
from files, to measure speed at a model's shape where its weights are not at hand (speed does not
depend on weight values). Small, as vLLM's ``[-1e-3, 1e-3)``: activations stay finite through any
depth, so every kernel runs its ordinary path."""

from __future__ import annotations

import torch
from torch import nn


def initialize_dummy_weights(model: nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3) -> None:
    """Every floating-point parameter and buffer of ``model`` uniform in ``[low, high)``, the same
    values for the same ``seed`` and device."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if not tensor.is_floating_point():
                continue
            g = generators.get(tensor.device)
            if g is None:
                g = generators[tensor.device] = torch.Generator(device=tensor.device).manual_seed(seed)
            tensor.uniform_(low, high, generator=g)
