"""AWQ and GPTQ checkpoints' packed integers read as the int8 kernel's fields, at their width.

Both formats store, per group of ``group_size`` inputs and per output, a scale ``s`` and an integer
zero point ``z``: ``w = s (q - z)``. That is the kernel's 4-bit block ``w = d q + m`` with ``d = s``
and ``m = -z s`` for each block of 32 inputs (a group of 32, 64 or 128 is 1, 2 or 4 blocks, which
share one d and m in the kernel's record: ``gemm_int8.q4_format``), both exact in float32 (s is
16-bit, z < 16): nothing is rounded on the way. An 8-bit symmetric weight
(z = 128) is the kernel's 8-bit block ``d (q - 128)``. Every other kernel gets ``dequantize``, the
same values in float32.

Layouts, as AutoAWQ, AutoGPTQ / GPTQModel and vLLM read them (K inputs, N outputs, g the group):

- AWQ, version ``gemm``: ``qweight`` int32 ``[K, N / 8]``, eight 4-bit outputs per word from the
  low bits up in the order 0 2 4 6 1 3 5 7; ``qzeros`` int32 ``[K / g, N / 8]`` packed the same;
  ``scales`` 16-bit ``[K / g, N]``.
- GPTQ: ``qweight`` int32 ``[K bits / 32, N]``, 32 / bits consecutive inputs per word from the low
  bits up; ``qzeros`` int32 ``[K / g, N bits / 32]`` packed along the outputs the same way, holding
  z - 1 (``checkpoint_format`` ``gptq``, AutoGPTQ's) or z (``gptq_v2``); ``scales`` ``[K / g, N]``;
  ``g_idx`` int32 ``[K]``, each input's group (out of order with ``desc_act``: act-order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from pagellm.kernels.gemm_int8 import Q4_BLOCKS, Q8_BLOCKS, q4_format
from pagellm.quantization.quant_blocks import QuantizedBlocks
from pagellm.quantization.rows16 import HALF_TYPES, Rows16

AWQ_UNPACK_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # output j of a word is its nibble AWQ_UNPACK_ORDER[j]
_REQUIRED = ("qweight", "qzeros", "scales")  # a module's tensors, and GPTQ's g_idx beside them
_PARTS = (*_REQUIRED, "g_idx")


@dataclass(frozen=True)
class GroupQuantScheme:
    """What ``quantization_config`` says of an AWQ / GPTQ checkpoint's packing (``from_config``)."""

    method: str  # "awq" or "gptq"
    bits: int
    group_size: int  # -1: one group for all K inputs (per output channel)
    zero_offset: int = 0  # added to a stored zero point: 1 for AutoGPTQ's z - 1

    note = None  # (nothing of the checkpoint done another way: see CompressedTensorsScheme.note)

    @property
    def name(self) -> str:
        group = "per channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.method.upper()} int{self.bits} {group}"

    def gather(self, weights: Iterator[tuple[str, Any]], keep: bool) -> Iterator[tuple[str, Any]]:
        return iter_group_quant(weights, self, keep)

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> GroupQuantScheme | str:
        """An AWQ / GPTQ ``quantization_config`` read, or what of it is not built (as the refusal names it)."""
        unbuilt = _unsupported(qc)
        if unbuilt is not None:
            return unbuilt
        v1 = qc["quant_method"] == "gptq" and _checkpoint_format(qc) == "gptq"
        return cls(qc["quant_method"], int(qc["bits"]), int(qc.get("group_size", -1)), int(v1))


def _checkpoint_format(qc: dict[str, Any]) -> str:
    """GPTQ's zero-point convention: ``gptq`` (AutoGPTQ's z - 1, the default) or ``gptq_v2`` (z)."""
    return str(qc.get("checkpoint_format", "gptq")).lower()


def _unsupported(qc: dict[str, Any]) -> str | None:
    """What of an AWQ / GPTQ config is not built (``None``: all of it is), as the refusal names it."""
    method, bits, group = qc.get("quant_method"), qc.get("bits"), qc.get("group_size", -1)
    if method not in ("awq", "gptq"):
        return "the method"
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
        return "group_size (32, 64, 128, ... or -1 are)"
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm":
            return "AWQ's version (gemm is)"
        if bits != 4 or not qc.get("zero_point", True):
            return "AWQ other than 4-bit with zero points"
        return None
    if qc.get("lm_head") or qc.get("is_marlin_format"):
        return "a quantized LM head" if qc.get("lm_head") else "the Marlin packing"
    if _checkpoint_format(qc) not in ("gptq", "gptq_v2"):
        return "checkpoint_format (gptq and gptq_v2 are)"
    if bits not in (4, 8) or (bits == 8 and not qc.get("sym", True)):
        return "GPTQ other than 4-bit or 8-bit symmetric"
    return None


