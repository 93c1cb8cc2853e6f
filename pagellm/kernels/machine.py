"""What this CPU can do, and which GEMM numerics a model gets on it (decided once, at start-up).

Machines differ in ways that flip the answer: on one 2-core Xeon with AMX, pagellm's bfloat16 GEMM
on AMX tiles runs 3-5x its float32 kernel at 16-2048 rows (``benchmarks/gemm.py --bf16``); on a
machine with AVX512-BF16 dot products but no AMX the bf16 kernel can be *slower* than float32
(vdpbf16ps issues at the FMA rate there); without either, only float32 is offered. A GGUF
checkpoint (GGUF blocks) can also run int8 GEMMs (``gemm_int8``; AVX512-VNNI, AVX2 or C): on a
2-core EPYC 1.7x the bf16 kernel at 1 row, 1.1x at 2048, while on AMX bf16 tiles may win. So
``auto`` reads the ISA, and where that is not enough, times the candidates once on the model's own
layer shapes (cached per machine and shape under ``~/.cache/pagellm/probe``; the first engine to
need the answer measures it, the others wait for it, so every replica chooses alike).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagellm.config.model import AT_WIDTH
from pagellm.kernels import gemm, gemm_int8
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
    """The GEMM compute dtype chosen for a model, and why (one log line). ``int8``: projections stored
    as GGUF blocks run the int8 kernel (``gemm_int8``); any other weight runs in ``compute_dtype``."""

    compute_dtype: torch.dtype
    reason: str
    int8: bool = False

    @property
    def name(self) -> str:
        return "int8" if self.int8 else str(self.compute_dtype).removeprefix("torch.")


def _time(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _cached_probe(kind: str, weights: list[torch.Tensor], measure: Callable[[], float]) -> float:
    """``measure()`` once per machine, probe ``kind`` and weight shapes, cached on disk. A file lock
    makes concurrent engines (data-parallel replicas, in threads or processes) wait for the first
    one's answer instead of timing each other, so they all choose alike."""
    info = cpu_info()
    shapes = [tuple(w.shape) for w in weights]
    key = json.dumps([kind, info.model, info.flags, shapes, gemm.amx_supported(), gemm_int8.amx(), PROBE_ROWS])
    path = os.path.join(cache_dir("probe"), hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                return float(json.load(f)["speedup"])
        except (OSError, ValueError, KeyError):
            pass
        with torch.inference_mode():
            speedup = measure()
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"speedup": speedup, "key": key}, f)
        os.replace(tmp, path)
    return speedup


