"""``pagellm bench serve``: load any OpenAI-compatible server (pagellm's, vLLM's) and report what its
clients see, with the metrics and names of ``vllm bench serve``.

Requests stream (SSE) so every token's arrival is timed: TTFT (request sent to first token), ITL
(between tokens), TPOT ((E2E - TTFT) / (output tokens - 1)), E2E latency. Arrivals are a Poisson
process at ``--request-rate`` (seeded) or all at once (``inf``), at most ``--max-concurrency`` in
flight. Prompts come from the shared workload format (``{"requests": [{"prompt_token_ids",
"max_tokens", "prompt_text"}]}``) or are random token ids; ``/v1/completions`` gets token ids,
``/v1/chat/completions`` text (the workload's ``prompt_text``, or random words). Every request asks
for exactly ``max_tokens`` (``ignore_eos``) and for usage in the stream, so token counts are the
server's own.

    pagellm bench serve --base-url http://127.0.0.1:8000 --dataset-path ../shared/bench/workload_n64_seed0.json
    pagellm bench serve --random-input-len 256 --random-output-len 128 --num-prompts 64 --request-rate 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class BenchRequest:
    """One request to send: token ids (completions) or text (chat), and how many tokens to ask for."""

    prompt_token_ids: list[int]
    prompt_text: str
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    """What one request's client saw."""

    success: bool = False
    aborted: bool = False  # the client hung up on purpose (``leave_after``)
    error: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)


def load_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """The first ``--num-prompts`` of the workload file, or that many random prompts (seeded)."""
    if args.dataset_path:
        with open(args.dataset_path) as f:
            reqs = json.load(f)["requests"]
        out = [BenchRequest(r["prompt_token_ids"], r.get("prompt_text") or "", int(r["max_tokens"])) for r in reqs]
        return out[: args.num_prompts] if args.num_prompts else out
    rng = random.Random(args.seed)
    words = ("the", "engine", "pages", "blocks", "of", "keys", "and", "values", "while", "a", "scheduler", "admits",
             "requests", "in", "order", "tokens", "flow", "through", "layers", "cache")
    n = args.num_prompts or 64
    return [BenchRequest([rng.randrange(1000, 20000) for _ in range(args.random_input_len)],
                         " ".join(rng.choice(words) for _ in range(args.random_input_len)), args.random_output_len)
            for _ in range(n)]


def _payload(args: argparse.Namespace, model: str, req: BenchRequest) -> dict[str, Any]:
    common: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
                              "ignore_eos": True, "stream_options": {"include_usage": True}}
    if args.endpoint.endswith("/chat/completions"):
        # OpenAI content parts, as vllm bench serve's openai-chat backend sends them.
        return {**common, "messages": [{"role": "user", "content": [{"type": "text", "text": req.prompt_text}]}]}
    return {**common, "prompt": req.prompt_token_ids}


async def stream_request(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str],
                         leave_after: int | None = None) -> RequestResult:
    """Stream one request over ``client`` (an ``aiohttp.ClientSession``); time its first token and
    every token after. ``leave_after``: hang up after that many token events (a client that goes
    away), marked ``aborted``."""
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text(errors='replace'))[:200]}"
                return result
            chunks = 0
            async for raw in resp.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    result.error = str(msg["error"])[:200]
                    return result
                if msg.get("usage"):
                    result.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                    result.output_tokens = msg["usage"].get("completion_tokens", 0)
                if not msg.get("choices"):  # the usage chunk
                    continue
                # Every chunk with a choice is a token event, empty text included (a token the
                # detokenizer holds back, the chat role chunk): as vllm bench serve counts them.
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
                result.finish_reason = msg["choices"][0].get("finish_reason") or result.finish_reason
                if leave_after is not None and chunks >= leave_after:
                    result.aborted = True  # leaving the block unread closes the connection
                    result.output_tokens = chunks
                    return result
            result.e2el = time.perf_counter() - start
            result.output_tokens = result.output_tokens or chunks
            result.success = chunks > 0
            if not result.success:
                result.error = "no tokens in the stream"
    except Exception as e:  # a reset connection or a timeout is a failed request, not a crashed benchmark
        result.error = f"{type(e).__name__}: {e}"[:200]
    return result


