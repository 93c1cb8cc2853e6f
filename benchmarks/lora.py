"""Multi-LoRA throughput on W64, in one invocation (runs taken in turns, best of ``--repeats``):

1. the base model alone, ``enable_lora=False``;
2. the same requests, all on the base model, with ``enable_lora=True`` and 4 adapters loaded
   (what serving adapters costs the requests that use none);
3. every request on one of 4 adapters (rank ``--rank`` on all 7 projections), 4 device slots.

The adapters are made here with ``peft`` (random, ``init_lora_weights=False``) on Hugging Face's
model of the same weights, and written to a temporary directory.

    python benchmarks/lora.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from throughput import load_hf_model
from workload import add_workload_args, load_workload


def make_adapters(model_path: str | None, out: str, n: int, rank: int) -> list[str]:
    import peft
    import torch

    paths = []
    for i in range(n):
        torch.manual_seed(i)
        base = load_hf_model(model_path, "float32")
        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False,
                              target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"])
        model = peft.get_peft_model(base, cfg)
        for name, p in model.named_parameters():  # small updates: the model still talks
            if "lora_B" in name:
                p.data *= 0.01
        path = os.path.join(out, f"adapter{i}")
        model.save_pretrained(path)
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from pagellm import LLM, LoRARequest, SamplingParams
    from pagellm.kernels.machine import cpu_info

    reqs = load_workload(args.workload, args.num_requests)
    total = sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(make_adapters(args.model, tmp, 4, args.rank))]
        spread = [adapters[i % 4] for i in range(len(reqs))]
        lora_kw = dict(enable_lora=True, max_loras=4, max_lora_rank=args.rank)
        runs = {
            "base model, enable_lora=False": (LLM(args.model), None),
            "base model, 4 adapters loaded": (LLM(args.model, **lora_kw), None),
            "every request on 1 of 4 adapters": (LLM(args.model, **lora_kw), spread),
        }
        for a in adapters:  # registered up front (the second engine too: loaded, never used)
            runs["base model, 4 adapters loaded"][0].llm_engine.add_lora(a)
        best = dict.fromkeys(runs, 0.0)
        for _ in range(args.repeats):
            for name, (llm, loras) in runs.items():
                llm.llm_engine.reset_prefix_cache()
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
                best[name] = max(best[name], total / (time.perf_counter() - t0))
    print(f"machine: {cpu_info().summary()}")
    print(f"{os.path.basename(args.workload)}, best of {args.repeats} runs each, taken in turns; rank {args.rank}")
    base = best["base model, enable_lora=False"]
    for name, speed in best.items():
        print(f"  {name:34s} {speed:8.1f} total tok/s  {speed / base:5.3f}x")


if __name__ == "__main__":
    main()
