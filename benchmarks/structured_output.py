"""Structured output's cost: W64 with every request under a JSON schema against W64 unconstrained,
in one run, per grammar backend; then each backend's compile time and mask time per step.

The schema (an array of at least 200 person objects: strings, bounded integers, enums, booleans)
cannot be complete within any request's ``max_tokens``, so the constrained requests produce
exactly as many tokens as the unconstrained ones (EOS ignored in both) and the two throughputs
compare like for like: the difference is the masks (filling them, applying them) and nothing else.

    python benchmarks/structured_output.py
    python benchmarks/structured_output.py --num-requests 16 --backends guidance
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

from workload import add_workload_args, load_workload

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "active": {"type": "boolean"},
}, "required": ["name", "age", "tags", "active"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 200}


def run(llm, reqs: list[dict], constrained: bool) -> dict:
    from pagellm import SamplingParams
    from pagellm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True, structured_outputs=so)
              for r in reqs]
    if not llm.llm_engine.reset_prefix_cache():  # each run computes every prompt: no hits from the last
        raise RuntimeError("the prefix cache could not be reset (requests still hold blocks)")
    before = llm.llm_engine.get_stats()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.llm_engine.get_stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(r["max_tokens"] for r in reqs), "every request must yield exactly max_tokens"
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    split = {k: after[f"{k}_seconds"] - before[f"{k}_seconds"] for k in ("schedule", "model", "output")}
    return {"wall": wall, "tok_s": (n_in + n_out) / wall, "steps": after["steps"] - before["steps"], "split": split,
            "mask_s": after["grammar_mask_seconds"] - before["grammar_mask_seconds"],
            "outputs": [o.outputs[0].token_ids for o in outs]}


def mask_time_per_step(llm, outputs: list[list[int]], batch: int, steps: int = 64) -> float:
    """Seconds to fill one step's bitmask for ``batch`` sequences, the matchers following real
    outputs (the constrained run's), median over ``steps`` steps."""
    from pagellm.sampling_params import StructuredOutputsParams
    from pagellm.structured_output.backend import allocate_bitmask

    so = llm.llm_engine.structured_outputs
    grammar = so.backend.compile(StructuredOutputsParams(json=SCHEMA))
    seqs = [outputs[i % len(outputs)] for i in range(batch)]
    matchers = [grammar.new_matcher() for _ in seqs]
    bitmask = allocate_bitmask(batch, so.vocab_size)
    times = []
    for t in range(min(steps, min(len(s) for s in seqs))):
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_bitmask(bitmask, i)
        times.append(time.perf_counter() - t0)
        for m, s in zip(matchers, seqs, strict=True):
            assert m.accept_token(s[t])
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--backends", nargs="+", default=None, help="default: guidance, and xgrammar if installed")
    args = ap.parse_args()
    backends = args.backends or ["guidance"] + (["xgrammar"] if importlib.util.find_spec("xgrammar") else [])
    reqs = load_workload(args.workload, args.num_requests)

    from pagellm import LLM
    from pagellm.sampling_params import StructuredOutputsParams

    rows = []
    for backend in backends:
        llm = LLM(args.model, structured_outputs_config={"backend": backend})
        with llm:
            base = run(llm, reqs, constrained=False)
            con = run(llm, reqs, constrained=True)
            base2 = run(llm, reqs, constrained=False)  # the machine's drift within this run
            so = llm.llm_engine.structured_outputs
            t0 = time.perf_counter()
            grammar = so.backend.compile(StructuredOutputsParams(json=SCHEMA))
            matcher = grammar.new_matcher()
            from pagellm.structured_output.backend import allocate_bitmask

            matcher.fill_bitmask(allocate_bitmask(1, so.vocab_size), 0)  # llguidance compiles lazily: count it
            compile_s = time.perf_counter() - t0
            m1 = mask_time_per_step(llm, con["outputs"], 1)
            m64 = mask_time_per_step(llm, con["outputs"], 64)
        plain = (base["tok_s"] + base2["tok_s"]) / 2
        rows.append((backend, plain, con["tok_s"], con["tok_s"] / plain, con["mask_s"] / max(con["steps"], 1),
                     compile_s, m1, m64, abs(base["tok_s"] - base2["tok_s"]) / plain))
        print(f"{backend}: unconstrained {base['tok_s']:.1f} / {base2['tok_s']:.1f}, constrained {con['tok_s']:.1f} "
              f"total tok/s; {con['steps']} steps", flush=True)
        for name, r in (("unconstrained", base), ("constrained", con), ("unconstrained", base2)):
            split = ", ".join(f"{k} {v:.2f}" for k, v in r["split"].items())
            print(f"  {name:13s} step loop seconds: {split} (mask fill {r['mask_s']:.2f}) of {r['wall']:.2f} wall")

    print(f"\nW64 ({len(reqs)} requests), schema {json.dumps(SCHEMA)[:60]}...")
    print(f"{'backend':10s} {'plain tok/s':>11s} {'json tok/s':>10s} {'ratio':>6s} {'mask ms/step':>12s} "
          f"{'compile ms':>10s} {'mask@1 ms':>9s} {'mask@64 ms':>10s} {'drift':>6s}")
    for b, plain, con, ratio, mask_step, comp, m1, m64, drift in rows:
        print(f"{b:10s} {plain:11.1f} {con:10.1f} {ratio:5.2f}x {mask_step * 1e3:12.2f} {comp * 1e3:10.1f} "
              f"{m1 * 1e3:9.3f} {m64 * 1e3:10.2f} {drift:5.1%}")


if __name__ == "__main__":
    main()
