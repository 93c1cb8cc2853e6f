"""The int8 kernel's K-quant formats (K4: Q4_K, K6: Q6_K) at a model's projection shapes, against an
older version of ``kernels/gemm_int8.c`` in the same process (same packed layout), interleaved.

One "pass" is the layer's projections in one format, each with its own weight (so weights stream from
memory as in a step): fused qkv, o, gate_up and down for SmolLM2-1.7B's shapes by default. Random
K-quant bytes with valid scales (speed does not depend on the values); best of ``--repeats``; the
ratio is the baseline's time over the current kernel's, with GOP/s as 2 x rows x in x out a second.

    mkdir -p /tmp/old && cp pagellm/kernels/*.h /tmp/old/   # (the headers it includes)
    git show REV:pagellm/kernels/gemm_int8.c > /tmp/old/gemm_int8.c
    python benchmarks/gemm_kquant.py --baseline-source /tmp/old/gemm_int8.c --rows 1 4 16 64 256
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from pagellm import kernels
from pagellm.kernels import gemm_int8
from pagellm.kernels.machine import cpu_info
from pagellm.quantization.gguf_quant import GGUFBlocks, kquant_fields

FORMATS = {"K4": (T.Q4_K, gemm_int8.K4), "K6": (T.Q6_K, gemm_int8.K6)}


def random_kquant(qtype: T, n: int, k: int, rng: np.random.Generator) -> GGUFBlocks:
    """Random bytes with every half-precision scale finite (d last in Q6_K, d and dmin first in Q4_K)."""
    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    f16 = rng.uniform(1e-3, 1e-1, (data.shape[0], 2)).astype(np.float16).view(np.uint8).reshape(-1, 2, 2)
    if qtype == T.Q6_K:
        data[:, size - 2:] = f16[:, 0]
    else:
        data[:, 0:2], data[:, 2:4] = f16[:, 0], f16[:, 1]
    return GGUFBlocks(data.reshape(n, -1), qtype, (n, k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-source", required=True, metavar="FILE.c")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 32], metavar=("Q", "KV"))
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"# machine: {cpu_info().summary()}; kernel path {gemm_int8.isa()}")
    base = kernels.build_source(args.baseline_source, gemm_int8.SIGNATURES)
    cur = kernels.load("gemm_int8", gemm_int8.SIGNATURES)
    assert cur is not None
    h, hd = args.hidden, args.hidden // args.heads[0]
    shapes = [((args.heads[0] + 2 * args.heads[1]) * hd, h), (h, args.heads[0] * hd), (2 * args.intermediate, h),
              (h, args.intermediate)]
    rng = np.random.default_rng(0)
    print(f"{'format':>6} {'rows':>5} {'kernel ms':>10} {'GOP/s':>7} {'baseline ms':>12} {'GOP/s':>7} "
          f"{'baseline / kernel':>18}")
    for name, (qtype, fmt) in FORMATS.items():
        weights = [gemm_int8.pack_kquant(*kquant_fields(random_kquant(qtype, n, k, rng)), fmt) for n, k in shapes]
        for m in args.rows:
            xs = [torch.randn(m, k) for _, k in shapes]
            ys = [torch.empty(m, n) for n, _ in shapes]

            def run(lib, xs=xs, ys=ys, m=m, weights=weights, fmt=fmt) -> None:
                for (n, k), w, x, y in zip(shapes, weights, xs, ys, strict=True):
                    lib.gemm_packed_i8(y.data_ptr(), n, x.data_ptr(), k, w.data_ptr(), None, m, n, k, fmt)
            best = {"kernel": float("inf"), "baseline": float("inf")}
            for lib in (cur, base):  # warm-up
                run(lib)
            for _ in range(args.repeats):
                for label, lib in (("kernel", cur), ("baseline", base)):
                    t = time.perf_counter()
                    run(lib)
                    best[label] = min(best[label], time.perf_counter() - t)
            ops = sum(2 * m * n * k for n, k in shapes)
            a, b = best["kernel"], best["baseline"]
            print(f"{name:>6} {m:5d} {a * 1e3:10.2f} {ops / a / 1e9:7.0f} {b * 1e3:12.2f} {ops / b / 1e9:7.0f} "
                  f"{b / a:17.2f}x", flush=True)


if __name__ == "__main__":
    main()
