"""Tensor- and pipeline-parallel collectives over ``torch.distributed`` (gloo on CPU, nccl on CUDA)."""

from pagellm.distributed.tp_group import (
    PipelineStage,
    TensorParallelGroup,
    init_parallel,
    shard_range,
)

__all__ = ["PipelineStage", "TensorParallelGroup", "init_parallel", "shard_range"]
