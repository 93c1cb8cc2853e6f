"""A burst of streaming requests through ``pagellm serve`` against the offline engine on the same
requests, in one invocation: how much of its own offline rate the server keeps under a streaming
load, with the default stream interval (by load) and with ``--stream-interval 1`` (every token).

The client is the ``openai`` SDK (``AsyncOpenAI``): ``--streams`` completions at once, each of
``--max-tokens`` tokens (greedy, ``ignore_eos``), prompts the first ``--streams`` of the workload's
token ids. Every round runs the offline engine before and after the servers, and each server's
rate is taken against the mean of the two (a drift linear over the round cancels); the second
offline run over the first is the A/A ratio of the same code, the machine's own noise.

    python benchmarks/stream_burst.py                      # 32 streams x 128 tokens, 3 rounds
    python benchmarks/stream_burst.py --streams 64 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from serve import _free_port, _stop, _wait_healthy

from workload import add_workload_args, load_workload

CLI = [sys.executable, "-c", "from pagellm.entrypoints.cli import main; main()"]


def offline(prompts: list[list[int]], max_tokens: int, model: str | None) -> float:
    """Output tokens per second of ``LLM.generate`` on the prompts (run in this process)."""
    from pagellm import LLM, SamplingParams

    llm = LLM(model=model)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # (warm-up)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


async def burst(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(output tok/s, output tokens) of all prompts streamed at once through the openai client."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id

    async def one(prompt: list[int]) -> int:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    await asyncio.gather(*(one(p) for p in prompts[:2]))  # (warm-up, as offline)
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    return sum(counts) / wall, sum(counts)


def server_run(args: argparse.Namespace, prompts: list[list[int]], extra: list[str], log: str) -> float:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    model = ["--model", args.model] if args.model else []
    with open(log, "ab") as out:
        proc = subprocess.Popen([*CLI, "serve", *model, *extra, "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(proc, url, 180)
        rate, n = asyncio.run(burst(url, prompts, args.max_tokens))
    finally:
        _stop(proc)
    if n != len(prompts) * args.max_tokens:
        raise RuntimeError(f"the server streamed {n} tokens, not {len(prompts) * args.max_tokens}")
    return rate


def offline_run(args: argparse.Namespace) -> float:
    """The offline rate from a fresh process (as the server's engine is fresh)."""
    cmd = [sys.executable, __file__, "--offline-only", "--streams", str(args.streams), "--max-tokens",
           str(args.max_tokens), "--workload", args.workload, *(["--model", args.model] if args.model else [])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--offline-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "pagellm-stream-burst.log"))
    args = ap.parse_args()
    prompts = [r["prompt_token_ids"] for r in load_workload(args.workload, args.streams)]
    if args.offline_only:
        print("RESULT " + json.dumps(offline(prompts, args.max_tokens, args.model)), flush=True)
        return

    from pagellm.kernels.machine import cpu_info

    print(f"machine: {cpu_info().summary()}\n{args.streams} streams x {args.max_tokens} tokens; servers' log: "
          f"{args.log}", flush=True)
    servers = {"by load (default)": [], "--stream-interval 1": ["--stream-interval", "1"]}
    ratios: dict[str, list[float]] = {name: [] for name in servers}
    aa = []
    for i in range(args.rounds):
        before = offline_run(args)
        rates = {name: server_run(args, prompts, extra, args.log) for name, extra in servers.items()}
        after = offline_run(args)
        ref = (before + after) / 2
        aa.append(after / before)
        line = ", ".join(f"{name} {r:.1f} ({r / ref:.2f}x)" for name, r in rates.items())
        print(f"round {i + 1}: offline {before:.1f} / {after:.1f} out tok/s; server {line}", flush=True)
        for name, r in rates.items():
            ratios[name].append(r / ref)
    print(f"\nserver / offline, median of {args.rounds} rounds (offline A/A after/before: "
          f"{', '.join(f'{x:.2f}' for x in aa)}):")
    for name, rs in ratios.items():
        print(f"  {name:22s} {statistics.median(rs):.2f}x   rounds {', '.join(f'{x:.2f}' for x in rs)}")


if __name__ == "__main__":
    main()
