"""Attention backends, chosen once at start-up (lazy imports keep optional kernels optional).

``"torch"``: kernel-free paged attention in PyTorch, the reference and the tests' oracle.
``"cpu"``: the same plus the compiled CPU kernels where they apply. ``"cuda"``: one Triton kernel
for decodes and prefill chunks over the block tables.
:func:`select_attention_backend` picks for a cache; ``PAGELLM_CPU_KERNELS=0`` forces ``"torch"``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagellm.attention.metadata import AttentionGroup, AttentionKind, AttentionMetadata

if TYPE_CHECKING:
    import torch

    from pagellm.attention.torch_paged import TorchPagedAttention

_BACKENDS = {
    "torch": ("pagellm.attention.torch_paged", "TorchPagedAttention"),
    "cpu": ("pagellm.attention.cpu_paged", "CpuPagedAttention"),
    "cuda": ("pagellm.attention.cuda_paged", "CudaPagedAttention"),
}


def get_attention_backend(name: str = "torch") -> type[TorchPagedAttention]:
    """The backend class registered as ``name``."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def select_attention_backend(key_cache: torch.Tensor, query_dtype: torch.dtype,
                             bf16_prefill: bool = False) -> TorchPagedAttention:
    """The backend for this cache (one layer's ``[num_slots, Hkv, D]``) and model dtype: ``"cuda"``
    (Triton) for a cache on a GPU, ``"cpu"`` when a compiled kernel applies to it, else the
    ``"torch"`` reference (``PAGELLM_CUDA_KERNELS=0`` keeps a GPU on the reference).
    ``bf16_prefill``: the run never decodes and its GEMMs are bfloat16, so CPU prefill attention may
    take bfloat16 tiles too (``CpuPagedAttention.for_cache``)."""
    import os

    from pagellm import kernels

    if key_cache.device.type == "cuda" and os.environ.get("PAGELLM_CUDA_KERNELS", "1") != "0":
        return get_attention_backend("cuda").for_cache(key_cache, query_dtype)  # type: ignore[attr-defined]
    if key_cache.device.type == "cpu" and kernels.enabled():
        cpu = get_attention_backend("cpu").for_cache(key_cache, query_dtype,  # type: ignore[attr-defined]
                                                     bf16_prefill=bf16_prefill)
        if cpu.uses_kernels:
            return cpu
    return get_attention_backend("torch")()


__all__ = ["AttentionGroup", "AttentionKind", "AttentionMetadata", "get_attention_backend",
           "select_attention_backend"]
