"""The KV cache's memory (``worker/cache_engine.py``): faulted in at start-up, swap pool left lazy."""

from __future__ import annotations

import resource

import torch

from pagellm.worker.cache_engine import CacheEngine, KVCacheSpec


def _minor_faults_writing(t: torch.Tensor) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_device_cache_is_faulted_in_at_start_up_and_swap_pool_is_not():
    # 2 layers x K/V x 512 blocks x 16 tokens x 4 heads x 64 floats: 32 MiB, device and swap each.
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    cache = CacheEngine(spec, num_blocks=512, device=torch.device("cpu"), num_cpu_blocks=512)
    assert cache.kv.count_nonzero() == 0
    # 32 MiB: at least 16 faults on first touch (2 MiB huge pages; 8,192 with 4 KiB ones).
    # The first steps write into pages that are already there (a fault or two is the interpreter's).
    assert _minor_faults_writing(cache.kv) <= 2
    # The swap pool pays on first touch, as it always did.
    assert _minor_faults_writing(cache.cpu_kv) >= 16
