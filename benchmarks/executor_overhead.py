"""Where the time of an out-of-process step goes: RPC round trip, the step's message, collectives.

    python benchmarks/executor_overhead.py

1. Round trip of an empty call to every worker (``collective_rpc``), ``mp`` and ``ray``, 2 ranks.
2. One W64-sized decode step's message: the whole ``SchedulerOutput`` pickled vs the diff
   (``executor/step_delta.py``) the executors send, and the encoding time.
3. All-reduce latency between 2 local processes at decode and prefill shapes, gloo (loopback
   TCP) and the shared-memory path tensor-parallel ranks on one machine use; a tensor-parallel
   step of SmolLM2 does 61 all-reduces (2 per layer and the embedding) and gathers the logits.
"""

from __future__ import annotations

import os
import pickle
import statistics
import time

HIDDEN = 576
VOCAB = 49152


def rpc_round_trip(backend: str, n: int = 300) -> float:
    from pagellm.config import EngineArgs
    from pagellm.executor import create_executor

    config = EngineArgs(tensor_parallel_size=2, distributed_executor_backend=backend).create_engine_config()
    ex = create_executor(config)
    try:
        for _ in range(20):
            ex.collective_rpc("getpid")
        t0 = time.perf_counter()
        for _ in range(n):
            ex.collective_rpc("getpid")
        return (time.perf_counter() - t0) / n
    finally:
        ex.shutdown()


def step_message() -> tuple[int, int, float]:
    """Bytes of a 64-decode step (prompts ~285 tokens, ~150 generated, block 16) whole and as a diff."""
    from pagellm.core.scheduler_output import ScheduledSequence, SchedulerOutput
    from pagellm.executor.step_delta import StepEncoder
    from pagellm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=300)
    seqs = [ScheduledSequence(f"r{i}", i, [7], 435, list(range(i * 30, i * 30 + 28)), True, params,
                              list(range(150)), list(range(285))) for i in range(64)]
    enc = StepEncoder()
    enc.encode(SchedulerOutput(seqs))  # the first step sends everything
    for s in seqs:
        s.output_token_ids.append(1)
        s.num_computed_tokens += 1
    so = SchedulerOutput(seqs)
    t0 = time.perf_counter()
    for _ in range(100):
        enc.encode(so)
    encode_s = (time.perf_counter() - t0) / 100
    return len(pickle.dumps(so)), len(pickle.dumps(enc.encode(so))), encode_s


def _all_reduce_worker(rank: int, port: int, rows: list[int], out) -> None:
    import torch
    import torch.distributed as dist

    from pagellm.distributed.shm_allreduce import ShmAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shm = ShmAllReduce(rank, 2, f"pagellm-bench-{port}")
    result = {}
    for name, reduce in (("gloo", dist.all_reduce), ("shm", shm.all_reduce)):
        for n in rows:
            x = torch.randn(n, HIDDEN)
            for _ in range(10):
                reduce(x)
            times = []
            for _ in range(100):
                t0 = time.perf_counter()
                reduce(x)
                times.append(time.perf_counter() - t0)
            result[name, n] = statistics.median(times)
    # The logits gather: each rank's half of SmolLM2's 49,152-word vocabulary for 64 sampled rows.
    x = torch.randn(64, VOCAB // 2)
    parts = [torch.empty_like(x) for _ in range(2)]
    for name, gather in (("gloo", lambda: dist.all_gather(parts, x)), ("shm", lambda: shm.all_gather(x))):
        for _ in range(5):
            gather()
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            gather()
            times.append(time.perf_counter() - t0)
        result[name, "gather"] = statistics.median(times)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def all_reduce_latency(rows: list[int]) -> dict[tuple[str, int | str], float]:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_all_reduce_worker, args=(r, port, rows, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join()
    return result


def main() -> None:
    print(f"cores: {os.cpu_count()}")
    for backend in ("mp", "ray"):
        try:
            print(f"{backend}: empty collective_rpc to 2 ranks: {1000 * rpc_round_trip(backend):.3f} ms")
        except ImportError as e:
            print(f"{backend}: skipped ({e})")
    whole, diff, enc = step_message()
    print(f"64-decode step message: whole SchedulerOutput {whole / 1024:.1f} KiB pickled, diff {diff / 1024:.1f} KiB "
          f"({whole / diff:.0f}x smaller), encoded in {1000 * enc:.3f} ms")
    lat = all_reduce_latency([1, 64, 2048])
    for (name, n), t in lat.items():
        if n == "gather":
            print(f"{name} all_gather of logits [64, {VOCAB // 2}] per rank, 2 processes: {1000 * t:.2f} ms per step")
            continue
        print(f"{name} all_reduce [{n}, {HIDDEN}] float32, 2 processes: {1e6 * t:.0f} us "
              f"(x61 per tensor-parallel step: {61 * 1000 * t:.1f} ms)")


if __name__ == "__main__":
    main()
