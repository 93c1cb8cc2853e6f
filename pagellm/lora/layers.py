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

from pagellm.kernels import lora_sgmv
from pagellm.layers.linear import Linear
from pagellm.lora.adapter import LoRAAdapter


class LoRAContext:
    """The step's adapter rows, shared by every LoRA-enabled projection of one model: runs of
    consecutive flat-batch rows with the same adapter slot (the model runner orders decodes by
    slot, and a prompt chunk is one run), so every update is two GEMMs on a slice: no gathers,
    no scatter, no arithmetic on other adapters' rows."""

    __slots__ = ("segments", "segment_tensor")

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, int]] = []  # (start, end, slot)
        self.segment_tensor = torch.empty(0, 3, dtype=torch.int64)  # the same, for the kernel

    @property
    def active(self) -> bool:
        return bool(self.segments)


class LoRASlots:
    """``max_loras`` adapter slots of one (possibly fused) projection: ``At [slots, in, W]`` and
    ``Bt [slots, W, out]`` (``W`` = parts x max rank; a part's rank columns, zero past its rank)."""

    def __init__(self, ctx: LoRAContext, num_slots: int, in_features: int, part_outs: list[int], max_rank: int,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.ctx = ctx
        self.max_rank = max_rank
        self.part_offsets = [sum(part_outs[:i]) for i in range(len(part_outs))]
        self.part_outs = part_outs
        width = len(part_outs) * max_rank
        self.At = torch.zeros(num_slots, in_features, width, device=device, dtype=dtype)
        self.Bt = torch.zeros(num_slots, width, sum(part_outs), device=device, dtype=dtype)
        # The kernel's view of the parts: (rank column, rank, output offset, output width).
        self.parts = torch.tensor([[i * max_rank, max_rank, off, n] for i, (off, n) in
                                   enumerate(zip(self.part_offsets, part_outs, strict=True))], dtype=torch.int64)
        self.use_kernel = lora_sgmv.supports(self.At, self.Bt)

    def load(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's parts for this projection in ``slot`` (parts it lacks stay zero)."""
        self.At[slot].zero_()
        self.Bt[slot].zero_()
        for p, (a, b) in parts.items():
            r, col, row = a.shape[0], p * self.max_rank, self.part_offsets[p]
            self.At[slot, :, col:col + r] = a.T
            self.Bt[slot, col:col + r, row:row + self.part_outs[p]] = b.T

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and x.dtype == y.dtype == torch.float32 and x.stride(1) == 1 and y.stride(1) == 1:
            lora_sgmv.add(x, y, self.ctx.segment_tensor, self.At, self.Bt, self.parts)
            return y
        return self.add_native(x, y)

    def add_native(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The torch version (and the kernel's oracle): one ``mm`` + ``addmm_`` per run."""
        for start, end, slot in self.ctx.segments:
            y[start:end].addmm_(torch.mm(x[start:end], self.At[slot]), self.Bt[slot])
        return y


def lora_modules(model: nn.Module) -> dict[str, Linear]:
    """``"{layer}.{module}" -> projection`` for every projection an adapter may target."""
    out: dict[str, Linear] = {}
    layers: nn.ModuleList = model.get_submodule("model.layers")  # type: ignore[assignment]
    for i, layer in enumerate(layers):
        if isinstance(layer, nn.Identity):  # another pipeline stage's layer
            continue
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            try:
                module = layer.get_submodule(name)
            except AttributeError:
                continue  # (a mixture-of-experts layer has no dense MLP; LoRA is refused on those models)
            assert isinstance(module, Linear)
            out[f"{i}.{name}"] = module
    return out


def _parts(m: Linear) -> list[tuple[int, int]]:
    """A projection's (fused) parts as ``(in_features, out_features)``."""
    parts = getattr(m, "parts", None)
    return [(m.in_features, size) for _, size in parts] if parts else [(m.in_features, m.out_features)]


def module_shapes(model: nn.Module) -> dict[str, list[tuple[int, int]]]:
    """Each target module's parts (every layer's are the same)."""
    return {key.split(".", 1)[1]: _parts(m) for key, m in lora_modules(model).items()}


class ModelLoRA:
    """The slots of every projection of one model and the context their updates read."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.ctx = LoRAContext()
        self.modules = lora_modules(model)
        # ``dtype``: the activations' (float32 between a CPU's packed GEMMs, else the model's), which
        # the updates multiply.
        for m in self.modules.values():
            m.lora = LoRASlots(self.ctx, num_slots, m.in_features, [o for _, o in _parts(m)], max_rank, device,
                               dtype)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        for key, m in self.modules.items():
            layer, name = key.split(".", 1)
            assert m.lora is not None
            m.lora.load(slot, adapter.weights.get((int(layer), name), {}))

    def set_step(self, row_slots: list[int]) -> None:
        """The step's rows: ``row_slots[i]`` is flat row ``i``'s slot (-1: the base model)."""
        segments: list[tuple[int, int, int]] = []
        for i, slot in enumerate(row_slots):
            if slot < 0:
                continue
            if segments and segments[-1][1] == i and segments[-1][2] == slot:
                segments[-1] = (segments[-1][0], i + 1, slot)
            else:
                segments.append((i, i + 1, slot))
        self.ctx.segments = segments
        if segments:  # base-model-only steps pay no tensor
            self.ctx.segment_tensor = torch.tensor(segments, dtype=torch.int64)
