"""The step trace's cost: W64 with the trace off (the default), on, and with the per-step log
line, runs taken in turns (best of ``--repeats`` each), in one invocation; and, measured directly
(so not lost in the run-to-run noise of whole runs), the time the engine spends recording a step
and what the off path adds (the scheduler's ``record_decisions`` checks), per step.

    python benchmarks/step_trace.py
"""

from __future__ import annotations

import argparse
import logging
import time

from workload import add_workload_args, load_workload, run_all


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from pagellm import LLM, SamplingParams
    from pagellm.kernels.machine import cpu_info

    logging.getLogger("pagellm").setLevel(logging.WARNING)  # the log-line variant formats, not prints
    reqs = load_workload(args.workload, args.num_requests)
    total = sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
    variants = {"trace off": {}, "trace on": {"trace": True}, "log line": {"log_step_details": True}}
    llms = {name: LLM(args.model, **kw) for name, kw in variants.items()}
    recording = [0.0]
    for name in ("trace on", "log line"):
        engine = llms[name].llm_engine
        inner = engine._trace_step

        def timed(*a, _inner=inner, **kw):
            t0 = time.perf_counter()
            _inner(*a, **kw)
            recording[0] += time.perf_counter() - t0
        engine._trace_step = timed
    best = dict.fromkeys(variants, 0.0)
    for _ in range(args.repeats):
        for name, llm in llms.items():
            llm.llm_engine.reset_prefix_cache()
            best[name] = max(best[name], total / run_all(llm, SamplingParams, reqs)["wall"])
    print(f"machine: {cpu_info().summary()}")
    print(f"W64, best of {args.repeats} runs each, taken in turns")
    for name, speed in best.items():
        print(f"  {name:10s} {speed:8.1f} total tok/s  {speed / best['trace off']:5.3f}x")
    trace = llms["trace on"].get_trace()
    print(f"  (the trace holds {len(trace['traceEvents'])} events after {args.repeats} runs)")
    steps = sum(llms[n].llm_engine.iteration_stats.steps for n in ("trace on", "log line"))
    it = llms["trace off"].llm_engine.iteration_stats
    step_s = (it.schedule_seconds + it.model_seconds + it.output_seconds) / it.steps
    print(f"recording a step (trace or log line): {1e6 * recording[0] / steps:.0f} us, "
          f"{100 * recording[0] / steps / step_s:.2f} % of a mean W64 step ({1e3 * step_s:.1f} ms)")
    sched = llms["trace off"].llm_engine.scheduler
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):  # what the off path adds per step: a few attribute tests
        if sched.record_decisions:
            pass
        if sched._decisions is not None:
            pass
    off = (time.perf_counter() - t0) / n * 8  # eight such tests per step at most
    print(f"the off path: {1e9 * off:.0f} ns per step, {100 * off / step_s:.5f} % of a mean step")


if __name__ == "__main__":
    main()
