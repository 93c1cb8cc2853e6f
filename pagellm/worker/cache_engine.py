"""The paged KV cache tensors of one worker and the block copies the scheduler asks for.

One tensor ``[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]`` holds every
layer's K and V; layer ``i`` reads ``kv[i, 0]`` / ``kv[i, 1]`` as flat slot arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of one block across all layers; ``block_bytes`` sizes the pool from a byte budget."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``, but on CPU from calloc'd memory: the OS zero-fills pages on first touch,
    so a multi-GiB cache costs nothing at start-up (``torch.zeros`` memsets it: seconds)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class CacheEngine:
    """Owns the KV tensor; hands per-layer ``(key_cache, value_cache)`` views to the model."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, 2, num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        # Zeroed: attention gathers whole blocks and masks the unused tail slots, but a masked key
        # still multiplies its value by 0, so every slot must hold a finite number from the start.
        self.kv = _zeros(shape, spec.dtype, device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(spec.num_layers)]

    def _block_slots(self, block_ids: list[int]) -> torch.Tensor:
        bs = self.spec.block_size
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        return (ids[:, None] * bs + torch.arange(bs, device=self.kv.device)).reshape(-1)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write)."""
        if not pairs:
            return
        src = self._block_slots([s for s, _ in pairs])
        dst = self._block_slots([d for _, d in pairs])
        self.kv[:, :, dst] = self.kv[:, :, src]
