"""Locate a model (HF directory, GGUF file, or the bundled SmolLM2), read its config, stream weights."""

from __future__ import annotations

import json
import logging
import mmap
import os
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
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
            buf = _map_bytes(f.fileno(), 8 + size + start, end - start, path)
            yield name, buf.view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])


# A mapped tensor's storage address -> its mapping (held weakly: the mapping goes with the tensor),
# and the file and offset of its first byte.
_MAPPINGS: dict[int, tuple[weakref.ref[mmap.mmap], str, int]] = {}


def _map_bytes(fd: int, offset: int, nbytes: int, path: str) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapping = mmap.mmap(fd, offset - base + nbytes, offset=base, access=mmap.ACCESS_COPY)
    except OSError:  # (a file system without mmap, or the process's map count spent: read it instead)
        return _read_bytes(fd, offset, nbytes)
    buf = torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=offset - base))
    address = buf.untyped_storage().data_ptr()
    _MAPPINGS[address] = weakref.ref(mapping, lambda _: _MAPPINGS.pop(address, None)), path, offset
    return buf


def _read_bytes(fd: int, offset: int, nbytes: int) -> torch.Tensor:
    buf = torch.empty(nbytes, dtype=torch.uint8)
    view, done = memoryview(buf.numpy()).cast("B"), 0  # type: ignore[arg-type]
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            raise ValueError(f"cut short at {done} of {nbytes} bytes")
        done += got
    return buf


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the pages of a tensor :func:`read_safetensors` mapped from this process's RSS (they stay
    in the page cache, and are read again if the tensor is): for a tensor never written, as a
    written page would be lost. Nothing for any other tensor."""
    entry = _MAPPINGS.get(tensor.untyped_storage().data_ptr())
    mapping = entry[0]() if entry is not None else None
    if mapping is not None and hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_DONTNEED)


def read_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """Rows of a 2-D tensor :func:`read_safetensors` mapped, read from its file with ``pread`` into
    memory of their own: a lookup that maps no page. (Reading a row through the mapping maps the
    page cache's whole folio around it, 2 MiB on a kernel with large folios: a 2,048-token prompt's
    lookup left a 192 MiB embedding all resident.) ``None`` for any other tensor, or one whose rows
    are not contiguous."""
    entry = _MAPPINGS.get(tensor.untyped_storage().data_ptr())
    if entry is None or entry[0]() is None or tensor.dim() != 2 or not tensor.is_contiguous():
        return None
    out = torch.empty((len(rows), tensor.shape[1]), dtype=tensor.dtype)
    _pread_rows(entry[1], entry[2] + int(tensor.storage_offset()) * tensor.element_size(), int(tensor.shape[0]),
                out.view(torch.uint8).numpy(), rows)
    return out


def read_memmap_rows(data: np.ndarray, rows: list[int]) -> np.ndarray | None:
    """:func:`read_rows` for rows of a 2-D array mapped by ``np.memmap`` (a GGUF file's tensor);
    ``None`` for an array not mapped, or whose rows are not contiguous."""
    root: Any = data
    while isinstance(root, np.ndarray) and not isinstance(root.base, mmap.mmap):
        root = root.base
    if not isinstance(root, np.memmap) or root.filename is None or data.ndim != 2 or not data.flags.c_contiguous:
        return None
    out = np.empty((len(rows), data.shape[1]), dtype=data.dtype)
    _pread_rows(str(root.filename), root.offset + data.ctypes.data - root.ctypes.data, data.shape[0],
                out.view(np.uint8), rows)
    return out


def _pread_rows(path: str, offset: int, num_rows: int, out: np.ndarray, rows: list[int]) -> None:
    """Rows ``rows`` of a ``[num_rows, out.shape[1]]`` byte array at ``offset`` in ``path``, into ``out``."""
    if rows and not 0 <= min(rows) <= max(rows) < num_rows:
        raise IndexError(f"rows {min(rows)}..{max(rows)} out of range for {num_rows} rows")
    size, view = out.shape[1], out.data.cast("B")
    fd = os.open(path, os.O_RDONLY)
    try:
        for i, r in enumerate(rows):
            if os.preadv(fd, [view[i * size:(i + 1) * size]], offset + r * size) != size:
                raise ValueError(f"{path}: row {r} cut short")
    finally:
        os.close(fd)


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
