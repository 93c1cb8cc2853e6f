"""AWQ and GPTQ checkpoints at their width (quantization/group_quant.py): the packed integers read as
the int8 kernel's 4- and 8-bit blocks, every value exact; float32 greedy equal to HF on the same
weights dequantized; the default numerics logprob-close and batch invariant.

Checkpoints are written here (tests/quant_writers.py, each format's published layout); the oracle
is the float64 ``s (q - z)`` of the integers the writer chose."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from quant_writers import awq_tensors, dequantize64, gptq_tensors, pack_columns, quantize

from pagellm.kernels import gemm_int8
from pagellm.quantization.group_quant import GroupQuantBlocks, GroupQuantScheme

from conftest import build_tiny_checkpoint, require_int8_kernel

# (method, bits, group, sym, v2, act_order)
LAYOUTS = {
    "awq-g32": ("awq", 4, 32, False, False, False),
    "awq-g128": ("awq", 4, 128, False, False, False),
    "gptq-4bit-asym-g64": ("gptq", 4, 64, False, False, False),
    "gptq-4bit-sym-v2-g128": ("gptq", 4, 128, True, True, False),
    "gptq-4bit-per-channel": ("gptq", 4, -1, True, False, False),
    "gptq-8bit-sym-g32": ("gptq", 8, 32, True, False, False),
    "gptq-4bit-act-order": ("gptq", 4, 64, False, False, True),
}


def test_writers_pack_the_documented_words():
    """Outputs 0..7 of one input packed into one word: AWQ's interleaved order (AutoAWQ's
    ``order_map``, vLLM's ``AWQ_REVERSE_ORDER`` undoes it) and GPTQ's sequential one."""
    x = np.arange(8).reshape(1, 8)
    assert pack_columns(x, 4, [0, 2, 4, 6, 1, 3, 5, 7]).view(np.uint32)[0, 0] == 0x75316420
    assert pack_columns(x, 4).view(np.uint32)[0, 0] == 0x76543210
    assert pack_columns(np.array([[1, 2, 3, 255]]), 8).view(np.uint32)[0, 0] == 0xFF030201


def blocks_of(layout: str, n: int = 96, k: int = 512, seed: int = 0):
    method, bits, group, sym, v2, act_order = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)) * np.exp(rng.uniform(-3, 1, (n, 1)))  # rows of different scales
    q, s, z, g_idx = quantize(w, bits, group, sym, rng.permutation(k) if act_order else None)
    parts = awq_tensors(q, s, z) if method == "awq" else gptq_tensors(q, s, z, g_idx, bits, v2)
    if not act_order:
        parts.pop("g_idx", None)  # (in order: the blocks derive it)
    scheme = GroupQuantScheme(method, bits, group, int(method == "gptq" and not v2))
    return GroupQuantBlocks.of(scheme, "layer", parts), dequantize64(q, s, z, g_idx)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_dequantize_to_the_float64_values_exactly(layout):
    blocks, ref = blocks_of(layout)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(ref.astype(np.float32)))
    assert np.array_equal(blocks.dequantize().double().numpy(), ref)  # (float32 holds every value)
    part = blocks.take(40, 72)  # outputs from inside a packed word on (AWQ and GPTQ's zeros: 8 per word)
    assert part.shape == (32, 512) and torch.equal(part.dequantize(), torch.from_numpy(ref[40:72].astype(np.float32)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_int8_kernel_takes_them_at_width(layout):
    """The fields are the kernel's blocks: its product equals float64's within the bound of the
    activations' rounding to int8 (the weights are exact), and a row's bits do not depend on the
    batch. Act-order's blocks pack in their input order, the activations permuted alike."""
    require_int8_kernel()
    from test_gguf_quant import error_bound

    from pagellm.quantization.weight_formats import Int8Packed

    blocks, ref = blocks_of(layout)
    _, bits, group, *_ = LAYOUTS[layout]
    n, k = ref.shape
    group = k if group == -1 else group
    order = blocks.input_order()
    assert (order is None) == ("act-order" not in layout)
    if order is not None:
        blocks, ref_stored, ref = blocks.in_input_order(order), ref, ref[:, order]
    fmt = blocks.kernel_format()
    # 4 bits: one d and m per group in the record (Q4_BLOCKS' own record for a group of 32)
    assert fmt == (gemm_int8.Q8_BLOCKS if bits == 8 else gemm_int8.Q4_BLOCKS if group == 32
                   else gemm_int8.Q4_GROUPS + group // 32)
    d, m, q = blocks.int8_fields()
    assert np.array_equal((d.repeat(32, axis=1) * q + m.repeat(32, axis=1)).astype(np.float64), ref)
    packed = gemm_int8.pack_blocks(d, m, q, fmt)
    panels, per_group = -(-n // 32), (2 * 4 + group * bits // 8) * 32  # d, m float32 and q, per 32 outputs
    assert packed.numel() == panels * (k // group if bits == 4 else k // 32) * (
        per_group if bits == 4 else (2 * 4 + 32) * 32)
    w = gemm_int8.BoundWeight(packed, fmt, *ref.shape)
    x = torch.randn(11, ref.shape[1])
    x[4] *= 1000.0
    y = w(x)
    err = (y.double() - x.double() @ torch.from_numpy(ref).T).abs()
    bound = error_bound(x, ref, 32)
    assert bool((err <= bound).all()) and float((err / bound).max()) > 0.01
    assert all(torch.equal(w(x[i:i + 1]), y[i:i + 1]) for i in (0, 4, 10))
    if order is not None:  # the projection reads x as stored: gathered into the blocks' order first
        stored_x = torch.empty_like(x)
        stored_x[:, torch.from_numpy(order)] = x
        got = Int8Packed(packed, fmt, n, k, None, torch.from_numpy(order)).matmul(stored_x, None)
        assert torch.equal(got, y) and bool(((got.double() - stored_x.double() @ torch.from_numpy(ref_stored).T).abs()
                                             <= bound).all())
    if fmt > gemm_int8.Q4_GROUPS:  # a group's record is its blocks' arithmetic: their bits, 25 % fewer bytes
        blocks32 = gemm_int8.pack_blocks(d, m, q, gemm_int8.Q4_BLOCKS)
        assert torch.equal(gemm_int8.BoundWeight(blocks32, gemm_int8.Q4_BLOCKS, *ref.shape)(x), y)
        assert packed.numel() * 4 == blocks32.numel() * 3 if group == 128 else packed.numel() < blocks32.numel()


def test_a_group_record_refuses_blocks_of_other_scales():
    """A group record holds one d and m: blocks that differ in either are not packed into one."""
    require_int8_kernel()
    d, m, q = blocks_of("awq-g128")[0].int8_fields()
    d[5, 2] *= 2  # block 2 of output 5: in group 0 beside blocks 0, 1 and 3
    with pytest.raises(ValueError, match="cannot pack .* as 4-bit groups of 128"):
        gemm_int8.pack_blocks(d, m, q, gemm_int8.q4_format(4))
    gemm_int8.pack_blocks(d, m, q, gemm_int8.Q4_BLOCKS)  # blocks of their own take it


def test_act_order_packs_in_its_input_order():
    """GPTQ's act-order groups are not runs of 32 inputs as stored: no kernel block holds them. Its
    inputs sorted by group are (``input_order``), and the blocks in that order are the weight's
    columns in that order, exactly."""
    blocks, ref = blocks_of("gptq-4bit-act-order")
    assert blocks.kernel_format() is None and blocks.type_name == "GPTQ int4 g64 act-order"
    order = blocks.input_order()
    groups = blocks.g_idx.numpy()[order]
    assert sorted(order) == list(range(512)) and (np.diff(groups) >= 0).all()
    ordered = blocks.in_input_order(order)
    assert ordered.kernel_format() == blocks.packing_format() == gemm_int8.Q4_GROUPS + 2
    assert ordered.type_name == "GPTQ int4 g64 act-order" and ordered.input_order() is None
    assert np.array_equal(ordered.dequantize().double().numpy(), ref[:, order])
    assert np.array_equal(ordered.take(40, 72).dequantize().double().numpy(), ref[40:72, order])
    assert blocks_of("gptq-4bit-asym-g64")[0].input_order() is None


def test_mismatched_tensors_are_refused_by_name():
    blocks, _ = blocks_of("awq-g32")
    parts = {"qweight": blocks.qweight, "qzeros": blocks.qzeros, "scales": blocks.scales[:-1]}
    with pytest.raises(ValueError, match=r"layer.scales has shape \(15, 96\); AWQ int4 g32 .* needs \(16, 96\)"):
        GroupQuantBlocks.of(blocks.scheme, "layer", parts)


@pytest.fixture(scope="module")
def quantized(ckpt_root, tmp_path_factory):
    """The tiny Llama's projections as AWQ (g32, g64 with a tied head), GPTQ 4-bit (g64, AutoGPTQ's
    zeros; g32 act-order) and GPTQ 8-bit symmetric (v2), each beside its weights dequantized as a
    plain checkpoint."""
    from quant_writers import write_quantized

    root = tmp_path_factory.mktemp("group-quant")
    out = {}
    for name, kw in {"awq": dict(method="awq", group=32), "gptq": dict(method="gptq", group=64),
                     "gptq8": dict(method="gptq", bits=8, group=32, sym=True, v2=True),
                     "awq-tied": dict(method="awq", group=64),
                     "gptq-act-order": dict(method="gptq", group=32, act_order=True)}.items():
        src = build_tiny_checkpoint(ckpt_root, "llama", tie=name.endswith("-tied"))
        out[name] = (str(root / name), str(root / f"{name}-dequantized"))
        write_quantized(src, *out[name], **kw)
    return out


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def assert_float32_equals_hf(path: str, deq: str, texts: list[str]) -> None:
    """``path``'s float32 greedy tokens equal HF's on ``deq``, its weights dequantized (but float32 ties)."""
    import transformers

    from test_hf_parity import assert_equal_but_float32_ties, engine_greedy, hf_greedy

    tok = transformers.AutoTokenizer.from_pretrained(deq)
    prompts = [tok.encode(p) for p in texts]
    hf = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    got, _ = engine_greedy(path, prompts, dtype="float32")
    assert_equal_but_float32_ties(hf, prompts, got, hf_greedy(hf, prompts))


def greedy_at_width(path: str, texts: list[str], caplog) -> tuple[list, list[list[int]], object, list[str]]:
    """``(tokens and top logprobs, prompts, engine, the numerics: lines)`` of the default numerics on
    ``path``, after checking that every layer's projection went to the int8 kernel, no float weight
    written."""
    import transformers
    from test_numerics import engine_greedy_top

    from pagellm.layers.linear import Linear
    from pagellm.quantization.weight_formats import Int8Packed

    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(p) for p in texts]
    with caplog.at_level("INFO", logger="pagellm.worker.model_loader"):
        got, engine = engine_greedy_top(path, prompts, 16)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("numerics: ")]
    assert any("every projection is stored blocks the int8 kernel" in line for line in lines), lines
    layers = [m for n, m in engine.executor.worker.model.named_modules() if isinstance(m, Linear) and ".layers." in n]
    assert len(layers) == 8 and all(isinstance(m.weight_format, Int8Packed) and m.weight.is_meta for m in layers)
    return got, prompts, engine, lines