def unpack_words(words: torch.Tensor, bits: int) -> np.ndarray:
    """int32 ``[R, C]`` -> uint8 ``[R, C 32 / bits]``: each word's fields from the low bits up, read
    as its little-endian bytes (two 4-bit fields a byte, low nibble first): a byte per field in
    every step, where shifting the words made 12 bytes of transients per weight (0.2 GB for one of
    SmolLM2-1.7B's down projections)."""
    b = np.ascontiguousarray(words.numpy(), dtype="<i4").view(np.uint8)
    if bits == 8:
        return b
    out = np.empty((b.shape[0], 2 * b.shape[1]), dtype=np.uint8)
    out[:, 0::2] = b & 0x0F
    out[:, 1::2] = b >> 4
    return out


def unpack_columns(words: torch.Tensor, bits: int, lo: int, hi: int) -> np.ndarray:
    """Outputs ``lo .. hi`` of a tensor packed along its columns in order, ``[rows, hi - lo]``
    (only the words holding them unpacked; AWQ's interleaved order: :func:`unpack_awq_outputs`)."""
    per = 32 // bits
    c0, c1 = lo // per, -(-hi // per)
    return unpack_words(words[:, c0:c1], bits)[:, lo - c0 * per:hi - c0 * per]


_AWQ_SHIFTS = [4 * int(f) for f in AWQ_UNPACK_ORDER]


def unpack_awq_outputs(qweight: torch.Tensor, lo: int, hi: int) -> np.ndarray:
    """Outputs ``lo .. hi`` of AWQ's 4-bit ``qweight [K, N / 8]`` (or ``qzeros [groups, N / 8]``)
    as uint8 ``[hi - lo, K]``: the words transposed first (int32: a quarter of the elements a byte
    transpose moves), then each output's nibble shifted out along K (3x unpacking bytes,
    reordering and transposing those)."""
    c0, c1 = lo // 8, -(-hi // 8)
    words = qweight[:, c0:c1].T.contiguous()  # [words, K]
    out = torch.empty(words.shape[0], 8, words.shape[1], dtype=torch.uint8)
    for j, shift in enumerate(_AWQ_SHIFTS):
        out[:, j] = ((words >> shift) & 0xF).to(torch.uint8)
    return out.view(-1, words.shape[1])[lo - c0 * 8:hi - c0 * 8].numpy()


