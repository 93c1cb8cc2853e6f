"""Compiled CPU kernels: plain C sources built with the machine's compiler on first use.

Each ``<name>.c`` here is compiled once (about a second; no torch headers) with ``-O3
-march=native -fopenmp``, cached under ``~/.cache/pagellm/kernels`` by a hash of the source,
flags and compiler version, and loaded with ``ctypes``. The libraries link the OpenMP runtime
torch already loaded (same ``libgomp.so.1`` soname), so kernels and torch share one thread pool.

Every kernel is optional: no compiler, a failed build, or ``PAGELLM_CPU_KERNELS=0`` and
:func:`load` returns ``None`` (logged once); callers then stay on their pure-PyTorch path, which
is also the oracle the tests compare the kernels against.
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
from typing import Any

from pagellm.utils import cache_dir

logger = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}


def enabled() -> bool:
    """``False`` when the user turned the kernels off with ``PAGELLM_CPU_KERNELS=0``."""
    return os.environ.get("PAGELLM_CPU_KERNELS", "1") != "0"


# Exported function name -> (restype, argtypes), declared by each wrapper module.
Signatures = dict[str, tuple[Any, list[Any]]]


def flags() -> list[str]:
    """The compiler flags: ``-O3 -march=native -fopenmp``, then ``PAGELLM_CPU_CFLAGS`` (e.g.
    ``-mno-avx512f`` to run the AVX2 paths an older CPU takes, on this one)."""
    return _FLAGS + os.environ.get("PAGELLM_CPU_CFLAGS", "").split()


def build_source(source: str, signatures: Signatures | None = None, extra: list[str] | None = None) -> ctypes.CDLL:
    """Compile any C file with the kernels' flags (cached the same way) and load it. :func:`load`
    builds the package's own kernels through this; benchmarks use it to time an older version of
    a kernel (``git show REV:pagellm/kernels/gemm.c``) against the current one in one process, and
    tests build a kernel with ``extra`` flags (another ISA's path) beside the machine's own."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler on PATH")
    name = os.path.splitext(os.path.basename(source))[0]
    with open(source, "rb") as f:
        src = f.read()
    src_dir = os.path.dirname(os.path.abspath(source))
    for header in sorted(h for h in os.listdir(src_dir) if h.endswith(".h")):  # what `#include "x.h"` can read
        with open(os.path.join(src_dir, header), "rb") as f:
            src += f.read()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    cflags = flags() + (extra or [])
    key = hashlib.sha256(src + " ".join(cflags).encode() + version.encode()).hexdigest()[:16]
    out_dir = cache_dir("kernels")
    path = os.path.join(out_dir, f"{name}_{key}.so")
    if not os.path.exists(path):
        os.makedirs(out_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            subprocess.run([cc, *cflags, source, "-o", tmp, "-lm"], capture_output=True, text=True, check=True)
            os.replace(tmp, path)  # atomic: concurrent builders never load a half-written file
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{cc} failed: {e.stderr.strip()[:500]}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(path)
    for fn_name, (restype, argtypes) in (signatures or {}).items():
        fn = getattr(lib, fn_name)  # a missing symbol is a failed build
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def address(fn: Any) -> int:
    """A loaded kernel function's address, for C code that calls kernels of other libraries through a
    table (``decode_graph.c``)."""
    value = ctypes.cast(fn, ctypes.c_void_p).value
    if not value:
        raise ValueError(f"{fn!r} has no address")
    return value


def load(name: str, signatures: Signatures) -> ctypes.CDLL | None:
    """The compiled library ``<name>.c`` (built on the first call) with ``signatures`` declared on
    its functions, or ``None`` if unavailable. Later calls return the same library at dict cost."""
    if name in _libs:
        return _libs[name]
    with _lock:
        if name not in _libs:
            lib = None
            if enabled():
                try:
                    lib = build_source(os.path.join(os.path.dirname(__file__), f"{name}.c"), signatures)
                except Exception as e:  # no compiler, read-only cache, odd platform: the pure path works
                    logger.warning("CPU kernel %s unavailable (%s); using the pure PyTorch path", name, e)
            _libs[name] = lib
    return _libs[name]