def assert_close_and_batch_invariant(path: str, prompts: list[list[int]], got: list) -> None:
    """The default numerics' tokens logprob-close to float32's; each prompt alone gives its batch tokens."""
    from test_numerics import MAX_GAP, assert_near_ties, engine_greedy_top

    ref, _ = engine_greedy_top(path, prompts, 16, dtype="float32")
    assert_near_ties(got, ref, MAX_GAP["int8"])
    for i, p in enumerate(prompts):
        alone, _ = engine_greedy_top(path, [p], 16)
        assert alone[0][0] == got[i][0], f"prompt {i} alone differs from the batch"


@pytest.mark.parametrize("name", ["awq", "gptq", "gptq8", "gptq-act-order"])
def test_float32_greedy_equals_hf_on_the_dequantized_weights(quantized, name):
    assert_float32_equals_hf(*quantized[name], PROMPTS)


@pytest.mark.parametrize("name", ["awq", "gptq8", "awq-tied", "gptq-act-order"])
def test_default_numerics_keep_them_at_width(quantized, name, caplog):
    """dtype auto: every projection packed from the checkpoint's integers (no float weight written),
    the numerics line naming the format (act-order's in its input order, the activations permuted
    alike); the 16-bit embedding kept in 16 bits and the LM head (its own or the tied one)
    quantized to Q8_0; tokens logprob-close to float32; a prompt alone gives the tokens it gives
    in the batch."""
    require_int8_kernel()
    path, _ = quantized[name]
    got, prompts, engine, lines = greedy_at_width(path, PROMPTS, caplog)
    kind = {"awq": "AWQ int4 g32 x14: int8 GEMMs (4-bit blocks)", "gptq8": "GPTQ int8 g32 x14: int8 GEMMs (8-bit",
            "awq-tied": "AWQ int4 g64 x14: int8 GEMMs (4-bit groups of 64)",
            "gptq-act-order": "GPTQ int4 g32 act-order x14: int8 GEMMs (4-bit blocks)"}[name]
    assert any(kind in line for line in lines), lines
    model = engine.executor.worker.model
    permuted = [m.weight_format.input_order is not None for n, m in model.named_modules() if ".layers." in n
                and hasattr(m, "weight_format") and m.weight_format is not None]
    assert len(permuted) == 8 and all(permuted) == (name == "gptq-act-order") and any(permuted) == all(permuted)
    # the 16-bit LM head as Q8_0 blocks (the numerics line says so): not read in float32 beside 4-bit layers
    head = model.tied_head if name.endswith("-tied") else model.lm_head
    assert head.weight_format.fmt == gemm_int8.Q8_BLOCKS
    assert any("LM head (16-bit in the" in line and "quantized to Q8_0" in line for line in lines), lines
    embed = model.model.embed_tokens  # its rows widened from the file's float16 as tokens need them
    assert embed.kept_rows is not None and embed.kept_rows.type_name == "F16" and embed.weight.is_meta
    from safetensors.torch import load_file

    stored = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"]
    ids = torch.tensor([[0, 5, 49151], [7, 7, 1]])
    assert stored.dtype == torch.float16 and torch.equal(embed(ids), stored[ids].float())
    assert_close_and_batch_invariant(path, prompts, got)


