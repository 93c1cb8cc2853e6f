"""Random sampling: the CPU sampling kernel (``kernels/sampling.c``) against the PyTorch path.

1. The sampler alone: 64 rows of SmolLM2's 49,152-token vocabulary, temperature only, top-p,
   top-k, and all filters at once; best of ``--repeats`` interleaved runs, ratio to PyTorch.
2. W64 sampled (``--temperature 0.7 --top-p 0.9`` by default, EOS ignored so both runs make the
   same number of tokens) through ``LLM.generate``: the PyTorch draw, then the kernel, in one
   process (the same loaded model, prefix caching off; the kernel turned off for the baseline run).

    python benchmarks/sampling.py
    python benchmarks/sampling.py --skip-workload --rows 1 8 64
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

from workload import add_workload_args, interleaved_best, load_workload

FILTERS = {
    "temperature 1.0": {"temperature": 1.0},
    "top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "top-k 50": {"temperature": 0.7, "top_k": 50},
    "top-k 100, top-p 0.95, min-p 0.05": {"temperature": 0.8, "top_k": 100, "top_p": 0.95, "min_p": 0.05},
}


def sampler_alone(rows: int, vocab: int, repeats: int) -> None:
    import torch

    from pagellm.sampling.sampler import SamplingRow, draw_cpu, draw_native, greedy_and_lse_cpu, sample
    from pagellm.sampling_params import SamplingParams

    # Logits shaped like a language model's: a few likely tokens over a long tail.
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 2.5
    print(f"sampler alone, {rows} rows x {vocab} logits (best of {repeats}, interleaved):")
    for name, kw in FILTERS.items():
        params = [SamplingRow(SamplingParams(max_tokens=16, **kw), [1], [2], None) for _ in range(rows)]
        best = interleaved_best({d.__name__: (lambda d=d, p=params: sample(logits, p, greedy_and_lse_cpu, d))
                                 for d in (draw_native, draw_cpu)}, repeats)
        print(f"  {name:36s} PyTorch {best['draw_native'] * 1e3:8.2f} ms   kernel {best['draw_cpu'] * 1e3:7.2f} ms"
              f"   {best['draw_native'] / best['draw_cpu']:6.1f}x")


def workload_sampled(args: argparse.Namespace) -> None:
    from pagellm import LLM, SamplingParams
    from pagellm.sampling import sampler as sampler_module

    reqs = load_workload(args.workload, args.num_requests)
    # No prefix caching: the second run would otherwise find every prompt cached by the first.
    llm = LLM(model=args.model, enable_prefix_caching=False) if args.model else LLM(enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=r["max_tokens"],
                             ignore_eos=True, seed=i) for i, r in enumerate(reqs)]
    tokens = sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up: kernels built, pages touched
    rates = {}
    for name, kernel_on in (("PyTorch draw", False), ("sampling kernel", True)):
        with mock.patch.object(sampler_module.sampling, "available", return_value=kernel_on):
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            rates[name] = tokens / (time.perf_counter() - t0)
    print(f"\n{len(reqs)} requests sampled (temperature {args.temperature}, top-p {args.top_p}), total tok/s:")
    for name, rate in rates.items():
        print(f"  {name:16s} {rate:8.1f}   {rate / rates['PyTorch draw']:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--rows", type=int, nargs="+", default=[64])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--skip-workload", action="store_true", help="only the sampler alone")
    args = ap.parse_args()
    for rows in args.rows:
        sampler_alone(rows, args.vocab, args.repeats)
    if not args.skip_workload:
        workload_sampled(args)


if __name__ == "__main__":
    main()
