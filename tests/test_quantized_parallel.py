"""Quantized checkpoints split across workers at their width: a tensor-parallel rank keeps its share
of each projection's stored blocks (a column-parallel layer's outputs, a row-parallel layer's inputs
cut on the blocks' boundaries; a share that cuts through a block is dequantized), a pipeline stage
its own layers' blocks.

Oracles: each format's own dequantization of the whole tensor, cut in the test (``gguf``'s
dequantizer, the float64 ``s (q - z)`` of the AWQ / GPTQ writer's integers, compressed-tensors'
decompression); for a model, one worker's tokens in the same numerics (logprob-close: a
row-parallel layer sums the ranks' partial products in another order than one GEMM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_gguf_quant import random_blocks, rebuilt, reference

from pagellm.quantization import gguf_quant as gq
from pagellm.quantization.quant_blocks import CutThrough

from conftest import build_tiny_checkpoint, require_int8_kernel

GGUF_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_a_gguf_input_share_is_the_dequantizers_columns(qtype):
    """Inputs 256..768 of a [64, 1024] tensor (rows in a permuted order, as llama's q / k are read):
    dequantized and as the int8 kernel's fields, gguf's values of the whole tensor cut there; a
    share starting inside a block (of 32, or 256 for the K types) is not taken."""
    b = random_blocks(qtype, 64, 1024, seed=3)
    order = np.random.default_rng(0).permutation(64)
    want = reference(b)[order][:, 256:768]
    share = b.rows(order).take_inputs(256, 768)
    assert share is not None and share.shape == (64, 512)
    assert np.array_equal(share.dequantize().numpy(), want)
    assert np.array_equal(rebuilt(share), want)
    assert np.array_equal(share.take(10, 20).dequantize().numpy(), want[10:20])
    block = gq.GGML_QUANT_SIZES[qtype][0]
    assert b.take_inputs(block // 2, 512) is None and b.take_inputs(0, 512 + block // 2) is None
    assert b.shard(1, 0, 1024) is b and b.shard(0, 8, 8).shape == (8, 1024)
    cut = b.rows(order).shard(1, 256 + block // 2, 512)  # (cut through a block: dequantized, named so)
    assert isinstance(cut, CutThrough) and cut.kernel_format() is None and "cuts its blocks" in cut.type_name
    assert np.array_equal(cut.dequantize().numpy(), reference(b)[order][:, 256 + block // 2:768 + block // 2])
    assert np.array_equal(cut.take(10, 20).dequantize().numpy(), reference(b)[order][10:20, 256 + block // 2:
                                                                                         768 + block // 2])


def test_int8_kernel_runs_an_input_share():
    """The kernel on a Q4_K share: its product is float64's on the cut weight within the rounding
    bound of the activations, and a row's bits do not depend on the batch."""
    require_int8_kernel()
    from test_gguf_quant import error_bound, packed

    b = random_blocks(T.Q4_K, 96, 1024, seed=5).take_inputs(512, 1024)
    assert b is not None
    w = reference(random_blocks(T.Q4_K, 96, 1024, seed=5))[:, 512:]
    from pagellm.kernels import gemm_int8

    kernel = gemm_int8.BoundWeight(packed(b, gemm_int8.K4), gemm_int8.K4, 96, 512)
    x = torch.randn(9, 512)
    y = kernel(x)
    err = (y.double() - x.double() @ torch.from_numpy(w).double().T).abs()
    bound = error_bound(x, w, 256)
    assert bool((err <= bound).all()) and float((err / bound).max()) > 0.01
    assert torch.equal(kernel(x[3:4]), y[3:4])


@pytest.mark.parametrize("layout", ["awq-g32", "awq-g128", "gptq-4bit-asym-g64", "gptq-4bit-per-channel",
                                    "gptq-8bit-sym-g32", "gptq-4bit-act-order"])
@pytest.mark.parametrize("lo,hi", [(128, 384), (64, 320)])
def test_an_awq_gptq_input_share_is_the_float64_columns(layout, lo, hi):
    """The writer's float64 ``s (q - z)`` cut at ``lo .. hi``, dequantized and as the kernel's fields
    (where a share starts inside a group its blocks of 32 keep the group's scale and zero point);
    act-order's share has its groups scattered, so it has no kernel format (dequantized)."""
    from test_group_quant import LAYOUTS, blocks_of

    from pagellm.kernels import gemm_int8

    blocks, ref = blocks_of(layout)
    share = blocks.take_inputs(lo, hi)
    assert share is not None and share.shape == (96, hi - lo)
    assert np.array_equal(share.dequantize().double().numpy(), ref[:, lo:hi])
    assert np.array_equal(share.take(40, 72).dequantize().double().numpy(), ref[40:72, lo:hi])
    _, bits, group, *_ = LAYOUTS[layout]
    fmt = share.packing_format()
    if "act-order" in layout:
        assert fmt is None and share.type_name.endswith("act-order")
        return
    whole = group == -1 or lo % group == 0 and (hi - lo) % group == 0
    assert fmt == (gemm_int8.Q8_BLOCKS if bits == 8 else gemm_int8.q4_format((hi - lo if group == -1 else group) // 32)
                   if whole else gemm_int8.Q4_BLOCKS)
    d, m, q = share.int8_fields()
    assert np.array_equal((d.repeat(32, axis=1) * q + m.repeat(32, axis=1)).astype(np.float64), ref[:, lo:hi])
    assert blocks.take_inputs(16, 256) is None


@pytest.mark.parametrize("name", ["w4-g32-asym", "w4-g128-sym", "w4-channel-asym", "w8a8-g64", "fp8-block",
                                  "fp8-channel"])
def test_a_compressed_tensors_input_share_is_the_librarys_columns(name):
    """compressed-tensors' own decompression of the whole tensor, cut at inputs 128..384 (FP8's
    blocks of 64 columns cut through at 128 + 64 = 192 too: 64..320)."""
    from test_compressed_tensors import TENSORS, blocks_of

    if name not in TENSORS:
        pytest.fail(f"{name} is not among test_compressed_tensors' cases {sorted(TENSORS)}")
    blocks, ref = blocks_of(name)
    for lo, hi in ((128, 384), (64, 320)):
        share = blocks.take_inputs(lo, hi)
        assert share is not None and torch.equal(share.dequantize(), ref[:, lo:hi])
        assert torch.equal(share.take(40, 72).dequantize(), ref[40:72, lo:hi])
    assert blocks.take_inputs(8, 256) is None


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K])
def test_an_embeddings_rank_reads_its_rows_from_the_blocks(qtype, monkeypatch):
    """A tensor-parallel rank's embedding keeps its rows of the file's blocks (no float copy) and
    gives gguf's rows for its tokens, zeros for the others' (before the sum over ranks)."""
    from pagellm.distributed import TensorParallelGroup
    from pagellm.layers.parallel import VocabParallelEmbedding
    from pagellm.models.cpu_packing import keep_blocks

    b = random_blocks(qtype, 11, 256, seed=2)
    want = torch.from_numpy(reference(b))
    ids = torch.tensor([[0, 5, 6, 10], [10, 10, 2, 7]])
    for rank, (start, size) in enumerate([(0, 6), (6, 5)]):
        tp = TensorParallelGroup(rank=rank, world_size=2)
        monkeypatch.setattr(tp, "all_reduce", lambda x: x)  # (this rank's addend)
        with torch.device("meta"):
            embed = VocabParallelEmbedding(11, 256, tp)
        assert keep_blocks(embed, embed.weight, "embed", None, b) == ["embed"]
        assert embed.kept_rows is not None and embed.kept_rows.shape == (size, 256) and embed.weight.is_meta
        mine = ((ids >= start) & (ids < start + size)).unsqueeze(-1)
        assert torch.equal(embed(ids), torch.where(mine, want[ids], 0.0))


