"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (Qwen1.5-MoE) and Qwen3-MoE.

The shared decoder with a ``SparseMoeBlock`` (``layers/moe.py``) in place of the MLP on the
sparse layers: Mixtral's every layer; Qwen's every ``decoder_sparse_step``-th layer not listed in
``mlp_only_layers``. Attention is each family's own flag (Qwen2's qkv bias, Qwen3's q/k norm).
Checkpoints name experts per expert (``mlp.experts.{e}.gate_proj``, Mixtral's
``block_sparse_moe.experts.{e}.w1``), as the published ones and transformers' ``save_pretrained``
write them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagellm.distributed import TensorParallelGroup
from pagellm.layers.moe import EXPERT_PARTS, SparseMoeBlock, num_experts
from pagellm.models.decoder import MLP, DecoderForCausalLM, DecoderLayer
from pagellm.quantization.quant_blocks import QuantizedBlocks

_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")


def is_sparse_layer(config: Any, layer: int) -> bool:
    """Qwen's rule (every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``); Mixtral,
    which has neither, has experts on every layer."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return layer not in (getattr(config, "mlp_only_layers", None) or []) and num_experts(config) > 0 \
        and (layer + 1) % step == 0


class MoeDecoderLayer(DecoderLayer):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: TensorParallelGroup, layer: int = 0) -> None:
        super().__init__(config, qkv_bias, qk_norm, tp, layer)
        if is_sparse_layer(config, layer):
            self.mlp = SparseMoeBlock(config, tp, MLP)  # type: ignore[assignment]


class MoeForCausalLM(DecoderForCausalLM):
    layer_cls = MoeDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded_elsewhere: Iterable[str] = ()) -> None:
        experts = {i: mlp.experts for i, m in enumerate(self.model.layers)
                   if isinstance(mlp := getattr(m, "mlp", None), SparseMoeBlock)}
        got: set[tuple[int, int, str, int | None]] = set()

        def others() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                name = name.replace(".block_sparse_moe.", ".mlp.")  # (Mixtral's name for it)
                per = _PER_EXPERT.fullmatch(name)
                if per is None:
                    yield name, tensor
                    continue
                layer, expert = int(per.group(1)), int(per.group(2))
                if not self.model.start <= layer < self.model.end:
                    continue  # another pipeline stage's
                moe = experts.get(layer)
                if moe is None:
                    raise ValueError(f"weight {name}: layer {layer} has no experts")
                if per.group(3) not in EXPERT_PARTS:
                    raise ValueError(f"unexpected expert weight {name}")
                which, part = EXPERT_PARTS[per.group(3)]
                try:
                    if isinstance(tensor, QuantizedBlocks):  # kept at their width (one process: every feature)
                        moe.load_blocks(which, expert, part, tensor)
                    else:
                        moe.weight_loader(which, expert, part, tensor)
                except ValueError as e:
                    raise ValueError(f"weight {name}: {e}") from None
                got.add((layer, expert, which, part))

        params = [f"model.layers.{i}.mlp.experts.{n}" for i, moe in experts.items() for n, _ in moe.named_parameters()]
        super().load_weights(others(), [*loaded_elsewhere, *params])
        want = {(i, e, w, p) for i, moe in experts.items() for e in range(moe.num_experts)
                for w, p in (("w13", 0), ("w13", 1), ("w2", None))}
        if want - got:
            missing = sorted(want - got, key=str)
            raise ValueError(f"checkpoint does not match {type(self).__name__}: {len(missing)} expert weights "
                             f"missing (layer, expert, tensor, part) {missing[:8]}")


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: Mistral's attention (and sliding window, where set), 8 experts, top-2 renormalised."""


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen1.5/Qwen2-MoE: Qwen2's qkv bias, a shared expert behind a sigmoid gate."""

    qkv_bias = True


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """Qwen3-MoE: Qwen3's q/k norm, ``norm_topk_prob``, no shared expert."""

    qk_norm = True
