"""Offline throughput on the shared workload: pagellm vs Hugging Face ``generate`` in the same run.

Every request is greedy with EOS ignored, so exactly ``max_tokens`` tokens come out of each
engine. HF runs padded static batches (left padding, ``--hf-batch-size`` requests at a time,
each batch generating its longest ``max_tokens``; only the requested tokens are counted).
Absolute numbers drift on shared machines: read the ratio, which is measured in one invocation.

    python benchmarks/throughput.py                       # W64, pagellm float32 vs HF bfloat16
    python benchmarks/throughput.py --num-requests 16 --skip-hf
    python benchmarks/throughput.py --skip-hf --parallel uni mp mp:tp2 ray:tp2 mp:dp2   # executor overheads
    python benchmarks/throughput.py --skip-hf --parallel uni mp:pp2            # pipeline stages
    python benchmarks/throughput.py --skip-hf --parallel uni uni:async         # async scheduling
    python benchmarks/throughput.py --skip-hf --parallel uni uni:async --max-num-seqs 1 --num-requests 8

``--parallel`` runs pagellm once per ``BACKEND[:tpN][:ppN][:dpN]`` (distributed executor backend,
tensor-, pipeline- and data-parallel sizes) and prints each one's ratio to the first, with the extra time
per engine step.
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from workload import add_workload_args, load_workload, run_all


def parse_parallel(spec: str) -> dict:
    """``mp:tp2:pp2:dp1`` -> engine keywords (backend, tensor/pipeline/data-parallel sizes)."""
    backend, *sizes = spec.split(":")
    kw: dict = {"distributed_executor_backend": backend}
    for s in sizes:
        if s == "async":  # the batch queue on one worker (async scheduling)
            kw["async_scheduling"] = True
            continue
        names = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "dp": "data_parallel_size"}
        if s[:2] not in names or not s[2:].isdigit():
            raise SystemExit(f"--parallel {spec!r}: expected BACKEND[:tpN][:ppN][:dpN], e.g. mp:tp2")
        kw[names[s[:2]]] = int(s[2:])
    return kw


def run_pagellm(reqs: list[dict], args: argparse.Namespace, parallel: str = "uni") -> dict:
    from pagellm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
              kv_cache_dtype=args.kv_cache_dtype, **parse_parallel(parallel))
    load = time.perf_counter() - t0
    with llm:
        result = run_all(llm, SamplingParams, reqs, use_tqdm=not args.quiet)
        stats = llm.llm_engine.get_stats()
        name = pagellm_name(llm) + ("" if parallel == "uni" else f" {parallel}")
        pp = parse_parallel(parallel).get("pipeline_parallel_size", 1)
        # Each pipeline stage's first tensor rank: where its step time went.
        tp = parse_parallel(parallel).get("tensor_parallel_size", 1)
        stages = llm.llm_engine.executor.collective_rpc("pipeline_timings")[::tp] if pp > 1 else []
    return {**result, "engine": name, "load": load, "steps": stats["steps"], "preemptions": stats["num_preemptions"],
            "stages": stages}


def pagellm_name(llm) -> str:
    """``pagellm (float32)``: the GEMM numerics, with the K/V cache dtype when it differs and the
    block size when it is not the default."""
    from pagellm.config import CacheConfig

    info = llm.llm_engine.model_info
    kv = info.kv_cache_dtype
    same = kv in ("auto", info.dtype) and info.dtype != "int8"  # (int8 GEMMs say nothing of the cache)
    block = llm.llm_engine.block_size
    default_block = CacheConfig.__dataclass_fields__["block_size"].default
    return (f"pagellm ({info.dtype}{'' if same else f', {kv} KV'}"
            f"{'' if block == default_block else f', block {block}'})")


def load_hf_model(model_path: str | None, dtype_name: str):
    """HF's own model class for the model pagellm loads (same dequantized weights for a GGUF), in eval mode."""
    import torch
    import transformers

    from pagellm.config import resolve_model_source

    src = resolve_model_source(model_path)
    dtype = getattr(torch, dtype_name)
    if src.is_gguf:
        # Recent transformers keep GGUF weights quantized (casting around every matmul) and cannot
        # export them; build HF's own model class from the same dequantized weights instead
        # (tests/test_hf_parity.py shows they equal transformers' GGUF dequantization).
        from pagellm.weights import iter_weights, load_model_config

        config = load_model_config(src)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(dict(iter_weights(src, config)), strict=False)
        assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
        model.tie_weights()
        model = model.to(dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # EOS ignored, like the pagellm run
    return model


def run_hf_batches(model, reqs: list[dict], batch_size: int, quiet: bool = False) -> int:
    """Generate every request greedily in padded static batches; returns the tokens requested."""
    import torch
    from tqdm import tqdm

    pad = 0
    n_out = 0
    batches = [reqs[i:i + batch_size] for i in range(0, len(reqs), batch_size)]
    with torch.inference_mode():
        for batch in tqdm(batches, desc="HF static batches", disable=quiet):
            longest = max(r["prompt_len"] for r in batch)
            ids = torch.full((len(batch), longest), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(batch):
                p = r["prompt_token_ids"]
                ids[i, longest - len(p):] = torch.tensor(p)
                mask[i, longest - len(p):] = 1
            new = max(r["max_tokens"] for r in batch)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                 pad_token_id=pad)
            assert out.shape[1] == longest + new
            n_out += sum(r["max_tokens"] for r in batch)
    return n_out


def run_hf(reqs: list[dict], args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    model = load_hf_model(args.model, args.hf_dtype)
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_out = run_hf_batches(model, reqs, args.hf_batch_size, args.quiet)
    wall = time.perf_counter() - t0
    return {"engine": f"HF generate, static batch {args.hf_batch_size} ({args.hf_dtype})", "wall": wall,
            "load": load, "out": n_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--dtype", default="auto", help="pagellm dtype (auto: float32 or bfloat16 GEMMs, per machine)")
    ap.add_argument("--quantization", default=None, help="gguf: int8 GEMMs over the GGUF blocks")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--hf-dtype", default="bfloat16")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--parallel", nargs="+", default=["uni"], metavar="BACKEND[:tpN][:ppN][:dpN][:async]",
                    help="executor backend (uni, mp, ray) and parallel sizes; one pagellm run per item")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()

    import torch

    reqs = load_workload(args.workload, args.num_requests)
    n_in = sum(r["prompt_len"] for r in reqs)
    print(f"workload: {os.path.basename(args.workload)}, {len(reqs)} requests, {n_in} prompt tokens, "
          f"{sum(r['max_tokens'] for r in reqs)} output tokens; torch threads {torch.get_num_threads()}")
    results = []
    for parallel in args.parallel:
        r = run_pagellm(reqs, args, parallel)
        results.append(r)
        print(f"{r['engine']}: {(n_in + r['out']) / r['wall']:.1f} total tok/s, {r['wall']:.1f} s", flush=True)
    rss_pagellm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if not args.skip_hf:
        results.append(run_hf(reqs, args))
    print(f"\n{'engine':52s} {'output tok/s':>12s} {'total tok/s':>12s} {'wall s':>8s} {'load s':>7s} {'steps':>6s}")
    for r in results:
        print(f"{r['engine']:52s} {r['out'] / r['wall']:12.1f} {(n_in + r['out']) / r['wall']:12.1f} "
              f"{r['wall']:8.1f} {r['load']:7.1f} {r.get('steps', ''):>6}")
    p = results[0]
    print(f"\npagellm: {p['steps']} steps, {p['preemptions']} preemptions, peak RSS {rss_pagellm:.2f} GiB "
          f"(of this process, after the pagellm runs)")
    for r in results[1:len(args.parallel)]:
        if r["first_tokens"] != p["first_tokens"]:
            print(f"WARNING: {r['engine']} generated other tokens than {p['engine']}")
        # Per step only when the steps are the same ones (data-parallel replicas each step apart).
        per_step = f", {1000 * (r['wall'] - p['wall']) / r['steps']:+.1f} ms per step" \
            if r["steps"] == p["steps"] else ""
        print(f"ratio {r['engine']} / {p['engine']} (total tok/s, same run): {p['wall'] / r['wall']:.2f}x{per_step}")
        for t in r.get("stages", []):
            ms = {k: 1000 * t[k] / max(1, t["steps"]) for k in ("step_seconds", "recv_seconds", "send_seconds")}
            busy = ms["step_seconds"] - ms["recv_seconds"] - ms["send_seconds"]
            print(f"  stage {t['stage']}: {t['steps']} steps; per step {ms['step_seconds']:.1f} ms in the runner = "
                  f"{busy:.1f} computing + {ms['recv_seconds']:.1f} waiting for / receiving from the stage before "
                  f"+ {ms['send_seconds']:.1f} sending")
    if not args.skip_hf:
        print(f"ratio pagellm / HF (total tok/s, same run): {results[-1]['wall'] / p['wall']:.2f}x")


if __name__ == "__main__":
    main()