# ---------------------------------------------------------------------- a model across workers
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 90)), [300, 301, 302] * 7]


def run(path: str, **kw):
    """``(tokens and top logprobs, every worker's parallel_info)`` of the default numerics."""
    from test_numerics import engine_greedy_top

    got, engine = engine_greedy_top(path, PROMPTS, 16, **kw)
    try:
        return got, engine.executor.collective_rpc("parallel_info")
    finally:
        engine.shutdown()


def assert_close(got, ref) -> None:
    from test_numerics import MAX_GAP, assert_near_ties

    assert_near_ties(got, ref, MAX_GAP["int8"])


@pytest.fixture(scope="module")
def awq_pair(ckpt_root, tmp_path_factory):
    """The tiny Llama as AWQ g32, and as GPTQ act-order g32."""
    from quant_writers import write_quantized

    root = tmp_path_factory.mktemp("quantized-parallel")
    src = build_tiny_checkpoint(ckpt_root, "llama")
    write_quantized(src, str(root / "awq"), str(root / "awq-d"), "awq", group=32)
    write_quantized(src, str(root / "act"), str(root / "act-d"), "gptq", group=32, act_order=True)
    return str(root / "awq"), str(root / "act")


def test_tensor_parallel_ranks_keep_their_share_at_width(awq_pair):
    """AWQ over 2 ranks (the tiny Llama's 2 heads and 64 MLP features each: whole blocks of 32):
    every projection and the LM head on each rank packed from its share of the integers, tokens
    logprob-close to one worker's. GPTQ act-order: a row-parallel share's inputs name groups
    scattered over both ranks, so o and down are dequantized there (and only there), the rest at
    width without a probe (ranks do not time GEMMs)."""
    require_int8_kernel()
    awq, act = awq_pair
    ref, info = run(awq)
    at_width = {"int8 4-bit blocks": 8, "int8 8-bit blocks": 1}  # (the 16-bit LM head as Q8_0)
    assert info[0]["weight_formats"] == at_width
    got, info = run(awq, tensor_parallel_size=2)
    assert [i["weight_formats"] for i in info] == [at_width] * 2 and [i["numerics"] for i in info] == ["int8"] * 2
    assert_close(got, ref)
    ref, info = run(act)
    assert info[0]["weight_formats"] == at_width
    got, info = run(act, tensor_parallel_size=2)
    assert [i["weight_formats"] for i in info] == [{"int8 4-bit blocks": 4, "int8 8-bit blocks": 1, "float32": 4}] * 2
    assert_close(got, ref)


