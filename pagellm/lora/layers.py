"""The low-rank updates of a mixed batch: every projection computes the base GEMM for all rows,
then, for each adapter slot with rows in the step, ``y[rows] += (x[rows] A^T) B^T`` (shrink, then
expand; the scaling is folded into ``B``). Rows of the base model pay nothing; with no adapter
in the step, a projection pays one attribute test.

A fused projection (``qkv_proj``, ``gate_up_proj``) holds its parts' adapters side by side: ``A``
stacks the parts' ``[r, in]`` matrices along the rank, ``B`` places each part's ``[out_p, r]`` on
its own output rows and rank columns (zero elsewhere), so one shrink and one expand serve every
part: ``x A^T B^T = concat_p(x A_p^T B_p^T)``.
"""

from __future__ import annotations

import torch
from torch import nn

from pagellm.layers.linear import Linear
from pagellm.lora.adapter import LoRAAdapter


class LoRAContext:
    """The step's rows per adapter slot, shared by every LoRA-enabled projection of one model."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[tuple[int, torch.Tensor]] = []


class LoRASlots:
    """``max_loras`` adapter slots of one (possibly fused) projection."""

    def __init__(self, ctx: LoRAContext, num_slots: int, in_features: int, part_outs: list[int], max_rank: int,
                 device: torch.device) -> None:
        self.ctx = ctx
        self.max_rank = max_rank
        self.part_offsets = [sum(part_outs[:i]) for i in range(len(part_outs))]
        self.part_outs = part_outs
        width = len(part_outs) * max_rank
        self.A = torch.zeros(num_slots, width, in_features, device=device)
        self.B = torch.zeros(num_slots, sum(part_outs), width, device=device)

    def load(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's parts for this projection in ``slot`` (parts it lacks stay zero)."""
        self.A[slot].zero_()
        self.B[slot].zero_()
        for p, (a, b) in parts.items():
            r, col, row = a.shape[0], p * self.max_rank, self.part_offsets[p]
            self.A[slot, col:col + r] = a
            self.B[slot, row:row + self.part_outs[p], col:col + r] = b

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for slot, idx in self.ctx.rows:
            xs = x.index_select(0, idx)
            y.index_add_(0, idx, (xs @ self.A[slot].T) @ self.B[slot].T)
        return y


def lora_modules(model: nn.Module) -> dict[str, Linear]:
    """``"{layer}.{module}" -> projection`` for every projection an adapter may target."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            module = layer.get_submodule(name)
            out[f"{i}.{name}"] = module
    return out


def module_shapes(model: nn.Module) -> dict[str, list[tuple[int, int]]]:
    """Each target module's parts as ``(in_features, out_features)`` (layer 0's: all layers agree)."""
    shapes = {}
    for key, m in lora_modules(model).items():
        name = key.split(".", 1)[1]
        parts = getattr(m, "parts", None)
        shapes[name] = [(m.in_features, size) for _, size in parts] if parts else [(m.in_features, m.out_features)]
    return shapes


class ModelLoRA:
    """The slots of every projection of one model and the context their updates read."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, device: torch.device) -> None:
        self.ctx = LoRAContext()
        self.modules = lora_modules(model)
        shapes = module_shapes(model)
        for key, m in self.modules.items():
            parts = shapes[key.split(".", 1)[1]]
            m.lora = LoRASlots(self.ctx, num_slots, m.in_features, [o for _, o in parts], max_rank, device)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        for key, m in self.modules.items():
            layer, name = key.split(".", 1)
            assert m.lora is not None
            m.lora.load(slot, adapter.weights.get((int(layer), name), {}))

    def set_rows(self, row_slots: list[int], device: torch.device) -> None:
        """The step's rows per slot (``row_slots[i]``: the slot of flat row ``i``, -1 for the base model)."""
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(row_slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(i)
        self.ctx.rows = [(s, torch.tensor(rows, dtype=torch.long, device=device)) for s, rows in by_slot.items()]
