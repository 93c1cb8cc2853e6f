"""Mixture of experts: a top-k router over ``E`` gated MLPs, and an optional shared expert.

``FusedMoE`` holds each expert as two projections, ``w13[e]`` (its gate rows, then its up rows;
vLLM's layout) and ``w2[e]``, each a ``Linear``: packed like every dense projection for the GEMM
kernel the numerics chose (float32, bfloat16, int8), whose rows are independent of each other,
so a token's expert outputs never depend on which other tokens share its experts (MKL's
``F.linear`` does not promise that: tested). Under tensor parallelism each rank holds its share
of every expert's intermediate features (as ``MLP`` does) and the partial outputs are summed over
the group. The checkpoint's per-expert tensors (``experts.{e}.gate_proj`` or Mixtral's
``w1``/``w3``/``w2``) load into their expert's slice (``weight_loader``).

A token's output is the sum of its experts' outputs, each weighted by the router, added in
expert order. The rows are grouped by expert (a stable sort of the chosen ids) and each of the two
projections runs as one call over every expert (``gemm.linear_grouped``: one parallel loop over all
experts' panels, each row the bits its own expert's ``Linear`` gives it). Experts packed for the
int8 kernel, or not packed at all (no kernel on this machine, a GPU), run one after another from
Python over their tokens' rows instead, with the same sums in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.distributed import TensorParallelGroup
from pagellm.kernels import cpu_ops
from pagellm.layers.activation import gated_activation
from pagellm.layers.custom_op import CustomOp
from pagellm.layers.linear import Linear
from pagellm.layers.parallel import copy_shard
from pagellm.quantization.quant_blocks import QuantizedBlocks
from pagellm.quantization.weight_formats import GroupedExperts

# Which fused tensor and part a per-expert checkpoint tensor fills: (w13 part 0 | 1) or w2.
EXPERT_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
                "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


def num_experts(config: Any) -> int:
    """The routed experts an HF config declares (Mixtral's ``num_local_experts``, Qwen's ``num_experts``)."""
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


class CombineExperts(CustomOp):
    """``y [R, H]`` (every token's expert outputs), ``pos [T, k]`` (each token's rows of ``y``, its
    experts in ascending order), ``weights [T, k]`` -> ``[T, H]``: a token's weighted outputs added
    in expert order, the first product first (no zero), whatever else is in the batch."""

    def forward_native(self, y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        t, k = pos.shape
        weighted = (y.index_select(0, pos.reshape(-1)) * weights.reshape(-1, 1)).view(t, k, -1)
        out = weighted[:, 0]
        for j in range(1, k):
            out = out + weighted[:, j]
        return out

    def forward_cpu(self, y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return cpu_ops.moe_combine(y, pos, weights)


class FusedMoE(nn.Module):
    """``forward(x [T, H], weights [T, k], ids [T, k]) -> [T, H]``: ``sum_j weights[t, j] *
    expert_{ids[t, j]}(x[t])``, summed over the tensor-parallel group."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, config: Any,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp = tp
        self.part = tp.shard(intermediate_size)
        inter = self.part[1]
        self.w13 = nn.ModuleList(Linear(hidden_size, 2 * inter, bias=False) for _ in range(num_experts))
        self.w2 = nn.ModuleList(Linear(inter, hidden_size, bias=False) for _ in range(num_experts))
        self.act_fn = gated_activation(config)
        self.combine = CombineExperts()
        # Every expert in one call per projection, once all are packed for one float kernel (looked
        # at on the first forward, after packing); None: the experts run one by one.
        self._grouped: GroupedExperts | None = None
        self._grouped_checked = False

    def _projection(self, which: str, expert: int) -> Linear:
        """Expert ``expert``'s ``w13`` or ``w2``; a ``ValueError`` for an expert the model lacks."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (the model has {self.num_experts})")
        linear = self.w13[expert] if which == "w13" else self.w2[expert]
        assert isinstance(linear, Linear)
        return linear

    def weight_loader(self, which: str, expert: int, part: int | None, loaded: torch.Tensor) -> None:
        """Copy this rank's share of one expert's checkpoint tensor (``which``: ``w13`` with its
        ``part``, gate 0 / up 1, or ``w2``) into its slice."""
        linear = self._projection(which, expert)
        start, size = self.part
        with torch.no_grad():
            if which == "w13":
                assert part is not None
                copy_shard(linear.weight.narrow(0, part * size, size), loaded, 0, start, size)
            else:
                copy_shard(linear.weight, loaded, 1, start, size)

    def load_blocks(self, which: str, expert: int, part: int | None, blocks: QuantizedBlocks) -> None:
        """Keep this rank's share of one expert's quantized tensor at its width (``which``/``part`` as
        :meth:`weight_loader`): packed for the int8 kernel with the other projections, or
        dequantized there if not (as a share that cuts through its blocks is)."""
        linear = self._projection(which, expert)
        start, size = self.part
        share = blocks.shard(0 if which == "w13" else 1, start, size)
        shape = (size, linear.in_features) if which == "w13" else (linear.out_features, linear.in_features)
        if share.shape != shape:
            raise ValueError(f"quantized blocks {blocks.shape} for a {which} slice of {shape}")
        linear.load_blocks(share, part)

    def _grouped_kind(self) -> GroupedExperts | None:
        """The experts as one grouped format, or ``None`` where some expert is not packed for the
        float32 or bfloat16 kernel (looked at once, on the first forward after packing)."""
        if not self._grouped_checked:
            formats = [[e.weight_format for e in ps if isinstance(e, Linear)] for ps in (self.w13, self.w2)]
            self._grouped, self._grouped_checked = GroupedExperts.of(formats[0], formats[1]), True
        return self._grouped

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, k = ids.shape
        # Each token's experts in ascending order, so its sum runs in expert order whatever the batch.
        ids, slot = torch.sort(ids, dim=1)
        weights = torch.gather(weights, 1, slot)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # rows grouped by expert, tokens in order within each
        counts = torch.bincount(flat, minlength=self.num_experts)
        grouped = self._grouped_kind()
        rows = x.index_select(0, order // k)
        if grouped is not None:
            offsets = torch.zeros(self.num_experts + 1, dtype=torch.int64)
            torch.cumsum(counts, 0, out=offsets[1:])
            y = grouped.run(rows, offsets, self.act_fn, 2 * self.part[1], x.shape[1])
        else:
            y = torch.empty_like(rows)
            start = 0
            for e, n in enumerate(counts.tolist()):
                if n:
                    y[start:start + n] = self.w2[e](self.act_fn(self.w13[e](rows[start:start + n])))
                    start += n
        pos = torch.empty_like(order)  # each (token, slot)'s row of y
        pos[order] = torch.arange(order.numel(), device=order.device)
        out = self.combine(y, pos.view(t, k), weights.to(y.dtype)).to(x.dtype)
        return self.tp.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """Router (``gate``) + experts, and Qwen2-MoE's shared expert with its sigmoid gate.

    Routing is Hugging Face's: softmax over the router's logits in float32, the top-k, renormalised
    to sum to 1 where the family does (``norm_topk_prob``; Mixtral always)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, mlp_cls: Any) -> None:
        super().__init__()
        self.num_experts = num_experts(config)
        self.top_k = int(config.num_experts_per_tok)
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", True))
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        self.gate = Linear(config.hidden_size, self.num_experts, bias=False)  # (replicated: every rank routes)
        self.experts = FusedMoE(self.num_experts, config.hidden_size, inter, config, tp)
        shared = getattr(config, "shared_expert_intermediate_size", None)
        self.shared_expert = mlp_cls(config, tp, shared) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``(weights [T, k], expert ids [T, k])``."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