class IntGroupBlocks(QuantizedBlocks):
    """A projection stored as unsigned integers ``q`` with, per group of inputs and per output, a
    scale ``s`` and an integer zero point ``z``: ``w = s (q - z)`` (AWQ, GPTQ, compressed-tensors'
    integer formats). Subclasses read their layout in :meth:`unpacked`; the kernel's fields and
    the exact dequantization are shared."""

    shape: tuple[int, int]
    g_idx: torch.Tensor | None  # each input's group, where stored
    order: np.ndarray | None  # the inputs in this order (GPTQ act-order's, sorted by group), where not 0 .. K-1

    @property
    def bits(self) -> int:
        raise NotImplementedError

    @property
    def group_size(self) -> int:  # -1: one group for all K inputs (per output channel)
        raise NotImplementedError

    @property
    def label(self) -> str:
        """The format as the ``numerics:`` line names it (``AWQ int4 g128``)."""
        raise NotImplementedError

    def unpacked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(q [n, K], s [n, groups], z [n, groups])``: uint8 integers, float32 scales, int32 zero points."""
        raise NotImplementedError

    def take(self, lo: int, hi: int) -> IntGroupBlocks:
        raise NotImplementedError

    @property
    def type_name(self) -> str:
        return self.label + (" act-order" if not _in_runs(self._stored_groups()) else "")

    def _stored_groups(self) -> np.ndarray:
        """Each input's group ``[K]``, in the stored order."""
        k = self.shape[1]
        if self.g_idx is not None:
            return self.g_idx.numpy().astype(np.int64)
        return np.zeros(k, dtype=np.int64) if self.group_size == -1 else np.arange(k) // self.group_size

    def _groups(self) -> np.ndarray:
        """Each input's group ``[K]``, in :attr:`order`."""
        groups = self._stored_groups()
        return groups if self.order is None else groups[self.order]

    def _q(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q, s, z = self.unpacked()
        return (q if self.order is None else np.take(q, self.order, axis=1)), s, z  # (take: 10x q[:, order])

    def input_order(self) -> np.ndarray | None:
        """Where act-order's ``g_idx`` scatters the groups: the inputs sorted by group (stably),
        which makes every run of 32 one group's, so the kernel takes the blocks with the
        activations permuted alike (``None``: in order already, or no such order)."""
        groups = self._stored_groups()
        if self.order is not None or _in_runs(groups):
            return None
        order = np.argsort(groups, kind="stable")
        return order if _in_runs(groups[order]) else None

    def in_input_order(self, order: np.ndarray) -> IntGroupBlocks:
        return replace(self, order=order)  # type: ignore[type-var]

    def kernel_format(self) -> int | None:
        if not _in_runs(self._groups()):  # (act-order: in its input order only)
            return None
        if self.bits == 8:
            return Q8_BLOCKS
        k = self.shape[1]
        group = k if self.group_size == -1 else self.group_size
        # d and m once per group where the groups are whole runs of blocks, else per block
        return q4_format(group // 32) if group % 32 == 0 and k % group == 0 else Q4_BLOCKS

    def int8_fields(self) -> tuple[np.ndarray, ...]:
        q, s, z = self._q()
        groups = self._groups()[::32]  # each block of 32's group
        d = s[:, groups]
        if self.bits == 4:
            return d, (-z.astype(np.float32) * s)[:, groups], q
        if (z != 128).any():
            raise ValueError(f"{self.type_name}: a zero point other than 128 has no 8-bit kernel block")
        return d, np.zeros_like(d), q.view(np.int8) ^ np.int8(-128)  # q - 128

    def dequantize(self) -> torch.Tensor:
        q, s, z = self._q()
        groups = self._groups()
        w = q.astype(np.float32) * s[:, groups] + (-z.astype(np.float32) * s)[:, groups]  # exact: see the module
        return torch.from_numpy(w)

    def take_inputs(self, lo: int, hi: int) -> IntGroupBlocks | None:
        """Inputs ``lo .. hi`` where they are whole blocks of 32 (the kernel's: a group cut at such a
        boundary keeps its scale and zero point on both sides); ``None`` otherwise."""
        if lo % 32 or hi % 32 or self.order is not None:
            return None
        return InputSlice(self, lo, hi)


@dataclass(frozen=True)
class InputSlice(IntGroupBlocks):
    """Inputs ``k0 .. k1`` of ``base`` (a row-parallel rank's share): its integers cut there, its
    scales and zero points kept for every group (each input still names its own group)."""

    base: IntGroupBlocks
    k0: int
    k1: int
    order: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:  # type: ignore[override]
        return self.base.shape[0], self.k1 - self.k0

    @property
    def g_idx(self) -> torch.Tensor | None:  # type: ignore[override]
        return None  # (the groups are the base's: _stored_groups)

    @property
    def bits(self) -> int:
        return self.base.bits

    @property
    def group_size(self) -> int:
        # A group cut off its start runs in blocks of 32 (each of one group): the kernel's record
        # shares d and m per whole group only where the slice starts on a group.
        g = self.base.group_size
        return g if g == -1 or self.k0 % g == 0 else 32

    @property
    def label(self) -> str:
        return self.base.label

    def _stored_groups(self) -> np.ndarray:
        return self.base._stored_groups()[self.k0:self.k1]

    def unpacked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        q, s, z = self.base.unpacked()
        return np.ascontiguousarray(q[:, self.k0:self.k1]), s, z

    def take(self, lo: int, hi: int) -> InputSlice:
        return replace(self, base=self.base.take(lo, hi))


def _in_runs(groups: np.ndarray) -> bool:
    """Whether every run of 32 inputs shares one group (always, but for act-order's g_idx)."""
    return groups.size % 32 == 0 and bool((groups.reshape(-1, 32) == groups[::32, None]).all())


@dataclass(frozen=True)
class GroupQuantBlocks(IntGroupBlocks):
    """One AWQ or GPTQ projection as stored: outputs ``lo .. lo + shape[0]`` of its tensors."""

    scheme: GroupQuantScheme
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    shape: tuple[int, int]
    lo: int = 0
    order: np.ndarray | None = None

    @classmethod
    def of(cls, scheme: GroupQuantScheme, name: str, parts: dict[str, torch.Tensor]) -> GroupQuantBlocks:
        """A module's tensors checked against each other (``ValueError`` naming the tensor)."""
        qweight, scales = parts["qweight"], parts["scales"]
        if scheme.method == "awq":
            k, n = qweight.shape[0], qweight.shape[1] * 8
        else:
            k, n = qweight.shape[0] * 32 // scheme.bits, qweight.shape[1]
        groups = 1 if scheme.group_size == -1 else -(-k // scheme.group_size)
        expect: dict[str, tuple[int, ...]] = {"scales": (groups, n), "qzeros": (groups, n * scheme.bits // 32)}
        g_idx = parts.get("g_idx")
        if g_idx is not None:
            expect["g_idx"] = (k,)
        check_shapes(name, parts, expect, f"{scheme.name} with {name}.qweight {tuple(qweight.shape)}")
        if g_idx is not None and (g_idx.min() < 0 or g_idx.max() >= groups):
            raise ValueError(f"{name}.g_idx names groups outside 0..{groups - 1}")
        return cls(scheme, qweight, parts["qzeros"], scales.float(), g_idx, (n, k))

    @property
    def bits(self) -> int:
        return self.scheme.bits

    @property
    def group_size(self) -> int:
        return self.scheme.group_size

    @property
    def label(self) -> str:
        return self.scheme.name

    def unpacked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s, n = self.scheme, self.shape[0]
        lo, hi = self.lo, self.lo + n
        if s.method == "awq":
            q, z = unpack_awq_outputs(self.qweight, lo, hi), unpack_awq_outputs(self.qzeros, lo, hi)
        else:
            q = unpack_words(self.qweight[:, lo:hi].T.contiguous(), s.bits)
            z = unpack_columns(self.qzeros, s.bits, lo, hi).T
        z = z.astype(np.int32) + s.zero_offset
        return np.ascontiguousarray(q), self.scales[:, lo:hi].T.contiguous().numpy(), np.ascontiguousarray(z)

    def take(self, lo: int, hi: int) -> GroupQuantBlocks:
        return replace(self, shape=(hi - lo, self.shape[1]), lo=self.lo + lo)


def check_shapes(name: str, parts: dict[str, torch.Tensor], expect: dict[str, tuple[int, ...]], given: str) -> None:
    """``ValueError`` naming the first of a module's tensors whose shape is not ``expect``'s."""
    for part, shape in expect.items():
        if tuple(parts[part].shape) != shape:
            raise ValueError(f"{name}.{part} has shape {tuple(parts[part].shape)}; {given} needs {shape}")


def gather_quantized(weights: Iterator[tuple[str, Any]], is_part: Callable[[str, Any], bool],
                     complete: Callable[[dict[str, Any]], bool],
                     build: Callable[[str, dict[str, Any]], QuantizedBlocks], keep: bool) -> Iterator[tuple[str, Any]]:
    """A checkpoint's tensors with each quantized module's parts (those ``is_part(leaf, tensor)``
    takes) gathered into its ``.weight`` by ``build(prefix, parts)``, once ``complete(parts)`` (or
    at the end: ``build`` refuses what lacks a part): the blocks with ``keep`` (for the int8
    kernel), else dequantized to float32. Every other tensor passes through; with ``keep``, a
    16-bit embedding or LM head as ``Rows16`` (kept in 16 bits: in float32 they would outweigh the
    projections)."""
    pending: dict[str, dict[str, Any]] = {}
    halves = ("embed_tokens.weight", "lm_head.weight") if keep else ()

    def ready(prefix: str) -> tuple[str, Any]:
        blocks = build(prefix, pending.pop(prefix))
        return f"{prefix}.weight", blocks if keep else blocks.dequantize()

    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if not is_part(part, tensor):
            kept = name.endswith(halves) and isinstance(tensor, torch.Tensor) and tensor.dim() == 2 \
                and tensor.dtype in HALF_TYPES
            yield name, Rows16(tensor) if kept else tensor
            continue
        got = pending.setdefault(prefix, {})
        got[part] = tensor
        if complete(got):
            yield ready(prefix)
    for prefix in list(pending):
        yield ready(prefix)


def require(label: str, prefix: str, parts: dict[str, Any], names: Iterable[str]) -> None:
    """``ValueError`` naming what of ``names`` a quantized module lacks."""
    missing = [p for p in names if p not in parts]
    if missing:
        raise ValueError(f"{label} checkpoint: {prefix} lacks {', '.join(missing)}")


def iter_group_quant(weights: Iterator[tuple[str, Any]], scheme: GroupQuantScheme,
                     keep: bool) -> Iterator[tuple[str, Any]]:
    """An AWQ / GPTQ checkpoint's tensors with each module's ``qweight``, ``qzeros``, ``scales`` and
    ``g_idx`` gathered into ``GroupQuantBlocks`` (``gather_quantized``)."""
    needs_g_idx = scheme.method == "gptq"  # (a GPTQ module without g_idx, at the end: groups in order)

    def build(prefix: str, parts: dict[str, Any]) -> QuantizedBlocks:
        require(scheme.name, prefix, parts, _REQUIRED)
        return GroupQuantBlocks.of(scheme, prefix, parts)

    return gather_quantized(weights, lambda part, _: part in _PARTS,
                            lambda got: got.keys() >= set(_REQUIRED) and ("g_idx" in got or not needs_g_idx),
                            build, keep)
