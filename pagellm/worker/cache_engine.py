"""The paged KV cache tensors of one worker and the block copies the scheduler asks for.

One tensor ``[num_layers, 2, num_blocks * block_size, num_kv_heads, cache_head_dim]`` holds every
layer's K and V; layer ``i`` reads ``kv[i, 0]`` / ``kv[i, 1]`` as flat slot arrays. ``cache_head_dim``
is ``head_dim``, or ``head_dim + 4`` for an int8 cache (each head row carries its scale:
``attention/kv_quant.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.attention.kv_quant import cache_head_dim
from pagellm.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of one block across all layers; ``block_bytes`` sizes the pool from a byte budget."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def cache_head_dim(self) -> int:
        """Elements of one cached head row (with its scale, for an int8 cache)."""
        return cache_head_dim(self.head_dim, self.dtype)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.cache_head_dim * self.dtype.itemsize


# What a CUDA step may need besides its activations' estimate: cuBLAS workspaces, the caching
# allocator's fragmentation, the CUDA graphs' memory pool.
DEVICE_MARGIN = 1 << 30


def device_kv_budget(total: int, used: int, utilization: float, activations: int) -> int:
    """A CUDA device's KV cache bytes (vLLM's ``gpu_memory_utilization``): ``utilization`` of the
    device's ``total`` memory, less what is ``used`` on it once the weights are loaded (by any
    process), a step's ``activations`` and a margin. Refused, naming the argument, where nothing is left."""
    budget = int(total * utilization) - used - activations - DEVICE_MARGIN
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} leaves no memory for the KV cache: "
                         f"{used / 2**30:.1f} GiB of {total / 2**30:.1f} GiB is in use with the weights loaded, "
                         f"a step needs ~{(activations + DEVICE_MARGIN) / 2**30:.1f} GiB more "
                         "(raise it, or give kv_cache_memory)")
    return budget


def step_activation_bytes(tokens: int, rows: int, hidden: int, intermediate: int, vocab: int, itemsize: int) -> int:
    """A generous estimate of a step's activations: ``tokens`` rows through a layer (the residual,
    the norm's output, qkv and attention output at most 4 hidden widths, the gate/up output and its
    product 3 intermediate ones) and float32 logits of ``rows`` sampled rows with the sampler's copies."""
    return tokens * (4 * hidden + 3 * intermediate) * itemsize + rows * vocab * 4 * 4


