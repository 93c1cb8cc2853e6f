"""Run a workload through vLLM and print one JSON line of results. Runs inside vLLM's own venv.

``compare.py --vllm-venv DIR`` starts this file with ``DIR/bin/python``; it imports nothing from
pagellm (vLLM's venv does not have it). Throughput mode generates every request in one
``LLM.generate`` call; latency mode runs them one at a time and reports time to first token
(a 1-token request) and decode speed.

    vllm-venv/bin/python benchmarks/vllm_runner.py --model HF_DIR --workload W.json --mode throughput
"""

from __future__ import annotations

import argparse
import json
import os
import time

T_START = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a Hugging Face directory (vLLM cannot read the GGUF)")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--mode", choices=("throughput", "latency"), default="throughput")
    ap.add_argument("--latency-requests", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

    from vllm import LLM, SamplingParams

    with open(args.workload) as f:
        reqs = json.load(f)["requests"]
    reqs = reqs[: args.num_requests] if args.num_requests else reqs
    llm = LLM(model=args.model, dtype="bfloat16", seed=0)
    startup = time.perf_counter() - T_START
    result: dict = {"engine": "vLLM CPU (bfloat16)", "startup": startup}
    if args.mode == "throughput":
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
        params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        result["wall"] = time.perf_counter() - t0
        result["out"] = sum(len(o.outputs[0].token_ids) for o in outs)
        result["first_tokens"] = [list(o.outputs[0].token_ids[:8]) for o in outs[:2]]
    else:
        ttft, decode = [], []
        for r in reqs[: args.latency_requests]:
            prompt = {"prompt_token_ids": r["prompt_token_ids"]}
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
            ttft.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True),
                               use_tqdm=False)
            dt = time.perf_counter() - t0
            n = len(out[0].outputs[0].token_ids)
            decode.append((n - 1) / max(dt - ttft[-1], 1e-9))
        result["ttft"] = sorted(ttft)[len(ttft) // 2]
        result["decode_tok_s"] = sorted(decode)[len(decode) // 2]
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
