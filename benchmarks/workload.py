"""The shared benchmark workloads (``../shared/bench``): where they are, how to load them, and how
to run them through any engine with vLLM's offline API (``LLM.generate(prompts, params)``, which
pagellm's ``LLM`` shares). Standard library only: vLLM's venv imports this file too.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "bench")
W64 = os.path.join(BENCH_DIR, "workload_n64_seed0.json")
PREFIX384 = os.path.join(BENCH_DIR, "workload_prefix384_n64_seed1.json")


def add_workload_args(ap: Any, default: str = W64, num_requests: int | None = None) -> None:
    """``--workload``, ``--num-requests`` and ``--model``, the flags every pagellm benchmark takes."""
    ap.add_argument("--workload", default=default)
    ap.add_argument("--num-requests", type=int, default=num_requests, help="the first N requests (default: all)"
                    if num_requests is None else f"the first N requests (default: {num_requests})")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct GGUF")


def add_shape_args(ap: Any) -> None:
    """The attention shapes and repeat count of the kernel microbenchmarks (SmolLM2-135M's by default)."""
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("Q", "KV"))
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="best of this many timed runs")


def interleaved_best(steps: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Seconds of each step's fastest of ``repeats`` runs, after one warm-up run each; the steps
    take turns, so a noisy stretch of the machine hits them all alike."""
    for fn in steps.values():
        fn()
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeats):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def attention_step(q: Any, k: Any, v: Any, kv: Any, meta: Any, scale: float) -> Callable[[], None]:
    """The attention microbenchmarks' unit of work: the backend's ``forward`` (K/V write included)
    over every layer of ``kv [layers, 2, slots, Hkv, D]``, with one step's metadata."""

    def step() -> None:
        for layer in range(kv.shape[0]):
            meta.backend.forward(q, k, v, kv[layer, 0], kv[layer, 1], meta, scale)
    return step


def print_step_times(best: dict[str, float], baseline: str, n_layers: int, work: float, unit: str) -> None:
    """One line per step of :func:`interleaved_best`: its time per ``n_layers``-layer step, ``work``
    (bytes or FLOPs) per second in billions of ``unit``, and its speed-up over ``baseline``."""
    width = max(len(name) for name in best)
    for name, secs in best.items():
        print(f"  {name:{width}s} {secs * 1e3:8.1f} ms per {n_layers}-layer step  {work / secs / 1e9:6.1f} {unit}  "
              f"{best[baseline] / secs:5.2f}x")


def load_workload(path: str, n: int | None) -> list[dict]:
    """The first ``n`` requests (all if ``n`` is None) of a workload file."""
    if not os.path.exists(path):
        raise SystemExit(f"workload file not found: {path} (pass --workload PATH)")
    with open(path) as f:
        reqs = json.load(f)["requests"]
    return reqs[:n] if n else reqs


def _prompt(r: dict) -> dict:
    return {"prompt_token_ids": r["prompt_token_ids"]}


def run_all(llm: Any, sampling_params: type, reqs: list[dict], use_tqdm: bool = False) -> dict:
    """Every request in one ``generate`` call, greedy with EOS ignored: wall time, tokens out, and
    the first tokens of two requests (to eyeball that engines agree)."""
    params = [sampling_params(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([_prompt(r) for r in reqs], params, use_tqdm=use_tqdm)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(r["max_tokens"] for r in reqs), "every request must yield exactly max_tokens"
    return {"wall": wall, "out": n_out, "first_tokens": [list(o.outputs[0].token_ids[:8]) for o in outs[:2]]}


def latency(generate_one: Callable[[dict, int], int], reqs: list[dict], n: int) -> dict:
    """Median time to first token and decode tok/s over the first ``n`` requests, one at a time.
    ``generate_one(request, max_tokens)`` returns the number of tokens generated; time to first
    token is a 1-token request, decode speed the rest of the full request."""
    ttft, decode = [], []
    for r in reqs[:n]:
        t0 = time.perf_counter()
        generate_one(r, 1)
        ttft.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = generate_one(r, r["max_tokens"])
        dt = time.perf_counter() - t0
        decode.append((got - 1) / max(dt - ttft[-1], 1e-9))
    return {"ttft": sorted(ttft)[len(ttft) // 2], "decode_tok_s": sorted(decode)[len(decode) // 2]}


def llm_latency(llm: Any, sampling_params: type, reqs: list[dict], n: int) -> dict:
    """:func:`latency` through ``LLM.generate`` (vLLM's API)."""

    def one(r: dict, max_tokens: int) -> int:
        params = sampling_params(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return len(llm.generate([_prompt(r)], params, use_tqdm=False)[0].outputs[0].token_ids)

    return latency(one, reqs, n)
