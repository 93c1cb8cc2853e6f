"""Tensor-parallel collectives over ``torch.distributed`` (gloo on CPU, nccl on CUDA)."""

from pagellm.distributed.tp_group import TensorParallelGroup, init_tensor_parallel, shard_range

__all__ = ["TensorParallelGroup", "init_tensor_parallel", "shard_range"]
