"""llm-compressor's compressed-tensors checkpoints read at their width.

Each quantized module stores, beside what its format packs, ``weight_scale`` (and for asymmetric
weights ``weight_zero_point``; with act-order groups ``weight_g_idx``), per tensor, output channel,
group of inputs or (FP8) block:

- ``pack-quantized``: ``weight_packed`` int32 ``[N, K bits / 32]``, 32 / bits consecutive inputs
  per word from the low bits up, each stored as ``q + 2^(bits-1)``; ``weight_shape`` ``[N, K]``;
  an asymmetric group or channel zero point packed the same way along the outputs,
  ``[N bits / 32, groups]``. ``w = s (q - z)``: the unsigned fields are ``IntGroupBlocks``' q and z.
- ``int-quantized`` (W8A8) and ``naive-quantized``: ``weight`` int8 ``[N, K]``, a zero point (if
  any) int8 as stored. The checkpoint's activation scheme (static ``input_scale`` or dynamic per
  token) is not the kernel's: the int8 kernel quantizes activations per block of 32 inputs as it
  runs, finer than either; ``input_scale`` is not read.
- ``float-quantized``: ``weight`` float8_e4m3fn ``[N, K]``, ``w = s w8`` in float32. No kernel
  block holds e4m3 values exactly, so for the int8 kernel the weight is requantized to Q8_0 a
  slice at a time as it is packed (the ``numerics:`` line says so); other kernels get it exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch

from pagellm.kernels.gemm_int8 import Q8_BLOCKS
from pagellm.quantization.gguf_quant import Q8_0OnPacking
from pagellm.quantization.group_quant import (
    IntGroupBlocks,
    check_shapes,
    gather_quantized,
    require,
    unpack_columns,
    unpack_words,
)
from pagellm.quantization.quant_blocks import QuantizedBlocks

PACKED_PARTS = ("weight_packed", "weight_shape")
_PARTS = (*PACKED_PARTS, "weight_scale", "weight_zero_point", "weight_g_idx")
STORED_TYPES = (torch.int8, torch.float8_e4m3fn)  # a quantized module's ``weight`` (unquantized ones: 16/32-bit)
# activation quantization parameters: the int8 kernel quantizes activations itself
ACTIVATION_PARTS = (".input_scale", ".input_zero_point", ".output_scale", ".output_zero_point")


_CT_FORMATS = {"pack-quantized": ("int", (4, 8), ("group", "channel", "tensor")),
               "int-quantized": ("int", (8,), ("group", "channel", "tensor")),
               "float-quantized": ("float", (8,), ("tensor", "channel", "block"))}


def describe_args(q: dict[str, Any] | None) -> str:
    """One compressed-tensors ``QuantizationArgs``: ``int4 asymmetric per group 128``."""
    if not q:
        return "none"
    bits = f"{q.get('type', 'int')}{q.get('num_bits')}"
    sym = "symmetric" if q.get("symmetric", True) else "asymmetric"
    size = f" {q['group_size']}" if q.get("group_size") else ""
    dynamic = ", dynamic" if q.get("dynamic") else ""
    return f"{bits} {sym} per {q.get('strategy')}{size}{dynamic}"


@dataclass(frozen=True)
class CompressedTensorsScheme:
    """What ``quantization_config`` says of a compressed-tensors checkpoint's weights (one scheme for
    every quantized module; ``from_config`` names what it does not build)."""

    format: str  # pack-quantized, int-quantized, naive-quantized or float-quantized
    type: str  # "int" or "float"
    bits: int
    strategy: str  # tensor, channel, group or block
    symmetric: bool
    group_size: int = -1  # the group strategy's
    block: tuple[int, int] | None = None  # the block strategy's [rows, columns], as the config gives it
    act_order: bool = False  # weight_g_idx stored (actorder "group")
    activations: str | None = None  # the checkpoint's activation scheme, as described
    method: ClassVar[str] = "compressed-tensors"

    @property
    def name(self) -> str:
        kind = "FP8 e4m3" if self.type == "float" else f"int{self.bits}"
        rows, cols = self.block_shape
        how = {"group": f"g{self.group_size}", "channel": "per channel", "tensor": "per tensor",
               "block": f"blocks {rows}x{cols}"}[self.strategy]
        sym = "" if self.symmetric or self.type == "float" else " asymmetric"
        a = f"A{8 if self.activations else 16}"
        return f"compressed-tensors W{self.bits}{a} {kind} {how}{sym}"

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> CompressedTensorsScheme | str:
        """A compressed-tensors config's one weight scheme, or what of it is not built."""
        groups = list((qc.get("config_groups") or {}).values())
        for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms"),
                          ("kv_cache_scheme", "a quantized KV cache")):
            if qc.get(key):
                return f"{what} ({key})"
        if qc.get("quantization_status", "compressed") != "compressed":
            return "quantization_status other than compressed"
        if len({repr(sorted((k, g.get(k)) for k in ("weights", "input_activations", "format"))) for g in groups}) != 1:
            return "config_groups with different schemes" if groups else "no config_groups"
        group = groups[0]
        w, a = group.get("weights") or {}, group.get("input_activations")
        fmt, kind = group.get("format") or qc.get("format"), w.get("type", "int")
        if fmt == "naive-quantized":  # (the weight stored in its quantized dtype, as int- or float-quantized)
            fmt = "float-quantized" if kind == "float" else "int-quantized"
        if fmt not in _CT_FORMATS:
            return "the format (pack-quantized, int-quantized and float-quantized are)"
        want, bits, strategies = _CT_FORMATS[fmt]
        strategy, size, block = w.get("strategy"), w.get("group_size"), w.get("block_structure")
        if kind != want or w.get("num_bits") not in bits or strategy not in strategies or w.get("dynamic"):
            return f"{fmt} weights other than {want}{'/'.join(map(str, bits))} per {', '.join(strategies)}"
        if strategy == "group" and (not isinstance(size, int) or size <= 0 or size % 32):
            return "group_size (multiples of 32 are)"
        if group.get("output_activations") or (a and (a.get("num_bits") != 8
                                                      or a.get("strategy") not in ("token", "tensor"))):
            return "activations other than 8-bit per token or per tensor"
        return cls(
            fmt, kind, int(w["num_bits"]), strategy, bool(w.get("symmetric", True)),
            size if strategy == "group" and isinstance(size, int) else -1,
            tuple(block) if strategy == "block" and block else None, w.get("actorder") == "group",
            describe_args(a) if a else None)

    @property
    def block_shape(self) -> tuple[int, int]:
        """The block strategy's ``(rows, columns)`` (128 x 128 where the config does not say)."""
        return self.block or (128, 128)

    @property
    def note(self) -> str | None:
        """What of the checkpoint the int8 kernel does its own way (logged at start-up)."""
        if not self.activations:
            return None
        return (f"{self.name}: the checkpoint's activation scheme ({self.activations}) is not used: the int8 "
                "kernel quantizes activations to int8 per block of 32 inputs as it runs")

    def required(self) -> tuple[str, ...]:
        """A quantized module's tensors."""
        return ((*PACKED_PARTS, "weight_scale") if self.format == "pack-quantized" else ("weight", "weight_scale")) \
            + (() if self.symmetric or self.type == "float" else ("weight_zero_point",)) \
            + (("weight_g_idx",) if self.act_order else ())

    def gather(self, weights: Iterator[tuple[str, Any]], keep: bool) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors with each quantized module's parts gathered into its ``.weight``
        (``gather_quantized``); activation scales dropped."""
        need = set(self.required())

        def is_part(part: str, tensor: Any) -> bool:
            return part in _PARTS or (part == "weight" and getattr(tensor, "dtype", None) in STORED_TYPES)

        def build(prefix: str, parts: dict[str, Any]) -> QuantizedBlocks:
            require(self.name, prefix, parts, self.required())
            blocks = Fp8Blocks if self.type == "float" else PackedIntBlocks
            return blocks.of(self, prefix, parts)

        kept = ((n, t) for n, t in weights if not n.endswith(ACTIVATION_PARTS))
        return gather_quantized(kept, is_part, lambda got: got.keys() >= need, build, keep)


def _scale(scheme: CompressedTensorsScheme, name: str, scale: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """``weight_scale`` as float32 ``[N, groups]`` (a per-tensor scale repeated per output)."""
    if scheme.strategy == "tensor":
        if scale.numel() != 1:
            raise ValueError(f"{name}.weight_scale has shape {tuple(scale.shape)}; {scheme.name} needs one value")
        return scale.float().reshape(1, 1).expand(n, 1).contiguous()
    check_shapes(name, {"weight_scale": scale}, {"weight_scale": (n, groups)}, scheme.name)
    return scale.float()


@dataclass(frozen=True)
class PackedIntBlocks(IntGroupBlocks):
    """One ``pack-quantized`` or ``int-quantized`` projection: outputs ``lo .. lo + shape[0]``."""

    scheme: CompressedTensorsScheme
    weight: torch.Tensor  # int32 [N, K bits / 32] packed, or int8 [N, K]
    scale: torch.Tensor  # float32 [N, groups]
    zero_point: torch.Tensor | None  # None: symmetric
    g_idx: torch.Tensor | None
    shape: tuple[int, int]
    lo: int = 0
    order: np.ndarray | None = None

    @classmethod
    def of(cls, scheme: CompressedTensorsScheme, name: str, parts: dict[str, torch.Tensor]) -> PackedIntBlocks:
        packed = scheme.format == "pack-quantized"
        if packed:
            n, k = (int(v) for v in parts["weight_shape"].tolist())
            check_shapes(name, parts, {"weight_packed": (n, -(-k * scheme.bits // 32))}, f"{scheme.name} {n}x{k}")
        else:
            n, k = parts["weight"].shape
        if scheme.strategy == "group" and k % scheme.group_size:
            raise ValueError(f"{name}: {k} inputs are not whole groups of {scheme.group_size}")
        groups = k // scheme.group_size if scheme.strategy == "group" else 1
        zp = None if scheme.symmetric else parts["weight_zero_point"]
        if zp is not None:  # (packed where the weight is, but for one per tensor: stored as is)
            shape = (1,) * zp.dim() if scheme.strategy == "tensor" else \
                (-(-n * scheme.bits // 32), groups) if packed else (n, groups)
            check_shapes(name, parts, {"weight_zero_point": shape}, scheme.name)
        g_idx = parts.get("weight_g_idx")
        if g_idx is not None:
            check_shapes(name, parts, {"weight_g_idx": (k,)}, scheme.name)
            if g_idx.min() < 0 or g_idx.max() >= groups:
                raise ValueError(f"{name}.weight_g_idx names groups outside 0..{groups - 1}")
        return cls(scheme, parts["weight_packed" if packed else "weight"],
                   _scale(scheme, name, parts["weight_scale"], n, groups), zp, g_idx, (n, k))

    @property
    def bits(self) -> int:
        return self.scheme.bits

    @property
    def group_size(self) -> int:
        return self.scheme.group_size if self.scheme.strategy == "group" else -1

    @property
    def label(self) -> str:
        return self.scheme.name

    def unpacked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        (n, k), bits, offset = self.shape, self.scheme.bits, 1 << (self.scheme.bits - 1)
        lo, hi = self.lo, self.lo + n
        if self.scheme.format == "pack-quantized":
            q = unpack_words(self.weight[lo:hi], bits)[:, :k]  # (stored as q + offset: the unsigned field)
        else:
            q = self.weight[lo:hi].numpy().view(np.uint8) ^ np.uint8(offset)  # int8 + 128
        s = self.scale[lo:hi].numpy()
        if self.zero_point is None:
            z = np.full(s.shape, offset, dtype=np.int32)
        elif self.zero_point.dtype == torch.int32:  # packed along the outputs, stored + offset
            z = unpack_columns(self.zero_point.T.contiguous(), bits, lo, hi).T.astype(np.int32)
        else:  # int8 as stored: [N, groups], or one per tensor
            zp = self.zero_point.reshape(1, 1) if self.zero_point.numel() == 1 else self.zero_point[lo:hi]
            z = np.broadcast_to(zp.numpy().astype(np.int32) + offset, s.shape)
        return np.ascontiguousarray(q), s, np.ascontiguousarray(z)

    def take(self, lo: int, hi: int) -> PackedIntBlocks:
        return replace(self, shape=(hi - lo, self.shape[1]), lo=self.lo + lo)


@dataclass(frozen=True)
class Fp8Blocks(QuantizedBlocks):
    """One ``float-quantized`` projection (float8_e4m3fn and a float scale per tensor, output or
    block): outputs ``lo .. lo + shape[0]``."""

    scheme: CompressedTensorsScheme
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32: [1, 1] per tensor, [N, 1] per channel, [N / rows, K / columns] per block
    shape: tuple[int, int]
    lo: int = 0
    k0: int = 0  # the first input (a row-parallel rank's share starts there)

    @classmethod
    def of(cls, scheme: CompressedTensorsScheme, name: str, parts: dict[str, torch.Tensor]) -> Fp8Blocks:
        n, k = parts["weight"].shape
        scale = parts["weight_scale"]
        if scheme.strategy == "block":
            rows, cols = scheme.block_shape
            check_shapes(name, parts, {"weight_scale": (-(-n // rows), -(-k // cols))}, scheme.name)
            return cls(scheme, parts["weight"], scale.float(), (n, k))
        return cls(scheme, parts["weight"], _scale(scheme, name, scale, n, 1), (n, k))

    @property
    def type_name(self) -> str:
        return self.scheme.name

    @property
    def packed_name(self) -> str:
        return f"{self.scheme.name} (requantized to Q8_0 for the int8 kernel)"

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo .. hi`` (of the whole weight) in float32: e4m3 times its scale."""
        k0, k1 = self.k0, self.k0 + self.shape[1]
        w = self.weight[lo:hi, k0:k1].float()
        if self.scheme.strategy != "block":
            return w * self.scale[lo:hi]
        rows, cols = self.scheme.block_shape
        r0 = lo // rows  # (only the slice's block rows widened: packing reads a weight a slice at a time)
        s = self.scale[r0:-(-hi // rows)].repeat_interleave(rows, 0)[lo - r0 * rows:hi - r0 * rows]
        return w * s.repeat_interleave(cols, 1)[:, k0:k1]

    def kernel_format(self) -> int | None:
        return Q8_BLOCKS if self.shape[1] % 32 == 0 else None

    def int8_fields(self) -> tuple[np.ndarray, ...]:
        return Q8_0OnPacking(self.rows, self.shape, self.lo).int8_fields()

    def take(self, lo: int, hi: int) -> Fp8Blocks:
        return replace(self, shape=(hi - lo, self.shape[1]), lo=self.lo + lo)

    def take_inputs(self, lo: int, hi: int) -> Fp8Blocks | None:
        """Inputs ``lo .. hi`` where they are whole Q8_0 blocks (the int8 kernel's requantization)."""
        if lo % 32 or hi % 32:
            return None
        return replace(self, shape=(self.shape[0], hi - lo), k0=self.k0 + lo)

    def dequantize(self) -> torch.Tensor:
        return self.rows(self.lo, self.lo + self.shape[0])
