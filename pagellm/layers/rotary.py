"""Rotary position embedding (HF's rotate-half layout) with default, linear, llama3 and longrope
scaling, over the whole head or its first ``rotary_dim`` features (partial rotary, Phi-4-mini)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagellm.kernels import cpu_ops
from pagellm.layers.custom_op import CustomOp


def _inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type in ("longrope", "su"):
        # Phi-3's per-frequency factors: the long ones where the served length passes the trained
        # one (``_long``, set by ``models/decoder.rope_parameters``, as vLLM decides; HF switches per
        # call). HF's order of operations: the factor times the base power, then the reciprocal.
        factors = scaling["long_factor"] if scaling.get("_long") else scaling["short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents)
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: default, linear, llama3, longrope)")


_MIN_ROWS = 4096  # a CPU table's first size (rows of positions); it doubles as positions need


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by position, built on first use on the device of ``positions``.

    Built lazily (not in ``__init__``) so the model can be constructed on the meta device and
    materialised without random initialisation. One instance is shared by all layers. On a CPU the
    table covers the positions seen so far (4,096 rows, doubled as needed; an entry's bits do not
    depend on the table's length): Gemma 3's two tables at its 32k positions were 256 MiB, with
    the build's temporaries 0.3 GiB of a 270M model's footprint. A device table is built whole (its
    positions' maximum would synchronise every step).
    """

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.base = base
        self.scaling = scaling
        self.freq_factors = None if freq_factors is None else freq_factors.detach().cpu().float()
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def _ensure(self, positions: torch.Tensor) -> None:
        """A table on ``positions``' device with a row for each of them (or all max_position rows:
        a position past them fails to index, as it always did)."""
        need = int(positions.max()) + 1 if positions.device.type == "cpu" and positions.numel() else self.max_position
        if self._cos is None or self._cos.device != positions.device or need > self._cos.shape[0]:
            self._build(positions.device, min(self.max_position, max(_MIN_ROWS, 1 << (need - 1).bit_length())))

    def _build(self, device: torch.device, rows: int) -> None:
        inv_freq = _inv_freq(self.head_dim, self.base, self.scaling)
        if self.freq_factors is not None:  # GGUF's rope_freqs tensor (llama.cpp divides by it)
            inv_freq = inv_freq / self.freq_factors
        t = torch.arange(rows, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        factor = attention_factor(self.scaling, self.max_position)
        self._cos, self._sin = (emb.cos() * factor).to(device), (emb.sin() * factor).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``[T, 1, D]`` cos and sin, computed once per step and shared by every layer."""
        self._ensure(positions)
        assert self._cos is not None and self._sin is not None
        return self._cos[positions].to(dtype).unsqueeze(1), self._sin[positions].to(dtype).unsqueeze(1)


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal rotary embedding (M-RoPE): positions ``[3, T]`` (temporal, height,
    width); the rotary frequencies are cut into ``mrope_section`` sections, section ``k`` rotated by
    position row ``k``. A text token has three equal positions, so 1-D positions are plain RoPE."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None,
                 mrope_section: list[int]) -> None:
        super().__init__(head_dim, max_position, base, scaling)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to half the rotary dim ({head_dim // 2})")
        self.mrope_section = list(mrope_section)
        self._section_of: torch.Tensor | None = None  # each rotary feature's position row (built on use)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        self._ensure(positions)
        assert self._cos is not None and self._sin is not None
        if self._section_of is None or self._section_of.device != positions.device:
            half = [k for k, n in enumerate(self.mrope_section) for _ in range(n)]
            self._section_of = torch.tensor(half + half, device=positions.device)
        rows = self._section_of.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self._cos[positions].gather(0, rows)[0]  # [T, D]: feature j from position row section_of[j]
        sin = self._sin[positions].gather(0, rows)[0]
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def attention_factor(scaling: dict[str, Any] | None, max_position: int) -> float:
    """What longrope multiplies cos and sin by (HF's ``attention_factor``): given, or
    ``sqrt(1 + ln(s) / ln(original))`` for ``s = max_position / original`` above 1."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling.get("original_max_position_embeddings") or max_position)
    s = max_position / original
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(original))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by per-token ``cos``/``sin`` (HF's rotate-half);
    with tables narrower than ``D``, only the first features (partial rotary)."""
    rd = cos.shape[-1]
    if rd < q.shape[-1]:
        (qr, kr), qp, kp = apply_rotary(q[..., :rd], k[..., :rd], cos, sin), q[..., rd:], k[..., rd:]
        return torch.cat([qr, qp], dim=-1), torch.cat([kr, kp], dim=-1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class ApplyRotary(CustomOp):
    """``apply_rotary`` as an op. The CPU kernel rotates ``q`` and ``k`` in place (views into the
    fused qkv output: no copies) and returns them."""

    def forward_native(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        return apply_rotary(q, k, *rope)

    def forward_cpu(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        if q.stride(1) != q.shape[2] or k.stride(1) != k.shape[2] or rope[0].shape[-1] != q.shape[2]:
            # (the kernel needs contiguous heads, rotated whole)
            return self.forward_native(q, k, rope)
        t, hq, d = q.shape
        if k.stride(0) == q.stride(0) and k.data_ptr() == q.data_ptr() + hq * d * q.element_size():
            # k's heads follow q's in every row (both split from the fused qkv output): one pass.
            cpu_ops.rotary_(q.as_strided((t, hq + k.shape[1], d), q.stride()), *rope)
        else:
            cpu_ops.rotary_(q, *rope)
            cpu_ops.rotary_(k, *rope)
        return q, k

    @staticmethod
    def triton_takes(q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether the Triton kernel rotates these: unit-stride heads, an even rotary width."""
        return q.stride(2) == 1 and k.stride(2) == 1 and rope[0].shape[-1] % 2 == 0 and rope[0].is_contiguous() \
            and rope[1].is_contiguous()

    def forward_cuda(self, q: torch.Tensor, k: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """``q`` and ``k`` rotated in place in one kernel (the attention backend may fuse the K/V
        cache write into it: ``TorchPagedAttention.rotary_and_write_kv``)."""
        if not self.triton_takes(q, k, rope):
            return self.forward_native(q, k, rope)
        from pagellm.kernels import triton_ops

        triton_ops.rotary_and_write_kv(q, k, None, *rope)
        return q, k
