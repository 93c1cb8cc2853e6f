"""The disk connector as a prefix cache that survives restarts: time to first token of a request
whose 2,048-token prefix an earlier engine computed, with the disk cache vs without, same run.

1. An engine with ``DiskConnector`` serves one request with the prefix (saving its blocks) and
   shuts down.
2. Turns, ``--repeats`` times: a fresh engine with the same store ("after a restart"), and a
   fresh engine without it, each serving one request with the same prefix and a new suffix
   (``max_tokens=1``): TTFT is from ``add_request`` to the first token, start-up excluded.
   Their first tokens are compared as well.

With ``--split``, also the prefill/decode split on loopback against one engine, both served over
HTTP and loaded by ``pagellm bench serve`` with the workload (W64, all requests at once): one
``pagellm serve``, then a prefill server and a decode server (``TcpConnector``, one torch thread
each: they share the machine's cores) behind ``pagellm proxy``. On one small machine the split
cannot win: its point is separate machines for the two phases (docs/kv_transfer.md).

    python benchmarks/kv_transfer.py
    python benchmarks/kv_transfer.py --prefix-tokens 4096 --repeats 3
    python benchmarks/kv_transfer.py --split --skip-restart
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PAGELLM = os.path.join(os.path.dirname(sys.executable), "pagellm")


def one_request(store: str | None, prompt: list[int], args: argparse.Namespace) -> tuple[float, int, dict]:
    from pagellm import LLMEngine, SamplingParams
    from pagellm.config import EngineArgs

    kvt = None if store is None else {"kv_connector": "DiskConnector", "kv_connector_extra_config": {"path": store}}
    eng = LLMEngine.from_engine_args(EngineArgs(model=args.model, kv_transfer_config=kvt, max_model_len=8192))
    try:
        t0 = time.perf_counter()
        eng.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1,
                                                                          ignore_eos=True))
        token = None
        while token is None:
            for out in eng.step():
                if out.outputs[0].token_ids:
                    token = out.outputs[0].token_ids[0]
        ttft = time.perf_counter() - t0
        while eng.has_unfinished_requests():
            eng.step()
        stats = eng.get_stats()
        eng.executor.collective_rpc("kv_wait_for_save")
    finally:
        eng.shutdown()
    return ttft, token, stats


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen([PAGELLM, *args, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagellm {args[0]} exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"pagellm {args[0]} did not become healthy")


def _bench(port: int, workload: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([PAGELLM, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--dataset-path",
                        workload, "--json", f.name, "--quiet"], check=True, stdout=subprocess.DEVNULL)
        return json.load(open(f.name))


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def split(args: argparse.Namespace) -> None:
    model = ["--model", args.model] if args.model else []
    rows = []
    port = _free_port()
    procs = [_start(["serve", *model], port)]
    try:
        rows.append(("one engine (pagellm serve)", _bench(port, args.workload)))
    finally:
        _stop(procs)
    kv, dec, pre, prx = _free_port(), _free_port(), _free_port(), _free_port()
    consumer = json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_consumer",
                           "kv_connector_extra_config": {"port": kv}})
    producer = json.dumps({"kv_connector": "TcpConnector", "kv_role": "kv_producer"})
    procs = []
    try:
        procs.append(_start(["serve", *model, "--num-threads", "1", "--kv-transfer-config", consumer], dec))
        procs.append(_start(["serve", *model, "--num-threads", "1", "--kv-transfer-config", producer], pre))
        procs.append(_start(["proxy", "--prefill", f"http://127.0.0.1:{pre}", "--decode", f"http://127.0.0.1:{dec}",
                             "--decode-kv", f"127.0.0.1:{kv}"], prx))
        rows.append(("prefill + decode engines, pagellm proxy", _bench(prx, args.workload)))
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{dec}/metrics", timeout=10).read().decode()
        counts = {name: sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                            if line.startswith(f"pagellm:{name}_total{{") or line.startswith(f"pagellm:{name}{{"))
                  for name in ("kv_transfer_blocks_loaded", "kv_transfer_load_failures", "prompt_tokens")}
    finally:
        _stop(procs)
    print(f"{os.path.basename(args.workload)}, all requests at once, pagellm bench serve:")
    print(f"{'':42s} {'total tok/s':>11s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} {'failed':>6s}")
    for name, r in rows:
        print(f"{name:42s} {r['total_token_throughput']:11.1f} {r['ttft_ms']['p50']:7.0f}ms "
              f"{r['ttft_ms']['p99']:7.0f}ms {r['tpot_ms']['p50']:7.1f}ms {r['failed']:6d}")
    print(f"decode engine: {counts['kv_transfer_blocks_loaded']:.0f} blocks loaded, "
          f"{counts['kv_transfer_load_failures']:.0f} failed; {counts['prompt_tokens']:.0f} prompt tokens computed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--split", action="store_true", help="also the prefill/decode split vs one engine, over HTTP")
    ap.add_argument("--skip-restart", action="store_true", help="skip the restart (disk cache) measurement")
    ap.add_argument("--workload", default=os.path.join(HERE, "..", "..", "shared", "bench", "workload_n64_seed0.json"))
    args = ap.parse_args()
    from pagellm.kernels.machine import cpu_info

    print(f"machine: {cpu_info().summary()}")
    if not args.skip_restart:
        restart(args)
    if args.split:
        split(args)


def restart(args: argparse.Namespace) -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(args.prefix_tokens)]

    def prompt() -> list[int]:
        return prefix + [rng.randrange(100, 40000) for _ in range(args.suffix_tokens)]

    store = tempfile.mkdtemp(prefix="pagellm-kv-bench-")
    try:
        _, _, stats = one_request(store, prompt(), args)
        print(f"first engine saved {stats['kv_blocks_saved']} blocks, {stats['kv_bytes_saved'] / 2**20:.1f} MiB")
        disk, cold = [], []
        for i in range(args.repeats):
            p = prompt()
            t_disk, tok_disk, s = one_request(store, p, args)
            t_cold, tok_cold, _ = one_request(None, p, args)
            disk.append(t_disk)
            cold.append(t_cold)
            print(f"  round {i + 1}: after a restart with the disk cache {t_disk * 1e3:7.1f} ms "
                  f"(loaded {s['kv_blocks_loaded']} blocks in {s['kv_load_seconds'] * 1e3:.1f} ms), "
                  f"without {t_cold * 1e3:7.1f} ms; first tokens {'equal' if tok_disk == tok_cold else 'DIFFER'}")
        d, c = statistics.median(disk), statistics.median(cold)
        print(f"TTFT, {args.prefix_tokens}-token prefix + {args.suffix_tokens} new tokens, median of {args.repeats}: "
              f"disk cache {d * 1e3:.1f} ms, none {c * 1e3:.1f} ms: {c / d:.2f}x lower")
    finally:
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
