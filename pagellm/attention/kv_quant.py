"""How K/V values are stored in the paged cache, for every cache element type.

float32 / float16 / bfloat16 caches hold the values, rounded to the type. An ``int8`` cache
(``kv_cache_dtype="int8"``) holds, for each token and KV head, its ``head_dim`` values rounded to
int8 against one absmax scale, followed by that scale as 4 float32 bytes: a cached head row is
``head_dim + 4`` int8 elements (the scale sits right after the values it scales, so a block stays
one contiguous run of bytes and swap, copy-on-write and KV transfer move it unchanged). Decode
attention reads ~half the bytes of a float16 cache; the scale per token and head keeps the
rounding row-local, so a token's cached K/V never depend on what else shares its step.

The compiled kernels (``kernels/cpu_ops.c`` ``write_kv_i8``) quantize with the same formula,
bit for bit: ``scale = max|x| / 127``, ``q = round_half_even(x / scale)`` (``q = 0`` where the row
is all zeros).
"""

from __future__ import annotations

import torch

INT8_SCALE_ELEMS = 4  # one float32 scale per cached head row, stored as 4 int8 elements


def cache_head_dim(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of one cached head row: the values, plus the scale for an int8 cache."""
    return head_dim + INT8_SCALE_ELEMS if cache_dtype == torch.int8 else head_dim


def value_head_dim(cache: torch.Tensor) -> int:
    """``head_dim`` of a cache ``[..., cache_head_dim]``."""
    return cache.shape[-1] - INT8_SCALE_ELEMS if cache.dtype == torch.int8 else cache.shape[-1]


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x [..., D]`` as the cache stores it: ``[..., D]`` in the cache's type, or for int8
    ``[..., D + 4]`` (values, then the row's float32 scale)."""
    if cache_dtype != torch.int8:
        return x.to(cache_dtype)
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, xf / scale, torch.zeros((), dtype=xf.dtype, device=xf.device))
    q = q.round().clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def from_cache(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows ``[..., cache_head_dim]`` as ``dtype`` values ``[..., D]``."""
    if c.dtype != torch.int8:
        return c.to(dtype)
    d = c.shape[-1] - INT8_SCALE_ELEMS
    scale = c[..., d:].contiguous().view(torch.float32)
    return (c[..., :d].float() * scale).to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` after a round trip through the cache: what attention reads back for it."""
    if cache_dtype == x.dtype:
        return x
    return from_cache(to_cache(x, cache_dtype), x.dtype)
