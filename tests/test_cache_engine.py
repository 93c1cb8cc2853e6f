"""The KV cache's memory (``worker/cache_engine.py``): faulted in as blocks are first written (a
budget the user names: while the model loads), the swap pool left lazy."""

from __future__ import annotations

import resource
import time

import pytest
import torch

from pagellm.worker.cache_engine import CacheEngine, HostKVMemory, KVCacheSpec


def _minor_faults_writing(t: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_device_cache_and_swap_pool_fault_in_as_they_are_written():
    # 2 layers x K/V x 512 blocks x 16 tokens x 4 heads x 64 floats: 32 MiB, device and swap each.
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    cache = CacheEngine(spec, num_blocks=512, device=torch.device("cpu"), num_cpu_blocks=512)
    before = _rss()
    cache.kv[:, :, :16].fill_(1.0)  # block 0 of every layer's K and V: at most one huge page each
    one_block = _rss() - before
    assert one_block <= 10 * 2**20, f"one block made {one_block} bytes resident"
    # 32 MiB: at least 16 faults on first touch (2 MiB huge pages; 8,192 with 4 KiB ones).
    assert _minor_faults_writing(cache.kv) >= 12
    assert _rss() - before >= 24 * 2**20
    assert _minor_faults_writing(cache.cpu_kv) >= 16


@pytest.mark.parametrize("wait", [True, False])
def test_memory_faulted_in_while_the_model_loads(wait):
    """The worker maps its KV budget before loading the model; a thread faults it in meanwhile.
    Taken after the thread finished or while it runs (then torch faults in the rest): zeroed,
    every page present, shaped as the cache."""
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    memory = HostKVMemory(96 * 2**20)  # (more than the cache: a budget is rounded down to blocks)
    if wait:
        memory._thread.join()
        assert memory._done == memory.nbytes
    before = _rss()
    cache = CacheEngine(spec, num_blocks=512, device=torch.device("cpu"), memory=memory)
    assert cache.kv.shape == (2, 2, 512 * 16, 4, 64) and cache.kv.count_nonzero() == 0
    assert _minor_faults_writing(cache.kv) <= 2
    assert not memory._thread.is_alive()
    if wait:  # the 64 MiB the cache does not use, faulted in meanwhile, go back to the system
        assert before - _rss() > 48 * 2**20


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_memory_smaller_than_the_cache_is_an_error():
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs 33554432 bytes; 1048576 were mapped"):
        CacheEngine(spec, num_blocks=512, device=torch.device("cpu"), memory=HostKVMemory(2**20))


def test_faulting_in_pauses_while_gemms_are_timed():
    memory = HostKVMemory(256 * 2**20)
    with memory.paused():
        done = memory._done
        time.sleep(0.3)  # (a chunk of 64 MiB takes well under this when it runs)
        assert memory._done == done and not memory._busy
    memory._thread.join()
    assert memory._done == memory.nbytes


def test_a_cuda_kv_cache_takes_what_gpu_memory_utilization_leaves(ckpt_root, monkeypatch):
    """vLLM's ``gpu_memory_utilization``: the share of the device, less what is in use once the
    weights are loaded, a step's activations and the 1 GiB margin (the formula written out here);
    nothing left is refused by name. The worker's wiring is checked with the device's memory faked."""
    from pagellm import LLM
    from pagellm.config import EngineArgs
    from pagellm.worker.cache_engine import device_kv_budget

    from conftest import build_tiny_checkpoint

    gib = 2**30
    assert device_kv_budget(80 * gib, 17 * gib, 0.9, gib // 2) == int((72 - 17 - 0.5 - 1) * gib)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2 leaves no memory for the KV cache"):
        device_kv_budget(80 * gib, 17 * gib, 0.2, gib)
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            EngineArgs(gpu_memory_utilization=bad).create_engine_config()
    llm = LLM(build_tiny_checkpoint(ckpt_root, "llama"), dtype="float32", num_gpu_blocks_override=8,
              max_num_batched_tokens=512, max_num_seqs=8, gpu_memory_utilization=0.5)
    worker = llm.llm_engine.executor.worker
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 40 * gib))
    # 512 tokens x (4 x 64 + 3 x 128) float32 values, 8 rows x 49152 float32 logits x 4 copies
    activations = 512 * (4 * 64 + 3 * 128) * 4 + 8 * 49152 * 4 * 4
    assert worker._device_kv_budget() == 20 * gib - 10 * gib - activations - gib
