"""Parallel sampling through shared blocks (one request, n = 4) vs the same work as 4 independent
requests, in the same run: generated tokens per second and peak KV blocks in use.

The independent requests run with prefix caching on (vLLM V1's fan-out: requests admitted in
the same step cannot hit each other's blocks yet) and off (no sharing at all).

    python benchmarks/parallel_sampling.py                     # 16 prompts of the shared W64 workload
    python benchmarks/parallel_sampling.py --num-prompts 8 --n 8
"""

from __future__ import annotations

import argparse
import time

from workload import W64 as DEFAULT_WORKLOAD
from workload import load_workload


def run(reqs: list[dict], n: int, grouped: bool, caching: bool, args: argparse.Namespace) -> dict:
    from pagellm import LLMEngine, SamplingParams
    from pagellm.config import EngineArgs

    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, enable_prefix_caching=caching,
                                                   kv_cache_memory=args.kv_cache_memory))
    kv = engine.kv_cache_manager
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        prompt = {"prompt_token_ids": r["prompt_token_ids"]}
        if grouped:
            engine.add_request(str(i), prompt, SamplingParams(temperature=0.8, seed=i, n=n,
                                                              max_tokens=r["max_tokens"], ignore_eos=True))
        else:
            for j in range(n):
                engine.add_request(f"{i}-{j}", prompt, SamplingParams(temperature=0.8, seed=i * 1000 + j,
                                                                      max_tokens=r["max_tokens"], ignore_eos=True))
    peak = 0
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += sum(len(c.token_ids) for c in out.outputs)
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
    wall = time.perf_counter() - t0
    return {"wall": wall, "generated": generated, "peak_blocks": peak, "block_size": kv.block_size,
            "preemptions": engine.scheduler.num_preemptions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default=DEFAULT_WORKLOAD)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    args = ap.parse_args()
    reqs = load_workload(args.workload, args.num_prompts)
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    print(f"{len(reqs)} prompts ({n_in} prompt tokens), n = {args.n}, "
          f"{args.n * sum(r['max_tokens'] for r in reqs)} tokens to generate, temperature 0.8")
    k = args.n
    rows = [(f"n={k}, shared blocks", run(reqs, k, True, True, args)),
            (f"{k} independent, prefix cache on", run(reqs, k, False, True, args)),
            (f"{k} independent, prefix cache off", run(reqs, k, False, False, args))]
    print(f"\n{'mode':34s} {'gen tok/s':>10s} {'wall s':>8s} {'peak blocks':>12s} {'preemptions':>12s}")
    for name, r in rows:
        print(f"{name:34s} {r['generated'] / r['wall']:10.1f} {r['wall']:8.1f} {r['peak_blocks']:12d} "
              f"{r['preemptions']:12d}")
    base = rows[0][1]
    for name, r in rows[1:]:
        print(f"shared vs {name}: throughput {r['wall'] / base['wall']:.2f}x, "
              f"peak blocks {base['peak_blocks'] / r['peak_blocks']:.2f} of theirs")


if __name__ == "__main__":
    main()
