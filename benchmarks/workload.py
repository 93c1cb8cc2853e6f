"""The shared benchmark workloads (``../shared/bench``): where they are and how to load them."""

from __future__ import annotations

import json
import os

BENCH_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "bench")
W64 = os.path.join(BENCH_DIR, "workload_n64_seed0.json")
PREFIX384 = os.path.join(BENCH_DIR, "workload_prefix384_n64_seed1.json")


def load_workload(path: str, n: int | None) -> list[dict]:
    """The first ``n`` requests (all if ``n`` is None) of a workload file."""
    if not os.path.exists(path):
        raise SystemExit(f"workload file not found: {path} (pass --workload PATH)")
    with open(path) as f:
        reqs = json.load(f)["requests"]
    return reqs[:n] if n else reqs
