"""The tensor-parallel group one worker belongs to, passed to the model explicitly (no global state).

A group of size 1 makes every collective the identity, so the single-worker path runs exactly the
same operations it ran before tensor parallelism existed.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

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

    def __init__(self, rank: int = 0, world_size: int = 1, shm: ShmAllReduce | None = None,
                 group: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.shm = shm  # ranks on one machine sum through shared memory instead of loopback TCP
        self.group = group  # the torch.distributed group (None: the default, every rank)

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
            dist.all_reduce(x, group=self.group)
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
            dist.all_gather(parts, x, group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)


class PipelineStage:
    """This worker's place in the pipeline: stage ``stage`` of ``num_stages`` runs layers
    ``layer_range``; it receives the hidden states from the same tensor-parallel rank of the stage
    before and sends its own to the stage after (point-to-point, ``torch.distributed``)."""

    def __init__(self, stage: int = 0, num_stages: int = 1, prev_rank: int = -1, next_rank: int = -1) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        # Seconds spent in send and in recv (waiting for the stage before included): where a
        # stage's step time goes (benchmarks/throughput.py --parallel mp:pp2).
        self.send_seconds = 0.0
        self.recv_seconds = 0.0

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """``(start, end)``: contiguous, as even as possible (earlier stages take the extra layers)."""
        start, size = shard_range(num_layers, self.num_stages, self.stage)
        return start, start + size

    def send(self, tensors: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        for t in tensors:
            dist.send(t.contiguous(), self.next_rank)
        self.send_seconds += time.perf_counter() - t0

    def recv(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        out = []
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(t, self.prev_rank)
            out.append(t)
        self.recv_seconds += time.perf_counter() - t0
        return out


def init_parallel(rank: int, tp_size: int, pp_size: int, init_method: str | None, device: torch.device,
                  timeout_s: float = 600.0) -> tuple[TensorParallelGroup, PipelineStage]:
    """Join the process group (gloo on CPU, nccl on CUDA) when there are several ranks; return the
    tensor-parallel group and pipeline stage of global ``rank`` (``stage * tp_size + tensor
    rank``). Without pipeline stages, CPU ranks that share a machine also map a shared-memory
    segment for their all-reduces."""
    world = tp_size * pp_size
    if world == 1:
        return TensorParallelGroup(), PipelineStage()
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    stage, tp_rank = divmod(rank, tp_size)
    pp = PipelineStage(stage, pp_size, rank - tp_size, rank + tp_size)
    if pp_size == 1:
        shm = shm_allreduce.maybe_create(rank, tp_size) if device.type == "cpu" and tp_size > 1 else None
        return TensorParallelGroup(rank, tp_size, shm), pp
    group = None
    for s in range(pp_size):  # every rank creates every stage's group, in the same order
        g = dist.new_group([s * tp_size + t for t in range(tp_size)])
        if s == stage:
            group = g
    # (The shared-memory all-reduce assumes one group per machine: stages all-reduce over gloo.)
    return TensorParallelGroup(tp_rank, tp_size, None, group), pp
