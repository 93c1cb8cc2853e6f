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
expert order. The experts run one after another from Python (a loop over the experts some token
chose, each over its tokens' rows): one fused call over all experts is not built yet.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagellm.distributed import TensorParallelGroup
from pagellm.layers.activation import gated_activation
from pagellm.layers.linear import Linear
from pagellm.layers.parallel import copy_shard

# Which fused tensor and part a per-expert checkpoint tensor fills: (w13 part 0 | 1) or w2.
EXPERT_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None),
                "w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


def num_experts(config: Any) -> int:
    """The routed experts an HF config declares (Mixtral's ``num_local_experts``, Qwen's ``num_experts``)."""
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


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

    def weight_loader(self, which: str, expert: int, part: int | None, loaded: torch.Tensor) -> None:
        """Copy this rank's share of one expert's checkpoint tensor (``which``: ``w13`` with its
        ``part``, gate 0 / up 1, or ``w2``) into its slice."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (the model has {self.num_experts})")
        start, size = self.part
        w13, w2 = self.w13[expert], self.w2[expert]
        assert isinstance(w13, Linear) and isinstance(w2, Linear)
        with torch.no_grad():
            if which == "w13":
                assert part is not None
                copy_shard(w13.weight.narrow(0, part * size, size), loaded, 0, start, size)
            else:
                copy_shard(w2.weight, loaded, 1, start, size)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        # Each expert's tokens (and the slot of the top-k that chose it), experts in index order.
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        k = ids.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            tokens = sel // k
            y = self.w2[e](self.act_fn(self.w13[e](x[tokens]))) * weights.reshape(-1)[sel, None]
            out[tokens] += y.to(out.dtype)  # (a token is at most once among an expert's: no lost adds)
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
