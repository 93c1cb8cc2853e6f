"""Where the model runs, with how many threads, and CUDA graph sizes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

Device = Literal["auto", "cpu", "cuda"]
CUDA_ONE_GPU = ("device='cuda' runs one GPU: tensor_parallel_size, pipeline_parallel_size and data_parallel_size "
                "> 1 are not supported on CUDA yet")


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """Where the model runs: ``cpu`` (the default here), ``cuda``, or ``auto`` (CUDA when available)."""

    device: Device = "auto"
    num_threads: int | None = None
    # CUDA: decode steps run eagerly (no graphs); the batch sizes graphs are captured for (None:
    # vLLM's defaults up to max_num_seqs).
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(not isinstance(s, int) or s < 1 for s in sizes)):
            raise ValueError(f"cudagraph_capture_sizes must be a list of positive batch sizes, got {list(sizes)}")

    @staticmethod
    def parse_capture_sizes(value: list[int] | str | None) -> tuple[int, ...] | None:
        """``[1, 2, 4]``, or the CLI's ``"1,2,4"`` / ``"[1, 2, 4]"``."""
        if value is None or not isinstance(value, str):
            return None if value is None else tuple(value)
        try:
            return tuple(int(s) for s in value.strip("[] ").split(",") if s.strip())
        except ValueError:
            raise ValueError(f"cudagraph_capture_sizes must be comma-separated integers, got {value!r}") from None


def default_num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