def client_session(base_url: str | None = None, headers: dict[str, str] | None = None,
                   timeout: float = 600.0) -> Any:
    """An ``aiohttp.ClientSession`` for many concurrent streams: no connection cap, one timeout per
    request, lines up to 1 MiB. aiohttp (as vllm bench serve uses) rather than httpx: on W64 the
    client took 0.48 CPU seconds against httpx's 1.83, on a machine whose 2 cores the server needs."""
    import aiohttp

    return aiohttp.ClientSession(base_url=base_url, headers=headers, read_bufsize=2**20,
                                 timeout=aiohttp.ClientTimeout(total=timeout),
                                 connector=aiohttp.TCPConnector(limit=0))


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    ordered = sorted(values)

    def pct(p: float) -> float:  # linear interpolation, as numpy.percentile (vllm bench serve) does
        k = (len(ordered) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(values) * scale, **{f"p{p}": pct(p) * scale for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float, peak_concurrency: int) -> dict[str, Any]:
    """The report: throughput over the whole run, latency percentiles in ms over the successful requests."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "max_concurrent_requests": peak_concurrency,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([t for r in ok for t in r.itl]),
        "e2el_ms": _stats([r.e2el for r in ok]),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Send every request on its arrival schedule; return the summary (and each request's result)."""
    import aiohttp
    from tqdm import tqdm

    requests = load_requests(args)
    if not requests:
        raise ValueError("no requests to send (check --dataset-path / --num-prompts)")
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with client_session(timeout=args.timeout) as client:
        model = args.model
        if model is None:
            try:
                async with client.get(f"{base}/v1/models", headers=headers, raise_for_status=True) as resp:
                    model = (await resp.json())["data"][0]["id"]
            except (aiohttp.ClientError, KeyError, IndexError, ValueError) as e:
                raise ValueError(f"cannot read the model id from {base}/v1/models ({e}); pass --model") from e
        rng = random.Random(args.seed)
        sem = asyncio.Semaphore(args.max_concurrency or len(requests))
        in_flight = peak = 0
        bar = tqdm(total=len(requests), desc="requests", disable=args.quiet)

        async def one(req: BenchRequest) -> RequestResult:
            nonlocal in_flight, peak
            async with sem:
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await stream_request(client, base + args.endpoint, _payload(args, model, req), headers)
                finally:
                    in_flight -= 1
                    bar.update(1)

        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if i and args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    summary = summarize(results, duration, peak)
    summary.update(model=model, base_url=base, endpoint=args.endpoint, request_rate=args.request_rate,
                   max_concurrency=args.max_concurrency, num_prompts=len(requests))
    if args.save_requests:
        summary["requests"] = [asdict(r) for r in results]
    return summary


def format_report(s: dict[str, Any]) -> str:
    """A table in ``vllm bench serve``'s layout."""
    rows = [
        ("Successful requests", f"{s['completed']}"), ("Failed requests", f"{s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"), ("Total input tokens", f"{s['total_input_tokens']}"),
        ("Total generated tokens", f"{s['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}"),
        ("Peak concurrent requests", f"{s['max_concurrent_requests']}"),
    ]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        rows.append((f"-- {title} --", ""))
        name = key.split("_")[0].upper()
        rows += [(f"Mean {name} (ms)", f"{s[key]['mean']:.2f}")]
        rows += [(f"P{p} {name} (ms)", f"{s[key][f'p{p}']:.2f}") for p in PERCENTILES]
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20]
    lines += [f"{k:<44}{v:>22}" if v else k for k, v in rows]
    for err in s["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (loopback; any OpenAI-compatible)")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--model", default=None, help="model id to send (default: the server's first in /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    p.add_argument("--dataset-path", default=None,
                   help="a workload JSON (../shared/bench/workload_n64_seed0.json); default: random prompts")
    p.add_argument("--num-prompts", type=int, default=None, help="requests to send (default: all, or 64 random)")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default=None, metavar="FILE", help="write the summary here")
    p.add_argument("--save-requests", action="store_true", help="include every request's timings in the JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    for name in ("num_prompts", "random_input_len", "random_output_len", "max_concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    summary = asyncio.run(run(args))
    print(format_report(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["completed"] else 1
