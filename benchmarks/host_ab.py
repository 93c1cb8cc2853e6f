"""Host time per step before and after a change, interleaved in one invocation.

Runs this tree's ``time_breakdown.py`` over a baseline commit's package (a ``git worktree``
outside the checkout) and over this tree's, taking turns, so a noisy stretch of the machine hits
both alike; prints each side's median host time per decode-heavy step at each load and its total
throughput. ``--host-only`` (the script's mode of three timers: the host is the step's wall time
less the model's) is the one to trust; without it the split (schedule + prepare + output) is
shown, whose many timers add their own cost to the host::

    python benchmarks/host_ab.py --baseline 9996544                 # batch 1 and W64, 3 rounds
    python benchmarks/host_ab.py --baseline HEAD~3 --candidate HEAD --num-requests 1 --rounds 5
    python benchmarks/host_ab.py --baseline 9996544 --host-only --candidate-args="--num-scheduler-steps 8"
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from workload import W64  # noqa: E402 - (this tree's workload, for both sides)


def worktree(ref: str) -> str:
    """A checkout of ``ref`` beside the temp dir's others (made once per commit)."""
    commit = subprocess.check_output(["git", "-C", ROOT, "rev-parse", ref], text=True).strip()
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pagellm-{commit[:12]}")
    if not os.path.isdir(path):
        subprocess.check_call(["git", "-C", ROOT, "worktree", "add", "--detach", path, commit],
                              stdout=subprocess.DEVNULL)
    return path


def run(tree: str, num_requests: int | None, host_only: bool, extra: list[str]) -> tuple[float, list[float], float]:
    """One ``time_breakdown.py`` run over ``tree``'s package: (host ms per decode-heavy step, its three
    parts or zeros, tok/s)."""
    cmd = [sys.executable, os.path.join(HERE, "time_breakdown.py"), "--workload", W64, *extra]
    if num_requests:
        cmd += ["--num-requests", str(num_requests)]
    if host_only:
        cmd += ["--host-only"]
    env = dict(os.environ, PYTHONPATH=tree)  # (ahead of the venv's editable install)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    if host_only:
        m = re.search(r"decode-heavy\s+([\d.]+)\s+\(of", out)
        tps = re.search(r"([\d.]+) total tok/s", out)
        if m is None or tps is None:
            raise RuntimeError(f"no host row in:\n{out}")
        return float(m.group(1)), [0.0, 0.0, 0.0], float(tps.group(1))
    m = re.search(r"decode-heavy\s+([\d.]+)\s+\(([\d.]+) \+ ([\d.]+) \+ ([\d.]+)\)", out)
    tps = re.search(r"([\d.]+) total tok/s", out)
    if m is None or tps is None:
        raise RuntimeError(f"no host row in:\n{out}")
    return float(m.group(1)), [float(x) for x in m.groups()[1:]], float(tps.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the commit (or ref) to compare against")
    ap.add_argument("--candidate", default=None,
                    help="a commit to run instead of this tree (a checkout of its own: edits here cannot leak in)")
    ap.add_argument("--num-requests", type=int, nargs="*", default=[1, 0],
                    help="loads to run: N requests of W64 (0: all 64)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--candidate-args", default="",
                    help="time_breakdown.py flags for this tree's runs only (e.g. --num-scheduler-steps 8)")
    ap.add_argument("--verbose", action="store_true", help="print every run")
    ap.add_argument("--host-only", action="store_true", help="three timers: host = step wall less the model's")
    args = ap.parse_args()
    sides = {"baseline": worktree(args.baseline), "this tree": worktree(args.candidate) if args.candidate else ROOT}
    for n in args.num_requests:
        results: dict[str, list[tuple[float, list[float], float]]] = {k: [] for k in sides}
        for _ in range(args.rounds):
            for name, tree in sides.items():
                extra = args.candidate_args.split() if name == "this tree" else []
                results[name].append(run(tree, n or None, args.host_only, extra))
                if args.verbose:
                    print(name, results[name][-1], flush=True)
        print(f"\n{n or 64} request(s), median of {args.rounds} interleaved rounds:")
        med = {}
        for name, rows in results.items():
            host = statistics.median(r[0] for r in rows)
            parts = [statistics.median(r[1][i] for r in rows) for i in range(3)]
            tps = statistics.median(r[2] for r in rows)
            med[name] = (host, tps)
            print(f"  {name:10s} host/step {host:6.3f} ms ({' + '.join(f'{p:.3f}' for p in parts)})"
                  f"   {tps:8.1f} tok/s")
        (hb, tb), (ht, tt) = med["baseline"], med["this tree"]
        print(f"  host time per step: {hb / ht:.2f}x less; throughput {tt / tb:.2f}x")


if __name__ == "__main__":
    main()
