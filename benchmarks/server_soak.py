"""A steady request rate against a running server for a long time: does memory or latency creep?

Poisson arrivals at ``--rate`` for ``--minutes``; every request streams (``pagellm bench serve``'s
client, ``ignore_eos``, random prompts so the prefix cache does not serve them). Every ``--window``
seconds it prints the window's completed / failed requests, TTFT and ITL p50 / p99, and the
resident memory of the server process and its children (the engine core). At the end: RSS growth
after the warm-up window and the first-vs-last window latencies.

    pagellm serve & python benchmarks/server_soak.py --pid $! --minutes 20 --rate 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from typing import Any


def rss_kib(pid: int) -> int:
    """Resident KiB of ``pid`` and its direct children (0 for a process that is gone)."""
    pids = [pid] + [int(e) for e in os.listdir("/proc") if e.isdigit() and _ppid(int(e)) == pid]
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return total


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))] * 1000


async def main_async(args: argparse.Namespace) -> None:
    from pagellm.entrypoints.bench_serve import RequestResult, client_session, stream_request

    rng = random.Random(args.seed)
    url = args.base_url.rstrip("/") + "/v1/completions"
    results: list[tuple[float, RequestResult]] = []  # (finish time, result)
    tasks: set[asyncio.Task] = set()
    start = time.perf_counter()
    end = start + args.minutes * 60

    async def one(client: Any) -> None:
        payload = {"prompt": [rng.randrange(1000, 20000) for _ in range(args.input_len)],
                   "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}}
        r = await stream_request(client, url, payload, {})
        results.append((time.perf_counter(), r))

    windows = []
    async with client_session() as client:
        next_window = start + args.window
        while time.perf_counter() < end:
            await asyncio.sleep(rng.expovariate(args.rate))
            task = asyncio.create_task(one(client))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            now = time.perf_counter()
            if now >= next_window:
                done = [r for t, r in results if next_window - args.window <= t < next_window]
                ok = [r for r in done if r.success]
                row = (len(windows) + 1, len(ok), len(done) - len(ok), pct([r.ttft for r in ok], 50),
                       pct([r.ttft for r in ok], 99), pct([x for r in ok for x in r.itl], 50),
                       pct([x for r in ok for x in r.itl], 99), rss_kib(args.pid) / 1024 if args.pid else 0.0)
                windows.append(row)
                n, good, bad, t50, t99, i50, i99, rss = row
                print(f"window {n:3d}: completed {good:4d} failed {bad:2d}  TTFT p50 {t50:6.0f} p99 {t99:6.0f} ms  "
                      f"ITL p50 {i50:5.1f} p99 {i99:6.1f} ms  RSS {rss:7.1f} MiB", flush=True)
                next_window += args.window
        await asyncio.gather(*tasks)
    failed = sum(not r.success for _, r in results)
    print(f"\n{len(results)} requests in {args.minutes} min at {args.rate}/s: {failed} failed")
    if len(windows) >= 3 and args.pid:
        base, last = windows[1], windows[-1]  # after the warm-up window
        growth = 100 * (last[7] / base[7] - 1)
        print(f"RSS after warm-up {base[7]:.1f} MiB, at the end {last[7]:.1f} MiB: {growth:+.1f} %")
        print(f"TTFT p50 window 2 {base[3]:.0f} ms, last {last[3]:.0f} ms; ITL p99 {base[6]:.1f} -> {last[6]:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--pid", type=int, default=None, help="the server's pid (its children are counted too)")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--window", type=float, default=60.0, help="seconds per reported window")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
