"""The step trace: what every engine step did and why, as Chrome Trace Event JSON.

Off by default and then free (the engine holds ``None``; the scheduler records no decisions).
On (``trace_out=FILE`` / ``--trace-out FILE``, ``LLM(trace=...)``), each step adds to a bounded
ring buffer of events (the oldest are dropped first):

- ``X`` slices on the "steps" track: the step (its counts and the reason each waiting request was
  left out, in ``args``), and inside it schedule, prepare inputs, forward, sample, outputs;
- ``C`` counters: queues (waiting, running, swapped), KV blocks (used, free, cached), KV use %,
  tokens (prefill, decode, token budget left) and batch size;
- ``i`` instants: admit (prefix-hit tokens), preempt (recompute or swap), swap in, finish (reason),
  abort;
- per request, an async track (``b`` / ``e`` by request id): queued, prefill, decode, from arrival
  to finish (a preempted request goes back to queued).

Open the file in Perfetto (ui.perfetto.dev) or ``chrome://tracing``, or render it offline with
``pagellm trace FILE.json -o FILE.html``. Times are microseconds since the tracer started.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.core.step_decisions import StepDecisions
from pagellm.metrics import SchedulerStats

logger = logging.getLogger(__name__)

PID, STEP_TID = 1, 1
DEFAULT_MAX_EVENTS = 500_000


@dataclass(slots=True)
class StepTimes:
    """Wall-clock points and durations of one step (``perf_counter`` seconds)."""

    start: float
    schedule: float
    submitted: float
    prepare: float
    forward: float
    sample: float
    model_done: float
    end: float


@dataclass(slots=True)
class KVState:
    num_blocks: int
    free: int
    cached: int  # blocks holding a prefix-cache hash (in use or evictable)


class StepTracer:
    """Collects the trace events of an engine's steps (see the module docstring)."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS, path: str | None = None) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self.path = path
        self.t0 = time.perf_counter()
        self.steps = 0
        self._phase: dict[str, str] = {}  # request id -> its open async phase
        self._meta = [
            {"ph": "M", "pid": PID, "name": "process_name", "args": {"name": "pagellm engine"}},
            {"ph": "M", "pid": PID, "tid": STEP_TID, "name": "thread_name", "args": {"name": "steps"}},
        ]

    def _us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 1)

    def _async(self, ph: str, rid: str, name: str, ts: float, args: dict[str, Any] | None = None) -> None:
        ev = {"ph": ph, "cat": "request", "name": name, "id": rid, "pid": PID, "ts": ts}
        if args:
            ev["args"] = args
        self.events.append(ev)

    def _enter(self, rid: str, phase: str, ts: float) -> None:
        old = self._phase.get(rid)
        if old == phase:
            return
        if old is not None:
            self._async("e", rid, old, ts)
        self._async("b", rid, phase, ts)
        self._phase[rid] = phase

    def _instant(self, name: str, ts: float, args: dict[str, Any]) -> None:
        self.events.append({"ph": "i", "s": "t", "name": name, "pid": PID, "tid": STEP_TID, "ts": ts, "args": args})

    # ------------------------------------------------------------------ requests
    def request_added(self, request_id: str, num_prompt_tokens: int) -> None:
        ts = self._us(time.perf_counter())
        self._async("b", request_id, "request", ts, {"prompt_tokens": num_prompt_tokens})
        self._enter(request_id, "queued", ts)

    def request_finished(self, request_id: str, reason: str | None, num_output_tokens: int) -> None:
        if request_id not in self._phase:
            return
        ts = self._us(time.perf_counter())
        name = "abort" if reason == "abort" else "finish"
        self._instant(name, ts, {"request": request_id, "reason": reason, "output_tokens": num_output_tokens})
        self._async("e", request_id, self._phase.pop(request_id), ts)
        self._async("e", request_id, "request", ts, {"finish_reason": reason, "output_tokens": num_output_tokens})

    # ------------------------------------------------------------------ steps
    def record_step(self, times: StepTimes, so: SchedulerOutput, decisions: StepDecisions | None,
                    stats: SchedulerStats, kv: KVState, max_num_batched_tokens: int) -> dict[str, Any]:
        """One step's slices, counters, instants and request phases; returns the step's summary
        (the per-step log line prints it)."""
        self.steps += 1
        summary = summarize_step(self.steps, so, decisions, stats, kv, max_num_batched_tokens)
        prefill, decode = summary["prefill_tokens"], summary["decode_tokens"]
        d = decisions or StepDecisions()
        ts = self._us(times.start)
        ev = self.events.append
        ev({"ph": "X", "name": f"step {self.steps}", "cat": "step", "pid": PID, "tid": STEP_TID, "ts": ts,
            "dur": self._us(times.end) - ts, "args": summary})
        t_fwd = times.submitted + times.prepare
        t_sample = t_fwd + times.forward
        for name, a, b in (("schedule", times.start, times.start + times.schedule),
                           ("prepare inputs", times.submitted, t_fwd), ("forward", t_fwd, t_sample),
                           ("sample", t_sample, t_sample + times.sample), ("outputs", times.model_done, times.end)):
            ev({"ph": "X", "name": name, "cat": "phase", "pid": PID, "tid": STEP_TID, "ts": self._us(a),
                "dur": max(self._us(b) - self._us(a), 0.0)})
        counters = {
            "queues": {"waiting": stats.num_waiting, "running": stats.num_running, "swapped": stats.num_swapped},
            "kv blocks": {"used": kv.num_blocks - kv.free, "free": kv.free, "cached": kv.cached},
            "kv usage %": {"kv": summary["kv_usage"]},
            "tokens": {"prefill": prefill, "decode": decode, "budget left": max_num_batched_tokens - prefill - decode},
            "batch size": {"sequences": len(so.scheduled)},
        }
        for name, args in counters.items():
            ev({"ph": "C", "name": name, "pid": PID, "ts": ts, "args": args})
        for rid, hit in d.admitted:
            self._instant("admit", ts, {"request": rid, "prefix_hit_tokens": hit})
            self._enter(rid, "prefill", ts)
        for rid, mode in d.preempted:
            self._instant("preempt", ts, {"request": rid, "mode": mode})
            self._enter(rid, "queued", ts)
        for rid in d.swapped_in:
            self._instant("swap in", ts, {"request": rid})
            self._enter(rid, "prefill", ts)
        end = self._us(times.end)
        for s in so.scheduled:
            if s.do_sample and self._phase.get(s.request_id) == "prefill":
                self._enter(s.request_id, "decode", end)
        return summary

    # ------------------------------------------------------------------ output
    def to_json(self) -> dict[str, Any]:
        """The buffer as a Chrome Trace Event document."""
        return {"traceEvents": self._meta + list(self.events), "displayTimeUnit": "ms",
                "otherData": {"producer": "pagellm", "steps": self.steps,
                              "dropped_oldest": len(self.events) == self.events.maxlen}}

    def write(self, path: str | None = None) -> str | None:
        """Write the buffer to ``path`` (default: the file it was created for); returns the path."""
        path = path or self.path
        return None if path is None else write_trace_json(self.to_json(), path)