def test_mixture_of_experts_checkpoint_at_width(ckpt_root, tmp_path, caplog):
    """Qwen3-MoE with its experts (and attention, and the dense layer's MLP) as AWQ: float32 equal to
    HF on the dequantized weights; in the default numerics every expert's projection packed from
    the checkpoint's integers, logprob-close to float32 and batch invariant."""
    from quant_writers import write_quantized
    from test_numerics import engine_greedy_top

    path, deq = str(tmp_path / "q"), str(tmp_path / "d")
    src = build_tiny_checkpoint(ckpt_root, "qwen3_moe", moe_intermediate_size=64)  # (whole groups of 32)
    write_quantized(src, path, deq, "awq", group=32)
    assert_float32_equals_hf(path, deq, PROMPTS[:2])
    require_int8_kernel()
    import transformers

    prompts = [transformers.AutoTokenizer.from_pretrained(path).encode(p) for p in PROMPTS]
    with caplog.at_level("INFO", logger="pagellm.worker.model_loader"):
        got, engine = engine_greedy_top(path, prompts, 16)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("numerics: ")]
    # 4 attention projections in each of 2 layers, the dense layer's 3, 4 experts' 3
    assert any("AWQ int4 g32 x23: int8 GEMMs (4-bit blocks)" in line for line in lines), lines
    experts = engine.executor.worker.model.model.layers[1].mlp.experts
    assert all(e.weight_format is not None and e.weight_format.name == "int8" for e in [*experts.w13, *experts.w2])
    assert_close_and_batch_invariant(path, prompts, got)


