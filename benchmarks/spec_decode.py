"""Speculative decoding, each proposer against none, in one invocation.

1. One request at a time on an input-copying workload (``data/spec_copy_prompts.json``: passages
   rewritten with one change, code edits, quotations; chat-templated, greedy): decode tokens per
   second after the first token, summed over the prompts, and whether every output is
   token-identical to no speculation.
2. The shared W64 workload (64 requests at once; ``--skip-w64`` to leave it out): total tokens per
   second, where the cost model should switch speculation off when it does not pay.

Acceptance rate and mean acceptance length (tokens per verified run, the target's own included)
are printed for each run. Absolute speeds drift on shared machines: read the ratios.

    python benchmarks/spec_decode.py                              # none, ngram, suffix; k = 5
    python benchmarks/spec_decode.py --k 3 --methods ngram --skip-w64
    python benchmarks/spec_decode.py --methods draft_model --draft-model PATH --skip-w64
"""

from __future__ import annotations

import argparse
import json
import os

from workload import add_workload_args, load_workload, run_all

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(HERE, "data", "spec_copy_prompts.json")


def make_llm(args: argparse.Namespace, method: str | None, **kw):
    from pagellm import LLM

    spec = None if method is None else {"method": method, "num_speculative_tokens": args.k}
    if method == "draft_model":
        spec["model"] = args.draft_model
    return LLM(args.model, speculative_config=spec, **kw)


def spec_summary(stats) -> str:
    if not stats["spec_num_drafts"]:
        return "no drafts verified" + (f" (cost model off for {stats['spec_steps_off']} steps)"
                                       if stats["spec_steps_off"] else "")
    return (f"acceptance {stats['spec_acceptance_rate']:.2f}, mean acceptance length "
            f"{stats['spec_mean_acceptance_length']:.2f}, {stats['spec_num_drafts']} runs, "
            f"speculation off in {stats['spec_steps_off']} of {stats['steps']} steps")


def single_requests(args: argparse.Namespace, method: str | None) -> tuple[float, list[list[int]], str]:
    """Decode tok/s after the first token over the copying prompts, one request at a time."""
    from pagellm import SamplingParams

    with open(PROMPTS) as f:
        items = json.load(f)["prompts"]
    llm = make_llm(args, method)
    with llm:
        tok = llm.llm_engine.tokenizer
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        prompts = [tok.chat_prompt(it["messages"]) for it in items]
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        tokens, seconds, outs = 0, 0.0, []
        for p in prompts:
            (out,) = llm.generate([p], params, use_tqdm=False)
            m = out.metrics
            n = len(out.outputs[0].token_ids)
            tokens += n - 1
            seconds += m.finished_time - m.first_token_time
            outs.append(out.outputs[0].token_ids)
        summary = spec_summary(llm.llm_engine.get_stats())
    return tokens / seconds, outs, summary


def w64(args: argparse.Namespace, method: str | None) -> tuple[float, str]:
    from pagellm import SamplingParams

    reqs = load_workload(args.workload, args.num_requests)
    llm = make_llm(args, method)
    with llm:
        result = run_all(llm, SamplingParams, reqs, use_tqdm=False)
        summary = spec_summary(llm.llm_engine.get_stats())
    total = sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
    return total / result["wall"], summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--methods", nargs="+", default=["ngram", "suffix"])
    ap.add_argument("--draft-model", default=None, help="with --methods draft_model: its path (default: the "
                    "bundled model drafting for itself, which shows the cost model switching it off)")
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens (the cost model may use fewer)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--skip-w64", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="W64 runs per method, interleaved (best kept)")
    args = ap.parse_args()
    from pagellm.config import resolve_model_source
    from pagellm.kernels.machine import cpu_info

    args.draft_model = args.draft_model or resolve_model_source(None).path

    print(f"machine: {cpu_info().summary()}")
    runs: list[str | None] = [None, *args.methods]
    print(f"\n1. one request at a time, {os.path.basename(PROMPTS)}, greedy, up to {args.max_tokens} tokens")
    base = None
    for method in runs:
        speed, outs, summary = single_requests(args, method)
        if base is None:
            base = (speed, outs)
        same = "identical" if outs == base[1] else "DIFFERENT"
        print(f"  {method or 'none':8s} {speed:7.1f} decode tok/s  {speed / base[0]:5.2f}x  outputs {same}; {summary}")
    if args.skip_w64:
        return
    print(f"\n2. {os.path.basename(args.workload)}, all requests at once, best of {args.repeats} interleaved runs")
    best: dict[str | None, tuple[float, str]] = {}
    for _ in range(args.repeats):  # taking turns: a noisy stretch of the machine hits every method alike
        for method in runs:
            speed, summary = w64(args, method)
            if speed > best.get(method, (0.0, ""))[0]:
                best[method] = (speed, summary)
    for method in runs:
        speed, summary = best[method]
        print(f"  {method or 'none':8s} {speed:7.1f} total tok/s   {speed / best[None][0]:5.2f}x  {summary}")


if __name__ == "__main__":
    main()
