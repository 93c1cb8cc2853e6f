"""One GGUF file through pagellm and llama.cpp's own ``llama-bench`` in one invocation, each in a fresh
process: decode (tg128), prefill (pp2048), pagellm's W64 total tok/s, and each process's peak RSS,
optionally with one prompt of ``--depth`` tokens (the RSS a long context costs each engine).

pagellm runs through ``scale.py``'s child (tg128 after a 16-token prompt, one 2,048-token prompt's
prefill, W64's requests); llama.cpp is a ``llama-bench`` binary built outside this tree (benchmark
only, never a dependency), both flash-attention settings, 2 threads each by default. Peak RSS is the
kernel's ``ru_maxrss`` of each child process.

    python benchmarks/llama_cpp_side_by_side.py --model ../peers/q35/qwen3.5-2b-q4_k_m.gguf \
        --llama-bench ../peers/build-native/bin/llama-bench --w64 64 --depth 32768

(the file: ``make_random_gguf.py --shape qwen3.5-2b``)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

DEPTH_CHILD = r"""
import json, sys, time
import numpy as np
from pagellm import LLM, SamplingParams
path, depth, kv = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(model=path, max_model_len=depth + 16, **({"kv_cache_memory": kv} if kv else {}))
prompt = np.random.default_rng(2).integers(100, 40000, depth).tolist()
t = time.perf_counter()
llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
print("RESULT " + json.dumps({"pp_depth": depth / (time.perf_counter() - t)}))
"""


def run(cmd: list[str]) -> tuple[str, int, int]:
    """``(stdout, exit status, peak RSS bytes)`` of ``cmd`` run alone (its own ``ru_maxrss``)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        proc.returncode = rc  # (reaped here: Popen must not wait for it again)
        out.seek(0)
        err.seek(0)
        if rc:
            sys.stderr.write(err.read()[-2000:])
        return out.read(), rc, usage.ru_maxrss * 1024


def result(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {"error": "no result"}


def llama_bench(binary: str, model: str, threads: int, extra: list[str]) -> tuple[list[dict], int]:
    out, rc, rss = run([binary, "-m", model, "-t", str(threads), "-o", "json", *extra])
    return (json.loads(out) if rc == 0 else []), rss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a GGUF file both engines read")
    p.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--w64", type=int, default=64, help="W64 requests through pagellm (0: none)")
    p.add_argument("--depth", type=int, default=0, help="also one prompt of this many tokens in each engine")
    p.add_argument("--depth-kv-cache-memory", default="",
                   help="pagellm's KV budget for the --depth prompt (default: the engine's; llama.cpp's n_ctx is "
                        "the prompt's own size)")
    args = p.parse_args()
    probe = subprocess.run([sys.executable, os.path.join(HERE, "..", "..", "shared", "bench", "machine_probe.py")],
                           capture_output=True, text=True, check=False).stdout.splitlines()
    print(probe[0] if probe else "(no machine line)")
    rows = {}
    out, _, rss = run([sys.executable, os.path.join(HERE, "scale.py"), "--child", "pagellm", "--model", args.model,
                       "--w64", str(args.w64)])
    rows["pagellm"] = {**result(out), "peak_rss": rss}
    bench, rss = llama_bench(args.llama_bench, args.model, args.threads, ["-p", "2048", "-n", "128", "-r", "2",
                                                                          "-fa", "0,1"])
    for fa in (0, 1):
        got = {("pp2048" if b["n_prompt"] else "tg128"): b["avg_ts"] for b in bench if int(b["flash_attn"]) == fa}
        rows[f"llama.cpp fa={fa}"] = {**got, "peak_rss": rss}
    if args.depth:
        out, _, rss = run([sys.executable, "-c", DEPTH_CHILD, args.model, str(args.depth), args.depth_kv_cache_memory])
        rows["pagellm"].update(result(out), rss_at_depth=rss)
        bench, rss = llama_bench(args.llama_bench, args.model, args.threads,
                                 ["-p", str(args.depth), "-n", "0", "-r", "1", "-fa", "1"])
        rows["llama.cpp fa=1"].update(pp_depth=bench[0]["avg_ts"] if bench else None, rss_at_depth=rss)
    print(json.dumps(rows, indent=1))
    base = rows["pagellm"]
    for name, r in rows.items():
        if name.startswith("llama.cpp"):
            ratios = {k: round(base[k] / r[k], 2) for k in ("tg128", "pp2048", "pp_depth") if r.get(k) and k in base}
            print(f"pagellm / {name}: {ratios}")


if __name__ == "__main__":
    main()