def test_refusals_name_what_is_not_supported(quantized, ckpt_root):
    from pagellm import LLM

    path, deq = quantized["awq"]
    with pytest.raises(ValueError, match="quantization='gptq', but .* holds AWQ weights"):
        LLM(path, quantization="gptq", num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="quantization='awq', but .* holds no AWQ / GPTQ / compressed-tensors weights"):
        LLM(deq, quantization="awq", num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="quantization='gguf', but .* holds AWQ weights"):
        LLM(path, quantization="gguf", num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="quantization='q8_0' quantizes a 16/32-bit checkpoint; .* AWQ int4 g32"):
        LLM(path, quantization="q8_0", num_gpu_blocks_override=16)


def test_the_quant_method_registry_is_what_users_may_choose():
    """``quantization=`` (config, torch-free) names the at-width formats; the registry
    (``quantization/quant_config.py``) reads their configs: a method in one and not the other is a
    checkpoint that cannot be forced, or a name that reads nothing. A method without a row is
    refused by name."""
    from pagellm.config.model import AT_WIDTH
    from pagellm.quantization.quant_config import QUANT_METHODS, quant_scheme

    assert set(AT_WIDTH) == {*QUANT_METHODS, "gguf"}
    config = type("Cfg", (), {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})()
    with pytest.raises(ValueError, match=r"quant_method='bitsandbytes' \(load_in_4bit=True\) is not supported yet "
                                         r"\(the method\)"):
        quant_scheme(config, "ckpt")
    awq = quant_scheme(type("Cfg", (), {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
                                                                 "zero_point": True, "version": "gemm"}})(), "ckpt")
    assert awq is not None and (awq.method, awq.name) == ("awq", "AWQ int4 g128")


