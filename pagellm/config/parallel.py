"""How many workers run the model, and how they are placed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ExecutorBackend = Literal["uni", "mp", "ray"]


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How many workers run the model: ``tensor_parallel_size`` ranks per pipeline stage,
    ``pipeline_parallel_size`` stages (contiguous layers each) per engine replica,
    ``data_parallel_size`` replicas, each rank in-process (``uni``), a local process (``mp``) or a
    Ray actor (``ray``)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: ExecutorBackend = "uni"
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.distributed_executor_backend not in ("uni", "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'uni', 'mp' or 'ray', "
                             f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}, pipeline_parallel_size="
                             f"{self.pipeline_parallel_size} with data_parallel_size={self.data_parallel_size} "
                             "needs workers out of process: distributed_executor_backend 'mp' or 'ray'")

    @property
    def workers_per_engine(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.workers_per_engine * self.data_parallel_size

    @property
    def driver_rank(self) -> int:
        """The rank that samples and answers each step: the last stage's first tensor rank."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @staticmethod
    def default_backend(tensor_parallel_size: int, data_parallel_size: int,
                        pipeline_parallel_size: int = 1) -> ExecutorBackend:
        """vLLM's choice when none is given: in-process for one worker, else local processes."""
        return "uni" if tensor_parallel_size * data_parallel_size * pipeline_parallel_size == 1 else "mp"