def _anonymous_map(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only
        with contextlib.suppress(OSError):  # THP compiled out or disabled: 4 KiB pages, still correct
            buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


def _fault_in(raw: torch.Tensor) -> None:
    """Touch one byte per page of ``raw`` (uint8): torch splits the strided fill between its threads."""
    raw[::mmap.PAGESIZE].zero_()


class HostKVMemory:
    """A KV budget the user named, on a CPU, mapped and faulted in ahead of time (reserved, as
    vLLM's zeroed cache is): the worker creates it before it loads the model, and a thread touches
    its pages meanwhile (numpy releases the GIL; the model's loading is mostly one thread, so the
    other core is free). ``take`` stops the thread and faults in what is left from torch's threads.
    SmolLM2 on a 2.6 GHz EPYC: the 2 GiB that took 2.5 s of start-up after loading mostly fault in
    during it."""

    _CHUNK = 64 * 2**20

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buf = _anonymous_map(nbytes)
        self._done = 0  # bytes faulted in, a multiple of _CHUNK (so of the page size)
        self._cond = threading.Condition()
        self._stopped = self._paused = self._busy = False
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._touch, name="pagellm-kv-prefault", daemon=True)
        self._thread.start()

    def _touch(self) -> None:
        pages = np.frombuffer(self._buf, dtype=np.uint8)
        for off in range(0, self.nbytes, self._CHUNK):
            with self._cond:
                while self._paused and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                self._busy = True
            pages[off:off + self._CHUNK:mmap.PAGESIZE] = 0
            with self._cond:
                self._busy = False
                self._done = min(off + self._CHUNK, self.nbytes)
                self._cond.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No faulting in meanwhile (from the end of the chunk under way): for timing GEMMs."""
        with self._cond:
            self._paused = True
            while self._busy:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def stop(self) -> None:
        """Stop faulting in (also for a model that failed to load: its budget is not needed)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()

    def take(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` as a zeroed uint8 tensor, every page of them present."""
        if nbytes > self.nbytes:
            raise ValueError(f"the KV cache needs {nbytes} bytes; {self.nbytes} were mapped")
        self.stop()
        ahead = self._done
        raw = torch.frombuffer(self._buf, dtype=torch.uint8)[:nbytes]
        if ahead < nbytes:
            _fault_in(raw[ahead:])
        keep = cdiv(nbytes, mmap.PAGESIZE) * mmap.PAGESIZE
        if ahead > keep and hasattr(mmap, "MADV_DONTNEED"):  # the budget's unused rest, faulted in meanwhile
            self._buf.madvise(mmap.MADV_DONTNEED, keep, self.nbytes - keep)
        logger.info("KV cache: %.2f GiB faulted in at start-up, %.2f of them while the model loaded (%.2f s in all)",
                    nbytes / 2**30, min(ahead, nbytes) / 2**30, time.perf_counter() - self._start)
        return raw


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           memory: HostKVMemory | None = None) -> torch.Tensor:
    """``torch.zeros``, but on CPU from a fresh anonymous mapping: the OS zero-fills pages on first
    touch (``torch.zeros`` would write every byte a second time).

    The mapping asks for transparent huge pages (``MADV_HUGEPAGE``; most distributions enable THP
    only on request): decode attention jumps between scattered blocks, and with 4 KiB pages
    nearly every block costs a TLB miss (docs/performance.md, "Decisions in force").

    Its pages fault in as blocks are first written, so the memory in use grows with the K/V held
    (W64 on SmolLM2 peaks at 1.3 GiB instead of its 2 GiB budget's 2.5); the price is that first
    touch inside the steps (in a VM here ~1.5 s a GiB, 2-3 % of W64). ``memory``: a
    ``HostKVMemory`` mapped and faulted in while the model loaded (a budget the user named),
    used instead of a new mapping. The swap pool is always lazy: most runs never swap.
    """
    if device.type != "cpu" or not math.prod(shape):  # (an empty buffer cannot be viewed as float)
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if memory is not None:
        return memory.take(nbytes).view(dtype).view(shape)
    # frombuffer keeps the mapping alive as long as the tensor (and its views) live.
    return torch.frombuffer(_anonymous_map(nbytes), dtype=torch.uint8).view(dtype).view(shape)


class CacheEngine:
    """Owns the KV tensor and the CPU swap tensor; hands per-layer ``(key_cache, value_cache)``
    views to the model and performs the block copies of ``CacheOps``.

    The swap tensor has the same layout with ``num_cpu_blocks`` blocks. On CUDA it is pinned host
    memory (asynchronous copies); on CPU it is still a separate tensor, so swapping exercises the
    same accounting and copies everywhere.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device, num_cpu_blocks: int = 0,
                 memory: HostKVMemory | None = None, scratch_block: bool = False) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        # One block past the pool's, never handed out: CUDA graphs' padding rows write there.
        self.scratch_block = num_blocks if scratch_block else None
        rows = (num_blocks + scratch_block) * spec.block_size
        shape = (spec.num_layers, 2, rows, spec.num_kv_heads, spec.cache_head_dim)
        # Zeroed: attention gathers whole blocks and masks the unused tail slots, but a masked key
        # still multiplies its value by 0, so every slot must hold a finite number from the start.
        self.kv = _zeros(shape, spec.dtype, device, memory=memory)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(spec.num_layers)]
        cpu_shape = (spec.num_layers, 2, num_cpu_blocks * spec.block_size, spec.num_kv_heads, spec.cache_head_dim)
        self.cpu_kv = _zeros(cpu_shape, spec.dtype, torch.device("cpu"))
        if device.type == "cuda" and num_cpu_blocks:
            self.cpu_kv = self.cpu_kv.pin_memory()

    @staticmethod
    def _blocks(kv: torch.Tensor, block_size: int) -> torch.Tensor:
        """``[layers, 2, num_blocks, block_size * heads * dim]`` view: one row per block and layer."""
        return kv.view(kv.shape[0], 2, kv.shape[2] // block_size, -1)

    def _transfer(self, src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        bs = self.spec.block_size
        s_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src.device)
        d_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst.device)
        rows = self._blocks(src, bs).index_select(2, s_ids)
        if src.device.type == "cuda" and dst.device.type == "cpu":
            # The scatter into the swap tensor runs on the host at once: it must wait for the copy.
            rows = rows.to(dst.device)
        elif src.device.type == "cpu" and dst.device.type == "cuda":
            # From pinned memory the upload is asynchronous; the step's kernels follow it on the stream.
            rows = rows.pin_memory().to(dst.device, non_blocking=True)
        self._blocks(dst, bs).index_copy_(2, d_ids, rows)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU swap blocks, ``(device, cpu)`` pairs, every layer."""
        self._transfer(self.kv, self.cpu_kv, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU swap blocks back to device blocks, ``(cpu, device)`` pairs, every layer."""
        self._transfer(self.cpu_kv, self.kv, pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole device blocks ``src -> dst`` in every layer (copy-on-write)."""
        self._transfer(self.kv, self.kv, pairs)