def test_fused_parts_in_different_input_orders_run_dequantized(ckpt_root, tmp_path, caplog):
    """GPTQ with desc_act where q, k and v (and gate and up) each have their own order (GPTQ's own
    share one: one input, one Hessian): the fused projection has no one order to permute its input
    in, so the checkpoint runs dequantized; float32 equal to HF on the dequantized weights; the
    numerics line says so. quantization='gptq' (int8 asked): o and down (one part each) at width."""
    from quant_writers import write_quantized

    from pagellm import LLM

    path, deq = str(tmp_path / "q"), str(tmp_path / "d")
    write_quantized(build_tiny_checkpoint(ckpt_root, "llama"), path, deq, "gptq", group=32, act_order="per-module")
    assert_float32_equals_hf(path, deq, PROMPTS[:2])
    if gemm_int8.supported():
        with caplog.at_level("INFO", logger="pagellm.worker.model_loader"):
            LLM(path, num_gpu_blocks_override=16)
        assert any("GPTQ int4 g32 act-order x14: dequantized" in r.getMessage() for r in caplog.records)
        caplog.clear()
        with caplog.at_level("INFO", logger="pagellm.worker.model_loader"):
            LLM(path, quantization="gptq", num_gpu_blocks_override=16)
        assert any("GPTQ int4 g32 act-order x10: dequantized, GPTQ int4 g32 act-order x4: int8 GEMMs (4-bit blocks)"
                   in r.getMessage() for r in caplog.records)
    assert os.path.exists(os.path.join(path, "model.safetensors"))
