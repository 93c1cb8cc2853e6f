"""Locate a model (HF directory, GGUF file, or the bundled SmolLM2), read its config, stream weights."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from pagellm.config import ModelSource
from pagellm.mapped_files import map_bytes

logger = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


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


def end_of_generation_ids(source: ModelSource) -> tuple[int, ...]:
    """The ids a checkpoint says end generation besides (or including) its tokenizer's EOS: in a
    GGUF file, what llama.cpp derives (``gguf_file.gguf_end_of_generation_ids``); in an HF directory,
    ``generation_config.json``'s ``eos_token_id`` (an id or a list), as vLLM reads it. An
    instruction-tuned model's end of turn (Gemma's ``<end_of_turn>``, Llama 3's ``<|eot_id|>``) is often
    not its tokenizer's EOS."""
    if source.is_gguf:
        from pagellm.weights.gguf_file import gguf_end_of_generation_ids

        return tuple(gguf_end_of_generation_ids(source.path))
    if not os.path.exists(os.path.join(source.path, "generation_config.json")):
        return ()
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(source.path).eos_token_id
    except (OSError, ValueError) as e:  # a broken generation config must not stop the engine
        logger.warning("ignoring %s/generation_config.json: %s", source.path, e)
        return ()
    return tuple(sorted({eos} if isinstance(eos, int) else set(eos or ())))


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
        if not lazy:
            yield from read_safetensors(path)
            continue
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, LazyTensor(f.get_slice(name))


def read_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors file, each a copy-on-write mapping of its own bytes: a page
    counts in this process's RSS only once read, and leaves it when the tensor is dropped (or
    :func:`release_pages` drops it). ``safe_open`` maps the whole file once, so every page it read
    stayed resident until the end (a 3.2 GiB checkpoint's whole file beside its weights); and
    reading each tensor into memory held a 4-bit checkpoint's whole file until the numerics were
    chosen and its first projection packed (0.6 GiB over the file at 1.7B, with the packed copies)."""
    with open(path, "rb", buffering=0) as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        file_size = os.fstat(f.fileno()).st_size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if 8 + size + end > file_size:  # (a mapped page past the end would be SIGBUS when read)
                raise ValueError(f"{path}: tensor {name} is cut short ({max(file_size - 8 - size - start, 0)} of "
                                 f"{end - start} bytes)")
            buf = map_bytes(f.fileno(), 8 + size + start, end - start, path)
            yield name, buf.view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])


def projection_dtype(source: ModelSource) -> torch.dtype | None:
    """The dtype an HF checkpoint stores its projections in (read from the first file's header: the
    first 2-D ``*proj.weight``), ``None`` for a GGUF file or one without such a tensor."""
    if source.is_gguf:
        return None
    from safetensors import safe_open

    with safe_open(_safetensors_files(source.path)[0], framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
            if name.endswith("proj.weight"):
                sl = f.get_slice(name)
                return _SAFETENSORS_DTYPES.get(sl.get_dtype()) if len(sl.get_shape()) == 2 else None
    return None


def freq_factors(source: ModelSource) -> torch.Tensor | None:
    if not source.is_gguf:
        return None
    from pagellm.weights.gguf_file import rope_freq_factors

    return rope_freq_factors(source.path)
