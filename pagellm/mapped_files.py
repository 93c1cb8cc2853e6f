"""A checkpoint's bytes as mappings: each tensor its own copy-on-write mapping, its pages dropped
once packed, and rows read by ``pread`` where a lookup must map no page.

``weights/loader.py`` maps safetensors tensors through :func:`map_bytes`; a GGUF file's tensors are
``np.memmap`` views (``weights/gguf_file.py``); the stored-block formats (``quantization/``) read an
embedding's rows through :func:`read_rows` and :func:`read_memmap_rows` and release a packed
tensor's pages with :func:`release_pages`.
"""

from __future__ import annotations

import mmap
import os
import weakref
from typing import Any

import numpy as np
import torch

# A mapped tensor's storage address -> its mapping (held weakly: the mapping goes with the tensor),
# and the file and offset of its first byte.
_MAPPINGS: dict[int, tuple[weakref.ref[mmap.mmap], str, int]] = {}


def map_bytes(fd: int, offset: int, nbytes: int, path: str) -> torch.Tensor:
    """``nbytes`` at ``offset`` of an open file as a copy-on-write mapping of its own (a tensor of
    bytes; read into memory where the file cannot be mapped), registered for :func:`release_pages`
    and :func:`read_rows`."""
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
    """Drop the pages of a tensor :func:`map_bytes` mapped from this process's RSS (they stay
    in the page cache, and are read again if the tensor is): for a tensor never written, as a
    written page would be lost. Nothing for any other tensor."""
    entry = _MAPPINGS.get(tensor.untyped_storage().data_ptr())
    mapping = entry[0]() if entry is not None else None
    if mapping is not None and hasattr(mapping, "madvise"):
        mapping.madvise(mmap.MADV_DONTNEED)


def read_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """Rows of a 2-D tensor :func:`map_bytes` mapped, read from its file with ``pread`` into
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
