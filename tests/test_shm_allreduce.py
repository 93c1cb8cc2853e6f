"""The shared-memory all-reduce and all-gather equal gloo's, in every rank, across chunk boundaries and buffer
reuse; and tensor-parallel workers on one machine actually use it."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from conftest import require_cpu_kernel

SIZES = [1, 7, 999, 1000, 1001, 2500, 64 * 576]


def _rank_main(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    from pagellm.distributed.shm_allreduce import ShmAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shm = ShmAllReduce(rank, world, f"pagellm-test-{port}", chunk=1000)
    results, gathered = [], []
    for rep in range(3):  # the same sizes again: both buffers are reused
        for n in SIZES:
            x = torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + 10 * rep + n))
            ref = x.clone()
            dist.all_reduce(ref)
            results.append((shm.all_reduce(x.clone()).numpy(), ref.numpy()))  # numpy: plain pickling
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x)
            gathered.append((shm.all_gather(x).numpy(), torch.stack(parts).numpy()))
    out.put((rank, (results, gathered)))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_shm_all_reduce_and_all_gather_match_gloo_on_every_rank(world):
    from pagellm.distributed import shm_allreduce

    require_cpu_kernel(lambda: shm_allreduce.kernels.load("shm_allreduce", shm_allreduce._SIGNATURES) is not None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    both = dict(out.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    results = {r: both[r][0] for r in both}
    for r in both:
        for shm_gathered, ref in both[r][1]:
            assert (shm_gathered == ref).all()  # a copy: exact
    for i in range(len(results[0])):
        shm0 = torch.from_numpy(results[0][i][0])
        for r in range(world):
            shm, ref = (torch.from_numpy(a) for a in results[r][i])
            assert torch.equal(shm, shm0), "ranks disagree"  # identical everywhere: ranks must not drift
            torch.testing.assert_close(shm, ref, rtol=1e-6, atol=1e-6)
            if world == 2:
                assert torch.equal(shm, ref)  # a + b == b + a exactly


def test_tp_workers_on_one_machine_use_shared_memory(tiny_llama):
    from pagellm import LLM

    with LLM(tiny_llama, tensor_parallel_size=2, kv_cache_memory="16MiB", dtype="float32") as llm:
        info = llm.llm_engine.executor.collective_rpc("parallel_info")
    assert [i["rank"] for i in info] == [0, 1]
    assert all(i["shm_all_reduce"] for i in info)
    assert [i["num_kv_heads"] for i in info] == [1, 1]  # the tiny model's 2 KV heads, one per rank


def test_gloo_fallback_when_disabled(tiny_llama, monkeypatch):
    from pagellm import LLM, SamplingParams

    prompts = [[5, 6, 7, 8], list(range(20, 90))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(tiny_llama, kv_cache_memory="16MiB", dtype="float32") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("PAGELLM_SHM_ALLREDUCE", "0")  # inherited by the worker processes
    with LLM(tiny_llama, tensor_parallel_size=2, kv_cache_memory="16MiB", dtype="float32") as llm:
        assert not any(i["shm_all_reduce"] for i in llm.llm_engine.executor.collective_rpc("parallel_info"))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
