"""Locate a model (HF directory, GGUF file, or the bundled SmolLM2), read its config, stream weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from pagellm.config import ModelSource


def load_model_config(source: ModelSource) -> Any:
    """The HF ``PretrainedConfig`` of the model."""
    if source.is_gguf:
        from pagellm.weights.gguf_file import gguf_config

        return gguf_config(source.path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.path)
    if not getattr(config, "architectures", None):
        raise ValueError(f"{source.path}/config.json names no architectures")
    return config


def _safetensors_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {directory!r}")
    return [os.path.join(directory, f) for f in files]


class LazyTensor:
    """A safetensors tensor not read yet: ``narrow`` reads only the rows or columns asked for, so a
    tensor-parallel rank reads its shard and never the whole weight."""

    __slots__ = ("_slice", "shape")

    def __init__(self, sl: Any) -> None:
        self._slice = sl
        self.shape = torch.Size(sl.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, size: int) -> torch.Tensor:
        return self._slice[(slice(None),) * dim + (slice(start, start + size),)]


def iter_weights(source: ModelSource, config: Any, lazy: bool = False,
                 keep_gguf_blocks: bool = False) -> Iterator[tuple[str, Any]]:
    """``(hf_name, tensor)`` for every tensor of the checkpoint; with ``lazy``, safetensors come as
    ``LazyTensor``; with ``keep_gguf_blocks``, a GGUF matrix of a type the int8 kernel takes as its
    file's blocks (``GGUFBlocks``), any other GGUF tensor dequantized whole."""
    if source.is_gguf:
        from pagellm.weights.gguf_file import iter_gguf_weights

        yield from iter_gguf_weights(source.path, config, keep_gguf_blocks)
        return
    from safetensors import safe_open

    for path in _safetensors_files(source.path):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, LazyTensor(f.get_slice(name)) if lazy else f.get_tensor(name)


def freq_factors(source: ModelSource) -> torch.Tensor | None:
    if not source.is_gguf:
        return None
    from pagellm.weights.gguf_file import rope_freq_factors

    return rope_freq_factors(source.path)
