"""The tensor-parallel group one worker belongs to, passed to the model explicitly (no global state).

A group of size 1 makes every collective the identity, so the single-worker path runs exactly the
same operations it ran before tensor parallelism existed.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from pagellm.distributed import shm_allreduce
from pagellm.distributed.shm_allreduce import ShmAllReduce


def shard_range(total: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, size)`` of ``rank``'s share of ``total`` units, as even as possible (the first
    ``total % world_size`` ranks take one unit more). Uneven shares are what let SmolLM2's 3 KV
    heads run on 2 ranks."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, base + (rank < extra)


class TensorParallelGroup:
    """Rank, size and the two collectives tensor parallelism needs (sum and concatenation)."""

    def __init__(self, rank: int = 0, world_size: int = 1, shm: ShmAllReduce | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.shm = shm  # ranks on one machine sum through shared memory instead of loopback TCP

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and returns the tokens; the other ranks only compute."""
        return self.rank == 0

    def shard(self, total: int) -> tuple[int, int]:
        return shard_range(total, self.world_size, self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place."""
        if self.world_size > 1:
            if self.shm is not None and self.shm.usable_for(x):
                return self.shm.all_reduce(x)
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate each rank's ``x`` along the last dimension; ``sizes[r]`` is rank ``r``'s width
        (uneven shares are padded to the widest for the collective, then trimmed)."""
        if self.world_size == 1:
            return x
        width = max(sizes)
        if x.shape[-1] < width:
            x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        x = x.contiguous()
        if self.shm is not None and self.shm.usable_for(x):
            parts = list(self.shm.all_gather(x))
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)


def init_tensor_parallel(rank: int, world_size: int, init_method: str | None, device: torch.device,
                         timeout_s: float = 600.0) -> TensorParallelGroup:
    """Join the process group (gloo on CPU, nccl on CUDA) when ``world_size > 1``; CPU ranks that
    share a machine also map a shared-memory segment for their all-reduces."""
    if world_size == 1:
        return TensorParallelGroup()
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    shm = shm_allreduce.maybe_create(rank, world_size) if device.type == "cpu" else None
    return TensorParallelGroup(rank, world_size, shm)
