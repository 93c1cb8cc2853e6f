"""Locate a model (HF directory, GGUF file, or the bundled SmolLM2), read its config, stream weights."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from pagellm.config import ModelSource

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
    """Every tensor of a safetensors file, each read into its own memory. ``safe_open`` maps the
    file, and the pages it reads stay in this process's RSS: loading a 3.2 GiB bfloat16 checkpoint
    took the whole file's mapping resident beside the weights (3.1 GB of RssFile, 1x the file on top
    of the load's peak). Read with ``readinto``, the file's pages stay in the page cache, counted
    nowhere in the process."""
    with open(path, "rb", buffering=0) as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            buf = torch.empty(end - start, dtype=torch.uint8)
            view, done = memoryview(buf.numpy()).cast("B"), 0  # type: ignore[arg-type]
            f.seek(8 + size + start)
            while done < end - start:
                got = f.readinto(view[done:])
                if not got:
                    raise ValueError(f"{path}: tensor {name} is cut short ({done} of {end - start} bytes)")
                done += got
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
