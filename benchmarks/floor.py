"""The fastest a workload could run on this machine with float32 weights: a lower bound on its wall time.

Measured in the same run: this machine's GEMM peak at the model's shapes (the best rate of MKL
and pagellm's packed kernel, ``roofline.gemm_peak``, at 64 and at 2048 rows) and its streaming
read bandwidth with every thread. Counted from the workload:

- layer GEMM FLOPs of every prompt token computed, at the GEMM peak;
- decode steps: as many as the longest request's output, every request decoding from the first
  step on; a step takes its GEMM FLOPs (layers and LM head) at the peak or its float32 weights'
  bytes at the measured bandwidth, whichever is longer (a small batch still streams every weight);
- prefill attention FLOPs (query x key pairs, at the GEMM peak);
- decode K/V bytes: each decode step reads its sequence's whole context once, at the measured
  bandwidth. With prefix caching, the tokens a request finds cached are free (shared blocks stay
  in cache) and are not recomputed; hits are counted as the ideal chain of full 16-token blocks
  any earlier request already holds.

Nothing else costs anything (norms, rotary, SiLU, sampling, scheduling, first-touch page faults),
and every part is assumed to reach its peak at once, so a run at this machine's measured rates
cannot beat the floor; the ratio of a measured wall to it is how much is left. With ``--run``
the workload also runs through pagellm (prefix caching on, the default) in the same process.

    python benchmarks/floor.py                      # W64
    python benchmarks/floor.py --run
    python benchmarks/floor.py --workload ../shared/bench/workload_prefix384_n64_seed1.json
"""

from __future__ import annotations

import argparse
import os
import time

from roofline import gemm_peak, model_shapes

from workload import add_workload_args, load_workload, run_all

BLOCK = 16  # tokens per block when counting ideal prefix-cache hits


def stream_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Best bytes/s of summing a ``gib`` GiB float32 tensor with every torch thread (pages touched first)."""
    import torch

    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def ideal_hits(prompts: list[list[int]]) -> list[int]:
    """Tokens each prompt finds cached if every full block of every earlier prompt is still
    cached: the longest chain of its leading full blocks seen before, leaving at least its
    last token to compute (as the scheduler does)."""
    seen: set[tuple[int, ...]] = set()
    hits = []
    for p in prompts:
        n = 0
        while (n + 1) * BLOCK <= len(p) - 1 and tuple(p[:(n + 1) * BLOCK]) in seen:
            n += 1
        hits.append(n * BLOCK)
        seen.update(tuple(p[:(i + 1) * BLOCK]) for i in range(len(p) // BLOCK))
    return hits


def floor_seconds(reqs: list[dict], hits: list[int], dims: dict, peak: float, bandwidth: float) -> dict[str, float]:
    """Seconds of each part of the floor (see the module docstring)."""
    prefill = pairs = kv_tokens = 0
    for r, c in zip(reqs, hits, strict=True):
        p, m = len(r["prompt_token_ids"]), r["max_tokens"]
        prefill += p - c
        pairs += sum(range(c + 1, p + 1))  # each computed prompt token attends to itself and all before it
        kv_tokens += sum(p + t - c for t in range(1, m))  # the context each decode step reads, minus cached prefix
    layer = 2 * dims["layer_weights"] * dims["layers"]
    head = 2 * dims["lm_head"]
    weight_bytes = 4 * (dims["layer_weights"] * dims["layers"] + dims["lm_head"])
    lens = [r["max_tokens"] for r in reqs]
    decode = 0.0
    for t in range(max(lens)):  # step t samples token t of every request still running
        rows = sum(m > t for m in lens)
        decode += max((rows * (layer if t else 0) + rows * head) / peak, weight_bytes / bandwidth)
    return {
        "prefill GEMMs": prefill * layer / peak,
        "decode GEMMs": decode,
        "prefill attention": 4 * dims["q_heads"] * dims["head_dim"] * dims["layers"] * pairs / peak,
        "decode K/V reads": kv_tokens * dims["kv_bytes_per_token"] / bandwidth,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--run", action="store_true", help="also run the workload through pagellm and compare")
    args = ap.parse_args()

    import torch

    from pagellm import LLM, SamplingParams
    from pagellm.kernels import gemm

    llm = LLM(args.model)
    model = llm.llm_engine.executor.worker.model
    shapes, dims = model_shapes(model)
    packed = (False, True) if gemm.usable(torch.zeros(1, 1)) else (False,)
    peak = max(gemm_peak(shapes, m, torch.float32, p, repeats=7) for m in (64, 2048) for p in packed) * 1e9
    bandwidth = stream_bandwidth()
    print(f"this machine, {torch.get_num_threads()} threads: float32 GEMM peak {peak / 1e9:.1f} GFLOP/s, "
          f"streaming read {bandwidth / 1e9:.1f} GB/s")

    reqs = load_workload(args.workload, args.num_requests)
    n_tokens = sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
    cached = ideal_hits([r["prompt_token_ids"] for r in reqs])
    floors = {"prefix caching off": floor_seconds(reqs, [0] * len(reqs), dims, peak, bandwidth)}
    if any(cached):
        floors["prefix caching on"] = floor_seconds(reqs, cached, dims, peak, bandwidth)
    print(f"\n{os.path.basename(args.workload)}: {len(reqs)} requests, {n_tokens} tokens; "
          f"ideal prefix-cache hits {sum(cached)} tokens")
    names = list(next(iter(floors.values())))
    print(f"{'floor, seconds':18s}" + "".join(f"{k:>20s}" for k in floors))
    for name in names:
        print(f"{name:18s}" + "".join(f"{f[name]:20.2f}" for f in floors.values()))
    walls = {k: sum(f.values()) for k, f in floors.items()}
    print(f"{'wall':18s}" + "".join(f"{w:20.2f}" for w in walls.values()))
    print(f"{'total tok/s':18s}" + "".join(f"{n_tokens / w:20.1f}" for w in walls.values()))
    if len(walls) == 2:
        print(f"floor ratio off / on: {walls['prefix caching off'] / walls['prefix caching on']:.2f}x")
    if args.run:
        got = run_all(llm, SamplingParams, reqs)
        best = walls.get("prefix caching on", walls["prefix caching off"])
        print(f"\npagellm (prefix caching on): wall {got['wall']:.1f} s, {n_tokens / got['wall']:.1f} total tok/s, "
              f"{got['wall'] / best:.2f}x its floor")


if __name__ == "__main__":
    main()