def write_trace_json(trace: dict[str, Any], path: str) -> str:
    """Write a trace document atomically (a reader never sees half a file); returns ``path``."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    os.replace(tmp, path)
    logger.info("step trace: %d events -> %s", len(trace["traceEvents"]), path)
    return path


def summarize_step(step: int, so: SchedulerOutput, decisions: StepDecisions | None, stats: SchedulerStats,
                   kv: KVState, max_num_batched_tokens: int) -> dict[str, Any]:
    """One step's counts (the trace's step ``args`` and the per-step log line)."""
    prefill = sum(s.num_scheduled_tokens for s in so.scheduled if not (s.is_decode or s.spec_token_ids))
    d = decisions or StepDecisions()
    return {
        "step": step, "running": stats.num_running, "waiting": stats.num_waiting, "swapped": stats.num_swapped,
        "batch_size": len(so.scheduled), "prefill_tokens": prefill,
        "decode_tokens": sum(s.num_scheduled_tokens for s in so.scheduled) - prefill,
        "token_budget": max_num_batched_tokens, "kv_usage": round(100 * stats.kv_cache_usage, 2),
        "free_blocks": kv.free, "cached_blocks": kv.cached, "admitted": len(d.admitted),
        "preempted": len(d.preempted), "swapped_in": len(d.swapped_in), "left_out": dict(d.left_out),
        "images_encoded": len(so.encoder_inputs),
    }


def step_log_line(s: dict[str, Any], times: StepTimes) -> str:
    """The per-step log line (``--log-step-details``), SGLang's batch line in pagellm's words."""
    left = s["left_out"]
    reasons = ""
    if left:
        counts: dict[str, int] = {}
        for r in left.values():
            counts[r] = counts.get(r, 0) + 1
        reasons = " (" + ", ".join(f"{n} {r}" for r, n in counts.items()) + ")"
    return (f"step {s['step']}: batch {s['batch_size']} seqs, prefill {s['prefill_tokens']} + decode "
            f"{s['decode_tokens']} tokens of {s['token_budget']}; running {s['running']}, waiting "
            f"{s['waiting']}{reasons}, swapped {s['swapped']}; KV {s['kv_usage']:.1f}% (free {s['free_blocks']}, "
            f"cached {s['cached_blocks']}); admitted {s['admitted']}, preempted {s['preempted']}, swapped in "
            f"{s['swapped_in']}; {1e3 * (times.end - times.start):.1f} ms (schedule {1e3 * times.schedule:.2f}, "
            f"forward {1e3 * times.forward:.1f}, outputs {1e3 * (times.end - times.model_done):.2f})")
