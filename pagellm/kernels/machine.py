"""What this CPU can do, and which GEMM numerics a model gets on it (decided once, at start-up).

Machines differ in ways that flip the answer: on one 2-core Xeon with AMX, pagellm's bfloat16 GEMM
on AMX tiles runs 3-5x its float32 kernel at 16-2048 rows (``benchmarks/gemm.py --bf16``); on a
machine with AVX512-BF16 dot products but no AMX the bf16 kernel can be *slower* than float32
(vdpbf16ps issues at the FMA rate there); without either, only float32 is offered. So ``auto``
reads the ISA, and where that is not enough, times both kernels once on the model's own layer
shapes (cached per machine and shape under ``~/.cache/pagellm/probe``; the first engine to need
the answer measures it, the others wait for it, so every replica chooses alike).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass

import torch

from pagellm.kernels import gemm
from pagellm.utils import cache_dir

logger = logging.getLogger(__name__)

# The flags that decide pagellm's kernels, in the order a summary lists them.
FLAGS_THAT_MATTER = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8",
                     "amx_tile")
# A candidate must beat float32 by this margin over the probe's row counts to be chosen.
MIN_SPEEDUP = 1.15
PROBE_ROWS = (1, 16, 64, 256)


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """The CPU model, the flags that matter, the L3 size and the cores of this machine."""

    model: str
    flags: tuple[str, ...]
    l3: str
    cores: int

    def summary(self) -> str:
        return f"{self.model} | {self.cores} CPUs | L3 {self.l3} | {' '.join(self.flags) or 'no AVX2'}"


@functools.cache
def cpu_info() -> CpuInfo:
    """Read once from ``/proc/cpuinfo`` and sysfs (Linux); best effort elsewhere."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and value.strip():
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    l3 = "?"
    for index in range(8):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{index}"
        try:
            with open(f"{base}/level") as f:
                level = f.read().strip()
            with open(f"{base}/size") as f:
                size = f.read().strip()
        except OSError:
            break
        if level == "3":
            l3 = size
    return CpuInfo(model, tuple(f for f in FLAGS_THAT_MATTER if f in flags), l3, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class Numerics:
    """The GEMM compute dtype chosen for a model, and why (one log line)."""

    compute_dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.compute_dtype).removeprefix("torch.")


def _time(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def probe_bf16_speedup(weights: list[torch.Tensor]) -> float:
    """float32 kernel time / bfloat16 kernel time, summed over ``PROBE_ROWS`` and the given layer
    weights (the model's own shapes), on this machine; measured once per machine and shapes and
    cached. A file lock makes concurrent engines (data-parallel replicas, in threads or processes)
    wait for the first one's answer instead of timing each other, so they all choose alike."""
    info = cpu_info()
    shapes = [tuple(w.shape) for w in weights]
    key = json.dumps([info.model, info.flags, shapes, gemm.amx_supported(), PROBE_ROWS])
    path = os.path.join(cache_dir("probe"), hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                return float(json.load(f)["bf16_speedup"])
        except (OSError, ValueError, KeyError):
            pass
        speedup = _measure_bf16_speedup(weights)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"bf16_speedup": speedup, "key": key}, f)
        os.replace(tmp, path)
    return speedup


def _measure_bf16_speedup(weights: list[torch.Tensor]) -> float:
    amx = gemm.amx_supported()
    t32 = t16 = 0.0
    with torch.inference_mode():
        for w in weights:
            p32, p16 = gemm.pack(w), gemm.pack_bf16(w)
            for rows in PROBE_ROWS:
                x = torch.randn(rows, w.shape[1])
                t32 += _time(lambda x=x, p=p32, n=w.shape[0]: gemm.linear(x, p, n))
                t16 += _time(lambda x=x, p=p16, n=w.shape[0]: gemm.linear(x, p, n, bits=16, amx=amx))
    return t32 / t16


def choose_numerics(requested: str, layer_weights: list[torch.Tensor], probe: bool = True) -> Numerics:
    """GEMM numerics for a float32 model on this CPU. ``requested`` is the engine's ``dtype``:
    ``float32`` (the exact oracle), ``bfloat16`` (the bf16 kernel if this machine has one), or
    ``auto``: bfloat16 where the kernel exists and measures at least ``MIN_SPEEDUP`` faster on
    ``layer_weights`` (``probe=False``: only where AMX runs it), else float32."""
    f32, bf16 = torch.float32, torch.bfloat16
    if requested == "float32":
        return Numerics(f32, "float32 asked for (token-exact with Hugging Face)")
    usable = bool(layer_weights) and gemm.usable(layer_weights[0]) and gemm.bf16_supported()
    if requested == "bfloat16":
        if not usable:
            raise ValueError("no bfloat16 GEMM kernel here")
        return Numerics(bf16, "bfloat16 asked for")
    if not usable:
        return Numerics(f32, "no bfloat16 GEMM kernel on this machine (needs AVX512-BF16 and a compiler)")
    amx = gemm.amx_supported()
    if not probe:
        if amx:
            return Numerics(bf16, "AMX bfloat16 tiles (not probed)")
        return Numerics(f32, "AVX512-BF16 without AMX, not probed: float32")
    speedup = probe_bf16_speedup(layer_weights)
    kind = "AMX tiles" if amx else "AVX512-BF16"
    if speedup >= MIN_SPEEDUP:
        return Numerics(bf16, f"bfloat16 GEMMs on {kind} measured {speedup:.2f}x float32 on this model's shapes")
    return Numerics(f32, f"bfloat16 GEMMs on {kind} measured only {speedup:.2f}x float32 here")
