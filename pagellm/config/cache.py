"""Paged KV cache geometry and budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pagellm.utils import parse_size

KVCacheDType = Literal["auto", "float32", "bfloat16", "float16", "int8"]  # "auto": chosen per machine (worker)
DEFAULT_KV_CACHE_MEMORY = "2GiB"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache geometry: block size and how many blocks (a byte budget or an explicit count)."""

    block_size: int = 16
    kv_cache_memory: int = parse_size(DEFAULT_KV_CACHE_MEMORY)
    # The budget is the default, not the user's: no more blocks than max_num_seqs sequences of
    # max_model_len tokens can fill (a small model's short context needs far less than 2 GiB), and
    # on a CPU its pages fault in as blocks are first written (a named budget is reserved at start-up).
    size_to_model: bool = False
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # CPU swap pool for preemption by swap, in GiB (vLLM's ``--swap-space``); 0 = no swapping.
    # None: as large as the device KV cache, at most 4 GiB (more could never be swapped out at once).
    swap_space: float | None = None
    num_cpu_blocks_override: int | None = None
    # Element type of the cached K/V; "auto" = the model's dtype, or float16 with faster CPU GEMMs
    # (the worker decides). A 16-bit cache under a float32 model halves the bytes decode
    # attention reads (and doubles the blocks), int8 with its per-row scale takes 0.53x of 16 bits.
    kv_cache_dtype: KVCacheDType = "auto"
    # On a CUDA device without kv_cache_memory (vLLM's): the share of the device's memory the
    # weights, a step's activations and the KV cache may take; the KV cache gets the rest.
    gpu_memory_utilization: float = 0.9
    # vLLM's flag: one block table for every layer, even where a sliding window cannot read
    # (the KV cache layout before layer groups; for comparisons and as a way out).
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in get_args(KVCacheDType):
            raise ValueError(f"kv_cache_dtype must be one of {get_args(KVCacheDType)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.swap_space is not None and not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 (GiB), got {self.swap_space}")
        if self.num_cpu_blocks_override is not None and self.num_cpu_blocks_override < 0:
            raise ValueError(f"num_cpu_blocks_override must be >= 0, got {self.num_cpu_blocks_override}")
