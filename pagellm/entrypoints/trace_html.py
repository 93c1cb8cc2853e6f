"""``pagellm trace FILE.json -o FILE.html``: the step trace as one self-contained web page.

No plotting library: plotly's offline bundle alone is 3.5 MB, and the page needs four small
charts over one time axis, which a hundred lines of SVG-drawing JavaScript do (the page works
offline, from a file, with no CDN). Python reduces the trace to per-step rows, markers and
per-request phases and embeds them as JSON; the script draws:

- queues (waiting, running, swapped) and KV use over time;
- the batch of each step: prefill and decode tokens, stacked;
- preemptions (recompute, swap) and swap-ins as markers;
- one lane per request: queued, prefill, decode, and how it finished;

and a hover line that shows the nearest step's details (counts, admissions, why waiting requests
were left out).
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any


def reduce_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """Per-step rows, markers and request lanes (times in ms) from a Chrome Trace document."""
    steps: list[dict[str, Any]] = []
    markers: list[dict[str, Any]] = []
    open_: dict[Any, Any] = {}
    lanes: dict[Any, Any] = {}
    finish: dict[Any, Any] = {}
    for ev in trace.get("traceEvents", []):
        ph, ts = ev.get("ph"), ev.get("ts", 0.0) / 1e3
        if ph == "X" and ev.get("cat") == "step":
            steps.append({"t": ts, "dur": ev.get("dur", 0.0) / 1e3, "pid": ev.get("pid", 1), **ev.get("args", {})})
        elif ph == "i":
            args = ev.get("args", {})
            if ev["name"] in ("preempt", "swap in"):
                kind = "swap" if args.get("mode") == "swap" else ("swapin" if ev["name"] == "swap in" else "recompute")
                markers.append({"t": ts, "kind": kind, "request": args.get("request")})
            elif ev["name"] in ("finish", "abort"):
                finish[str(args.get("request"))] = args.get("reason")
        elif ph in ("b", "e") and ev.get("cat") == "request" and ev.get("name") != "request":
            key = (str(ev.get("pid", 1)), str(ev["id"]))
            if ph == "b":
                open_[key] = (ev["name"], ts)
            elif key in open_:
                name, start = open_.pop(key)
                lanes.setdefault(key[1], []).append([name, start, ts])
    end = max([s["t"] + s["dur"] for s in steps], default=0.0)
    for (_, rid), (name, start) in open_.items():  # still running when the trace was taken
        lanes.setdefault(rid, []).append([name, start, end])
    # Time 0 is the first step or arrival (an idle server before its first request is not shown).
    t0 = min([s["t"] for s in steps] + [p[1] for ph in lanes.values() for p in ph], default=0.0)
    for s in steps:
        s["t"] -= t0
    for m in markers:
        m["t"] -= t0
    for ph in lanes.values():
        for p in ph:
            p[1], p[2] = p[1] - t0, p[2] - t0
    order = sorted(lanes, key=lambda r: min(p[1] for p in lanes[r]))
    return {"steps": steps, "markers": markers, "end": end - t0,
            "lanes": [{"id": rid, "phases": lanes[rid], "finish": finish.get(rid)} for rid in order]}


_PAGE = "trace_page.html"  # next to this module: the page, its style and its script


def render_html(trace: dict[str, Any]) -> str:
    data = json.dumps(reduce_trace(trace), separators=(",", ":")).replace("</", "<\\/")
    page = files("pagellm.entrypoints").joinpath(_PAGE).read_text()
    return page.replace("__DATA__", data)


def main(trace_path: str, out_path: str) -> None:
    with open(trace_path) as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise SystemExit(f"{trace_path}: not a Chrome Trace document (no traceEvents)")
    with open(out_path, "w") as f:
        f.write(render_html(trace))
    print(f"{out_path}: {len(reduce_trace(trace)['steps'])} steps")
