"""How the CPU defaults were chosen: W64 through pagellm under several block sizes and token
budgets, each in its own process, with the current defaults run first and last (the spread
between those two runs is the machine's noise in this invocation).

    python benchmarks/sweep_defaults.py
    python benchmarks/sweep_defaults.py --num-requests 32
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = {"block-size": 16, "max-num-batched-tokens": 2048, "max-num-seqs": 256}
VARIANTS = [
    {"block-size": 32},
    {"block-size": 64},
    {"block-size": 8},
    {"max-num-batched-tokens": 1024},
    {"max-num-batched-tokens": 4096},
    {"max-num-seqs": 32},
]


def run(config: dict, num_requests: int | None) -> float:
    cmd = [sys.executable, os.path.join(HERE, "throughput.py"), "--skip-hf", "--quiet"]
    cmd += [f"--{k}={v}" for k, v in config.items()]
    if num_requests:
        cmd += ["--num-requests", str(num_requests)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    m = re.search(r"^pagellm[^:\n]*: ([\d.]+) total tok/s", out, re.M)
    if m is None:
        raise RuntimeError(f"no throughput line in:\n{out}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=None)
    args = ap.parse_args()
    rows = [("defaults (first)", DEFAULT)] + [(", ".join(f"{k}={v}" for k, v in var.items()), {**DEFAULT, **var})
                                             for var in VARIANTS] + [("defaults (last)", DEFAULT)]
    results = []
    for name, config in rows:
        tok_s = run(config, args.num_requests)
        results.append((name, tok_s))
        print(f"{name:32s} {tok_s:8.1f} total tok/s", flush=True)
    base = (results[0][1] + results[-1][1]) / 2
    print(f"\n{'configuration':32s} {'total tok/s':>11s} {'vs defaults':>11s}")
    for name, tok_s in results:
        print(f"{name:32s} {tok_s:11.1f} {tok_s / base:10.2f}x")


if __name__ == "__main__":
    main()