def test_a_share_that_cuts_a_super_block_is_dequantized(tmp_path, smollm2_path):
    """A K-quant GGUF (hidden 256, 4 heads of 64) over 2 ranks: layer 0's Q4_K output projection
    splits at input 128, inside its 256-value super-blocks, so each rank dequantizes its share;
    the MLP's down projections (Q6_K, Q5_0) split at 256, at width. Tokens logprob-close to one worker."""
    require_int8_kernel()
    from test_gguf_quant import write_kquant_llama

    path = str(tmp_path / "kq.gguf")
    write_kquant_llama(path, smollm2_path)
    ref, info = run(path)
    # q, k and the 6 Q4_K projections of gate / up, o in K4 (layer 1's o is Q5_1: no kernel format)
    assert info[0]["weight_formats"]["int8 K4 super-blocks"] == 3
    got, info = run(path, tensor_parallel_size=2)
    for i in info:  # (the dequantized share's values are exactly 4-bit blocks: packed as such)
        assert i["weight_formats"]["int8 K4 super-blocks"] == 2 and sum(i["weight_formats"].values()) == 9
    assert_close(got, ref)


def test_pipeline_stages_keep_their_layers_at_width(awq_pair):
    """AWQ over 2 stages: each packs its own layer from the integers (the last the LM head);
    the hidden state crosses in float32, so the tokens are one worker's."""
    require_int8_kernel()
    awq, _ = awq_pair
    ref, _ = run(awq)
    got, info = run(awq, pipeline_parallel_size=2)
    # (only the last stage holds the LM head)
    assert [i["weight_formats"] for i in info] == [{"int8 4-bit blocks": 4}, {"int8 4-bit blocks": 4,
                                                                              "int8 8-bit blocks": 1}]
    assert [t for t, _ in got] == [t for t, _ in ref]


def test_experts_split_across_ranks_at_width(ckpt_root, tmp_path):
    """Qwen3-MoE as AWQ over 2 ranks: each expert's gate / up outputs and down inputs halved (32 of
    its 64 features: whole blocks), every expert's projection on each rank packed from its share of
    the integers; tokens logprob-close to one worker's."""
    require_int8_kernel()
    from quant_writers import write_quantized

    path = str(tmp_path / "q")
    src = build_tiny_checkpoint(ckpt_root, "qwen3_moe", moe_intermediate_size=64)
    write_quantized(src, path, str(tmp_path / "d"), "awq", group=32)
    ref, info = run(path)
    got, ranks = run(path, tensor_parallel_size=2)
    assert [i["weight_formats"] for i in ranks] == [info[0]["weight_formats"]] * 2
    # 4 experts' w13 and w2, 2 layers' qkv and o, the dense layer's 2; the router is 16-bit in the checkpoint
    assert info[0]["weight_formats"] == {"int8 4-bit blocks": 14, "int8 8-bit blocks": 1, "float32": 1}
    assert_close(got, ref)
