"""KV memory and speed of a sliding-window model with and without the hybrid KV cache manager, in
one invocation: one request of ``--context`` tokens, then ``--new-tokens`` decoded; the most KV
bytes held at once (blocks in use x a block's bytes), the prefill's tokens/s and the decode's.

    python benchmarks/sliding_window_kv.py --shape gemma3-270m --context 8192,32768 \
        [--llama-bench ../peers/build-native/bin/llama-bench]

The model is scale.py's random-weight Q4_K_M file in the shape's real sizes (built once, cached).
Each layout runs in a fresh process, both in this invocation (compare their ratio, not the rates
across invocations: the machine line is printed first). With ``--llama-bench`` (llama.cpp's, built
outside this tree) the same file in llama.cpp too: its K/V for a context of that many tokens plus
the new ones (the sizes its own log prints; sliding layers keep their window, its default) and its
decode rate at that depth (``-d``, flash attention on).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def child(path: str, context: int, new_tokens: int, engine_args: dict) -> dict:
    import numpy as np

    from pagellm import EngineArgs, LLMEngine, SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model=path, max_model_len=context + new_tokens + 16,
                                                   kv_cache_memory="3GiB", **engine_args))
    kv = engine.kv_cache_manager
    ids = np.random.default_rng(0).integers(100, 40000, context).tolist()
    engine.add_request("r", {"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    peak, t0, first = 0, time.perf_counter(), None
    while engine.has_unfinished_requests():
        outs = engine.step()
        if first is None and outs and outs[0].outputs[0].token_ids:
            first = time.perf_counter()
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
    end = time.perf_counter()
    assert first is not None
    return {"kv_mib": peak * engine.model_info.block_bytes / 2**20, "prefill_tok_s": context / (first - t0),
            "decode_tok_s": (new_tokens - 1) / (end - first), "groups": len(kv.specs)}


def llama_cpp(binary: str, path: str, context: int, new_tokens: int, threads: int) -> dict:
    """llama.cpp's K/V MiB (the sum of its caches' logged sizes) and decode tok/s at ``context``."""
    run = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", "0", "-n", str(new_tokens),
                          "-d", str(context), "-fa", "1", "-r", "1", "-o", "json", "-v"],
                         capture_output=True, text=True, check=True)
    sizes = [float(m) for m in re.findall(r"llama_kv_cache: size = +([0-9.]+) MiB", run.stderr)]
    # (-v: one cache per model context; llama-bench makes one for the run, so the last set is it)
    groups = 2 if "iswa" in run.stderr else 1
    return {"kv_mib": sum(sizes[-groups:]), "decode_tok_s": json.loads(run.stdout)[0]["avg_ts"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="gemma3-270m")
    p.add_argument("--context", default="8192", help="comma-separated prompt lengths")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--llama-bench", help="llama.cpp's llama-bench binary: the same file there too")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(child(spec["path"], spec["context"], args.new_tokens, spec["engine_args"])))
        return
    import scale  # (benchmarks/: builds and caches the shape's GGUF file)

    subprocess.run([sys.executable, os.path.join(HERE, "..", "..", "shared", "bench", "machine_probe.py")], check=False)
    path = scale.build_gguf(args.shape, "q4_k_m")
    print(f"\n| {args.shape} Q4_K_M, context | layout | KV groups | peak KV MiB | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for context in (int(c) for c in args.context.split(",")):
        for name, extra in (("one table", {"disable_hybrid_kv_cache_manager": True}), ("hybrid", {})):
            spec = json.dumps({"path": path, "context": context, "engine_args": extra})
            out = subprocess.run([sys.executable, __file__, "--child", spec, "--new-tokens", str(args.new_tokens)],
                                 check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            print(f"| {context} | {name} | {r['groups']} | {r['kv_mib']:.0f} | {r['prefill_tok_s']:.0f} | "
                  f"{r['decode_tok_s']:.1f} |", flush=True)
        if args.llama_bench:
            r = llama_cpp(args.llama_bench, path, context, args.new_tokens, args.threads)
            print(f"| {context} | llama.cpp (its window per sliding layer) | | {r['kv_mib']:.0f} | | "
                  f"{r['decode_tok_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
