"""glibc's allocator, tuned so a CPU forward's activations reuse memory instead of faulting it in.

A prefill step of 2048 tokens allocates tens of MiB of activations per layer (the gate/up output
alone is 2048 x 3072 floats, 25 MiB) and frees them a moment later. glibc serves allocations above
its mmap threshold with a fresh ``mmap`` and returns them with ``munmap``, and trims the heap's top
once 128 KiB are free, so the next layer's tensor is faulted in and zeroed by the kernel page by page
again. Its threshold adapts upward only after freeing such a block, and a step's token count (so
every activation's size) changes from step to step, so how many pages a run faults depends on the
order of its allocations: W64 runs of the same code measured 0.48 to 2.1 million page faults (the
worst at 0.82x the usual throughput). Raising the mmap threshold to glibc's ceiling (32 MiB on
64-bit) and the trim threshold with it keeps freed activations in the heap for the next layer:
0.31 million in every run (the K/V cache's first touch and loading).

Activations above that ceiling were still mmapped whenever the heap had no free chunk to fit them:
a 2048-token step of a model 1024 wide with a 3072-wide MLP writes a 48 MiB gate/up output (an
8B's is 224 MiB). Whether it had one depended on what loading left behind, so runs of the same
embedding workload spent 1.9 or 3.3 s in that projection. ``M_MMAP_MAX = 0`` serves every
allocation from the heap (glibc still maps one a thread's arena cannot hold).

The worker tunes it once the model is loaded, not before: tuned while loading, the heap kept
loading's transients (freed, trimmed, so not resident) as gigabytes of holes, and each step's
activations settled in fresh ones, faulting more in: a 1.7B's RSS grew by 260, 39, 65, 33 and 27 MiB
over five identical 2048-token steps. Loading's transients are mapped and unmapped as glibc does by
default instead, and leave no holes.

What a step of at least ``TRIM_AFTER_TOKENS`` tokens freed is handed back after it (``trim``): kept,
the next steps' activations settled partly elsewhere in the heap, and a 1.7B's W64 run peaked 215
MiB over its loaded RSS for a 2048-token step whose live activations are under 100 MiB (measured
~140 MiB trimmed before each such step). Faulting a long step's activations in again is ~140 MiB of
zeroed pages against a step of seconds at 1.7B (estimated well under 1 %, not measured; a larger
share for a small model); decode steps keep theirs.

vLLM's CPU guide preloads tcmalloc for the same reason; this does it with the C library already in
the process. Set ``PAGELLM_MALLOC_TUNING=0`` to leave the allocator as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 128 << 20  # freed memory a process may keep at the heap's top

# Steps of this many tokens and more hand their freed activations back (``trim``).
TRIM_AFTER_TOKENS = 1024

_done: bool | None = None


def tune_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds and stop its mmapped allocations, for this process
    (once); ``True`` if they are set.
    Does nothing off glibc, or with ``PAGELLM_MALLOC_TUNING=0``."""
    global _done
    if _done is not None:
        return _done
    _done = False
    libc = _glibc()
    if os.environ.get("PAGELLM_MALLOC_TUNING", "1") == "0" or libc is None or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Setting either also turns off glibc's own adjustment of both (which would halve the trim one).
    _done = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
        and bool(mallopt(M_MMAP_MAX, 0))
    if _done:
        logger.debug("glibc malloc: mmap threshold %d MiB, trim threshold %d MiB, no mmapped allocations",
                     MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return _done


def trim() -> None:
    """Hand the heap's free memory back to the system: after a long step, and while loading (a
    model loaded in a process already tuned, a second engine's, keeps its packing's transient copies
    in the heap under ``tune_malloc``'s trim threshold)."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc, else ``None``; found once (``find_library`` runs
    ``ldconfig``, ``libc_ver`` reads the interpreter's binary: not on every long step)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