def _kernel(w: torch.Tensor, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x w^T`` through the GEMM kernel of ``dtype`` (float32 or bfloat16), ``w`` packed once;
    MKL's ``F.linear`` where this machine has no float32 kernel (what a projection then runs)."""
    n = w.shape[0]
    if dtype == torch.bfloat16:
        p16, amx = gemm.pack_bf16(w), gemm.amx_supported()
        return lambda x: gemm.linear(x, p16, n, bits=16, amx=amx)
    if not gemm.usable(w):
        return lambda x: torch.nn.functional.linear(x, w)
    p32 = gemm.pack(w)
    return lambda x: gemm.linear(x, p32, n)


def probe_bf16_speedup(weights: list[torch.Tensor]) -> float:
    """float32 kernel time / bfloat16 kernel time, summed over ``PROBE_ROWS`` and the given layer
    weights (the model's own shapes), on this machine; measured once per machine and shapes."""

    def measure() -> float:
        t32 = t16 = 0.0
        for w in weights:
            f32, bf16 = _kernel(w, torch.float32), _kernel(w, torch.bfloat16)
            for rows in PROBE_ROWS:
                x = torch.randn(rows, w.shape[1])
                t32 += _time(lambda x=x, k=f32: k(x))
                t16 += _time(lambda x=x, k=bf16: k(x))
        return t32 / t16

    return _cached_probe("bf16", weights, measure)


def probe_int8_speedup(weights: list[torch.Tensor], other: torch.dtype,
                       int8_weights: list[tuple[torch.Tensor, int]] | None = None) -> float:
    """The ``other`` kernel's time (float32 or bfloat16) / the int8 kernel's, per row count of
    ``PROBE_ROWS`` over the given weights (GGUF blocks, or ``int8_weights``: the same weights packed
    from a file's blocks), geometric mean over the row counts: a single stream's decode (1 row)
    counts as much as a batch's; 0.0 if a weight is not GGUF blocks."""
    packed = int8_weights or [p for p in (gemm_int8.pack(w) for w in weights) if p is not None]
    if not weights or len(packed) != len(weights):
        return 0.0

    def measure() -> float:
        others = [_kernel(w, other) for w in weights]
        int8s = [lambda x, p=p, n=w.shape[0]: gemm_int8.linear(x, p[0], p[1], n)
                 for w, p in zip(weights, packed, strict=True)]
        log_sum = 0.0
        for rows in PROBE_ROWS:
            t_other = t_int8 = 0.0
            for w, k_other, k_int8 in zip(weights, others, int8s, strict=True):
                x = torch.randn(rows, w.shape[1])
                t_other += _time(lambda x=x, k=k_other: k(x))
                t_int8 += _time(lambda x=x, k=k_int8: k(x))
            log_sum += math.log(t_other / t_int8)
        return math.exp(log_sum / len(PROBE_ROWS))

    formats = sorted({fmt for _, fmt in packed})
    return _cached_probe(f"int8{formats}-vs-{other}", weights, measure)


def choose_numerics(requested: str, layer_weights: list[torch.Tensor], probe: bool = True,
                    quantization: str | None = None,
                    int8_weights: list[tuple[torch.Tensor, int]] | None = None) -> Numerics:
    """GEMM numerics for a float32 model on this CPU. ``requested`` is the engine's ``dtype``:
    ``float32`` (the exact oracle), ``bfloat16`` (the bf16 kernel if this machine has one), or
    ``auto``: bfloat16 where the kernel exists and measures at least ``MIN_SPEEDUP`` faster on
    ``layer_weights`` (``probe=False``: only where AMX runs it), else float32; and then, if the
    weights are GGUF blocks (a Q4_1 / Q8_0 checkpoint), int8 GEMMs where that kernel measures
    ``MIN_SPEEDUP`` faster still (``probe=False``: never). With ``quantization="gguf"`` int8 is
    asked for: a ``ValueError`` if this machine has no int8 kernel; weights that are not GGUF
    blocks take the dtype chosen as above (``awq`` and ``gptq`` likewise). ``int8_weights``:
    ``layer_weights`` packed from a GGUF file's own blocks (the K types, which no float weight is recognised as)."""
    if quantization in AT_WIDTH:
        if not gemm_int8.supported():
            raise ValueError(f"quantization={quantization!r} needs the int8 GEMM kernel (a C compiler to build it); "
                             f"this machine: {cpu_info().summary()}")
        rest = choose_numerics(requested, layer_weights, probe)
        return Numerics(rest.compute_dtype, f"quantization={quantization!r} asked for (other weights: {rest.reason})",
                        int8=True)
    chosen = _choose_dtype(requested, layer_weights, probe)
    if requested != "auto" or not probe or not gemm_int8.supported():
        return chosen
    speedup = probe_int8_speedup(layer_weights, chosen.compute_dtype, int8_weights)
    if speedup >= MIN_SPEEDUP:
        return Numerics(chosen.compute_dtype, f"GGUF blocks: int8 GEMMs ({gemm_int8.isa()}) measured {speedup:.2f}x "
                        f"{chosen.name} on this model's shapes (geometric mean over {PROBE_ROWS} rows)", int8=True)
    if speedup > 0.0:
        return Numerics(chosen.compute_dtype, f"{chosen.reason}; int8 GEMMs measured only {speedup:.2f}x")
    return chosen


def _choose_dtype(requested: str, layer_weights: list[torch.Tensor], probe: bool) -> Numerics:
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
