"""Many concurrent streaming clients against a running server, a share of them hanging up at random
points: is every request accounted for, and is the engine idle with every KV block free afterwards?

Each client streams a completion of exactly ``--max-tokens`` tokens (greedy, ``ignore_eos``); a
random ``--disconnect`` share of them closes its connection after a random number of chunks. A
request that was not aborted must end with ``finish_reason == "length"`` and exactly ``--max-tokens``
tokens (usage from the stream); anything else is *lost*. Afterwards the server's ``/metrics`` must
show no running or waiting request and a KV cache usage of 0.

    pagellm serve &                                      # or any pagellm server
    python benchmarks/server_load.py --clients 256 --disconnect 0.3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import time


async def client(http, url: str, i: int, args: argparse.Namespace, rng: random.Random) -> tuple[str, float, int]:
    """('completed' | 'aborted' | 'lost: why', TTFT seconds or -1, output tokens)."""
    from pagellm.entrypoints.bench_serve import stream_request

    leave_at = rng.randint(1, args.max_tokens - 1) if rng.random() < args.disconnect else None
    body = {"prompt": f"Request {i}: tell me about paged attention.", "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    r = await stream_request(http, url, body, {}, leave_after=leave_at)
    ttft = r.ttft if r.success or r.aborted else -1.0
    if r.aborted:
        return "aborted", ttft, r.output_tokens
    if r.error:
        return f"lost: {r.error[:80]}", ttft, r.output_tokens
    if r.finish_reason == "length" and r.output_tokens == args.max_tokens:
        return "completed", ttft, r.output_tokens
    return f"lost: finish {r.finish_reason!r}, {r.output_tokens} tokens", ttft, r.output_tokens


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


async def main_async(args: argparse.Namespace) -> int:
    from pagellm.entrypoints.bench_serve import client_session

    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with client_session(args.base_url, headers) as http:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(client(http, "/v1/completions", i, args, rng) for i in range(args.clients)))
        wall = time.perf_counter() - t0
        deadline = time.monotonic() + 30
        while True:  # aborts land within a step; give the engine a moment
            async with http.get("/metrics") as resp:
                text = await resp.text()
            running = metric(text, "pagellm:num_requests_running") + metric(text, "pagellm:num_requests_waiting")
            usage = metric(text, "pagellm:kv_cache_usage_perc")
            if (running == 0 and usage == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    kinds = [r[0] for r in results]
    lost = [k for k in kinds if k.startswith("lost")]
    ttfts = sorted(r[1] for r in results if r[1] >= 0)
    pct = (lambda p: ttfts[min(len(ttfts) - 1, int(p / 100 * len(ttfts)))] * 1000) if ttfts else (lambda p: 0.0)
    print(f"{args.clients} streaming clients, {args.disconnect:.0%} hanging up at random, {args.max_tokens} tokens "
          f"each, {wall:.1f} s")
    print(f"sent {len(results)}  completed {kinds.count('completed')}  aborted {kinds.count('aborted')}  "
          f"lost {len(lost)}")
    print(f"TTFT p50 {pct(50):.0f} ms, p99 {pct(99):.0f} ms")
    print(f"afterwards: running + waiting {running:.0f}, KV cache usage {usage:.4f}")
    for k in sorted(set(lost))[:5]:
        print("  ", k)
    return 0 if not lost and running == 0 and usage == 0 else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--disconnect", type=float, default=0.3, help="share of clients that hang up early")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    raise SystemExit(asyncio.run(main_async(ap.parse_args())))


if __name__ == "__main__":
    main()
