"""The mixture-of-experts layer against a float64 formula written here, and its batch invariance."""

from __future__ import annotations

import pytest
import torch
from transformers import PretrainedConfig

from pagellm.distributed import TensorParallelGroup
from pagellm.kernels import gemm
from pagellm.layers.linear import Linear
from pagellm.layers.moe import FusedMoE, SparseMoeBlock
from pagellm.models.decoder import MLP
from pagellm.quantization.weight_formats import GroupedExperts

from conftest import require_f32_gemm_kernel


def _block(e: int = 8, k: int = 2, h: int = 256, inter: int = 128, shared: int = 0, norm: bool = True):
    cfg = PretrainedConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=inter,
                           intermediate_size=inter, shared_expert_intermediate_size=shared, norm_topk_prob=norm,
                           hidden_act="silu")
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg, TensorParallelGroup(), MLP)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.1)
    return block


def _reference(block: SparseMoeBlock, x: torch.Tensor, k: int, norm: bool) -> torch.Tensor:
    """float64: softmax over all experts, top-``k`` (the config's ``num_experts_per_tok``),
    renormalised or not (its ``norm_topk_prob``; not the block's own reading of them), weighted
    SwiGLU experts."""
    xd = x.double()
    probs = torch.softmax(xd @ block.gate.weight.double().T, -1)
    w, ids = probs.topk(k, -1)
    if norm:
        w = w / w.sum(-1, keepdim=True)
    moe: FusedMoE = block.experts
    inter = moe.w2[0].in_features
    out = torch.zeros_like(xd)
    for t in range(x.shape[0]):
        for j in range(k):
            e = int(ids[t, j])
            gu = moe.w13[e].weight.double() @ xd[t]
            out[t] += w[t, j] * (moe.w2[e].weight.double() @ (torch.nn.functional.silu(gu[:inter]) * gu[inter:]))
    if block.shared_expert is not None:
        s = block.shared_expert
        gu = xd @ s.gate_up_proj.weight.double().T
        half = gu.shape[1] // 2
        y = (torch.nn.functional.silu(gu[:, :half]) * gu[:, half:]) @ s.down_proj.weight.double().T
        out += torch.sigmoid(xd @ block.shared_expert_gate.weight.double().T) * y
    return out


@pytest.mark.parametrize("shared,norm", [(0, True), (96, False)])
def test_moe_block_equals_a_float64_formula(shared, norm):
    block = _block(shared=shared, norm=norm)
    x = torch.randn(37, 256)
    with torch.no_grad():
        got = block(x)
    ref = _reference(block, x, 2, norm)
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-4), float((got.double() - ref).abs().max())


def test_a_tokens_output_does_not_depend_on_its_batch():
    """Alone, or among 63 others whose experts overlap its own: the same bits, with the projections
    packed for pagellm's GEMM kernel as the engine packs them (MKL's ``F.linear`` gave other bits
    here for some rows: the reason the experts are ``Linear`` modules)."""
    require_f32_gemm_kernel()
    block = _block(e=8, k=2)
    for m in block.modules():
        if isinstance(m, Linear):
            assert m.pack_for_cpu(torch.float32, False)
    x = torch.randn(64, 256)
    with torch.no_grad():
        whole = block(x)
        alone = torch.cat([block(x[i:i + 1]) for i in range(64)])
        _, ids = block.route(x)
    assert ids.unique().numel() == 8  # every expert shared by several tokens
    assert isinstance(block.experts._grouped, GroupedExperts)  # (all experts in one call per projection)
    assert torch.equal(whole, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_experts_in_one_call_equal_the_experts_one_by_one(dtype):
    """The grouped GEMM against the experts' own ``Linear`` calls (the path int8 experts take):
    the same bits; in float32 also the float64 formula's value (in bfloat16 the router's own
    rounding changes some tokens' near-tied choices, which the formula cannot follow)."""
    from conftest import require_amx_kernel, require_bf16_kernel

    require_f32_gemm_kernel()
    if dtype == torch.bfloat16:
        (require_amx_kernel if gemm.amx_supported() else require_bf16_kernel)()
    block = _block(e=16, k=4)
    x = torch.randn(45, 256)
    with torch.no_grad():
        ref = _reference(block, x, 4, True)
    for m in block.modules():
        if isinstance(m, Linear):
            assert m.pack_for_cpu(dtype, False)
    with torch.no_grad():
        grouped = block(x)
        grouped_kind = block.experts._grouped
        assert isinstance(grouped_kind, GroupedExperts) and grouped_kind.bits == (16 if dtype == torch.bfloat16 else 32)
        block.experts._grouped = None  # (checked already: the experts now run one by one)
        one_by_one = block(x)
    assert torch.equal(grouped, one_by_one)
    if dtype == torch.float32:
        assert torch.allclose(grouped.double(), ref, atol=1e-5, rtol=1e-4), float((grouped.double() - ref).abs().max())


def test_lora_on_a_moe_model_is_refused_at_start_up(ckpt_root):
    from pagellm import LLMEngine
    from pagellm.config import EngineArgs

    from conftest import build_tiny_checkpoint

    path = build_tiny_checkpoint(ckpt_root, "mixtral")
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters on a mixture-of-experts model"):
        LLMEngine.from_engine_args(EngineArgs(model=path, kv_cache_memory="16MiB", enable_lora=True))
