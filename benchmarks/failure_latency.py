"""How fast a tensor-parallel engine fails when a worker is killed mid-generation.

    python benchmarks/failure_latency.py                  # mp, then ray, bundled SmolLM2, TP 2

Starts a long greedy generation, SIGKILLs rank 1 after a few engine steps and prints the time
from the kill to ``EngineDeadError`` in the caller, then the time ``shutdown`` takes.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time


def measure(backend: str, model: str | None) -> None:
    from pagellm import LLM, SamplingParams
    from pagellm.engine.protocol import EngineDeadError

    llm = LLM(model, tensor_parallel_size=2, distributed_executor_backend=backend, kv_cache_memory="256MiB")
    engine = llm.llm_engine
    victim = engine.executor.worker_pids()[1]
    killed_at: list[float] = []

    def kill() -> None:
        while engine.stats["steps"] < 3:
            time.sleep(0.005)
        killed_at.append(time.monotonic())
        os.kill(victim, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    try:
        llm.generate([[5, 6, 7, i] for i in range(8)], SamplingParams(max_tokens=4000, ignore_eos=True),
                     use_tqdm=False)
        print(f"{backend}: generation finished before the kill")
    except EngineDeadError as e:
        print(f"{backend}: EngineDeadError {1000 * (time.monotonic() - killed_at[0]):.0f} ms after SIGKILL "
              f"({str(e)[:100]})")
    t0 = time.monotonic()
    llm.shutdown()
    print(f"{backend}: shutdown {1000 * (time.monotonic() - t0):.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backends", nargs="+", default=["mp", "ray"])
    args = ap.parse_args()
    for backend in args.backends:
        try:
            measure(backend, args.model)
        except ImportError as e:
            print(f"{backend}: skipped ({e})")


if __name__ == "__main__":
    main()
