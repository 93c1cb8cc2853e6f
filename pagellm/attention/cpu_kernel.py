"""The optional compiled CPU kernel for paged decode attention (``paged_decode.c``).

The pure-PyTorch decode path gathers every block a decode reads into a dense buffer, then runs
SDPA over it: the K/V bytes cross memory three times, and at 64 decodes that is more than half
of a step. The kernel reads K and V straight from their blocks, once. It is plain C built with
the machine's compiler on first use (about a second; no torch headers), cached under
``~/.cache/pagellm/kernels`` by a hash of the source, flags and compiler, and called through
``ctypes``. It links the OpenMP runtime torch already loaded, so both share one thread pool.

No compiler, a failed build, a non-CPU device, a non-float32 cache, or ``PAGELLM_CPU_KERNELS=0``:
pagellm logs once and stays on the pure path, which remains the oracle the tests compare against.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

from pagellm.utils import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "paged_decode.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler on PATH")
    with open(_SOURCE, "rb") as f:
        src = f.read()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(src + " ".join(_FLAGS).encode() + version.encode()).hexdigest()[:16]
    out_dir = cache_dir("kernels")
    path = os.path.join(out_dir, f"paged_decode_{key}.so")
    if not os.path.exists(path):
        os.makedirs(out_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            subprocess.run([cc, *_FLAGS, _SOURCE, "-o", tmp, "-lm"], capture_output=True, text=True, check=True)
            os.replace(tmp, path)  # atomic: concurrent builders never load a half-written file
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{cc} failed: {e.stderr.strip()[:500]}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(path)
    fn = lib.paged_decode_f32
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float]
    return lib


def available() -> bool:
    """Build (once) and load the kernel; ``False`` when it is disabled or cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib is not None
    with _lock:
        if not _tried:
            if os.environ.get("PAGELLM_CPU_KERNELS", "1") != "0":
                try:
                    _lib = _build()
                except Exception as e:  # no compiler, read-only cache, odd platform: the pure path works
                    logger.warning("CPU decode-attention kernel unavailable (%s); using pure PyTorch attention", e)
            _tried = True
    return _lib is not None


def usable_for(key_cache: torch.Tensor) -> bool:
    """Whether decodes over this cache can take the kernel."""
    return key_cache.device.type == "cpu" and key_cache.dtype == torch.float32 and available()


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           block_size: int, scale: float) -> None:
    """``out[b] = softmax(q[b] K_b^T * scale) V_b`` over the first ``seq_lens[b]`` cached positions.

    ``query``/``out`` ``[B, Hq, D]`` contiguous float32; caches ``[num_slots, Hkv, D]``;
    ``block_tables`` ``[B, max_blocks]`` and ``seq_lens`` ``[B]`` int64 on the CPU.
    """
    assert _lib is not None, "call available() first"
    b, hq, d = query.shape
    hkv = key_cache.shape[1]
    for t, name in ((out, "out"), (query, "query"), (key_cache, "key_cache"), (value_cache, "value_cache")):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32")
    for t, name in ((block_tables, "block_tables"), (seq_lens, "seq_lens")):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int64")
    _lib.paged_decode_f32(out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
                          block_tables.data_ptr(), seq_lens.data_ptr(), b, hq, hkv, d, block_size,
                          block_tables.shape[1], scale)
