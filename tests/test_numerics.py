"""Numerics chosen per machine: the bfloat16 and int8 GEMM kernels and the quality gate of their modes.

Quality gate (vLLM's ``check_logprobs_close``): run greedy in both modes with top-5 logprobs;
wherever the tokens first diverge, each side's token must be among the other's top 5.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import transformers

from pagellm import LLMEngine, SamplingParams
from pagellm.config import EngineArgs
from pagellm.kernels import gemm, gemm_int8
from pagellm.kernels.machine import choose_numerics
from pagellm.quantization.weight_formats import Int8Packed

from conftest import (
    build_tiny_checkpoint,
    require_amx_kernel,
    require_bf16_kernel,
    require_int8_kernel,
    round_to_gguf_blocks,
    run_to_completion,
)
from test_hf_parity import SMOL_PROMPTS, random_prompts

TOP = 5
# Largest logprob gap (nats) in the float32 reference between its token and ours where greedy
# first diverges: a divergence at a larger gap is not a near tie but an error. Measured here (Xeon,
# AMX): tiny models in bfloat16 0.0004-0.11; SmolLM2 bfloat16 0.005, int8 0.015-0.33. The bounds
# leave room for other machines' kernels (AVX512-BF16 without AMX sums in another order).
MAX_GAP = {"tiny_bfloat16": 0.3, "bfloat16": 0.5, "int8": 1.0, "int8_kv": 1.0}
# The int8 paths' divergences on the tiny models and SmolLM2's K-quant file, over the medians of
# their references' margins, measured here (AMD AVX-512): 0.05-1.76 (assert_near_ties).
NEAR_TIE_MEDIANS = 3.0
BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
NEW_TOKENS = 24


def hf_greedy_top(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[dict[int, float]]]:
    """HF float32 greedy tokens and each step's top-5 tokens with their logprobs."""
    ids = torch.tensor([prompt])
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                           pad_token_id=0, bos_token_id=None, output_scores=True,
                                           return_dict_in_generate=True)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out.sequences[0, len(prompt):].tolist()
    tops = []
    for scores in out.scores:
        lp = torch.log_softmax(scores[0].double(), -1)
        top = lp.topk(TOP)
        tops.append(dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
    return tokens, tops


def engine_greedy_top(path: str | None, prompts: list[list[int]], new_tokens: int, **kw):
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, kv_cache_memory="64MiB", **kw))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=TOP)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = run_to_completion(engine)
    outs = [done[str(i)].outputs[0] for i in range(len(prompts))]
    return [(o.token_ids, [{t: lp[t].logprob for t in sorted(lp, key=lambda t: lp[t].rank)[:TOP]}
                           for lp in o.logprobs]) for o in outs], engine


def check_logprobs_close(a, b) -> list[float]:
    """Per prompt: tokens equal until the first divergence, where each side's token is in the
    other's top 5 (then the sequences are no longer comparable). Returns, for each prompt that
    diverged, the reference ``b``'s logprob gap there between its own token and ``a``'s: how
    near a tie the divergence was (0 = an exact tie)."""
    gaps = []
    for i, ((ta, topa), (tb, topb)) in enumerate(zip(a, b, strict=True)):
        for pos, (x, y) in enumerate(zip(ta, tb, strict=True)):
            if x != y:
                assert x in topb[pos] and y in topa[pos], \
                    f"prompt {i} position {pos}: {x} vs {y} not in each other's top-{TOP}"
                gaps.append(topb[pos][y] - topb[pos][x])
                break
    return gaps


def assert_near_ties(got, ref, bound: float) -> list[float]:
    """:func:`check_logprobs_close`, each divergence at a near tie: a gap of at most ``bound`` and at
    most ``NEAR_TIE_MEDIANS`` times the reference's median margin (its token over its runner-up).
    A tiny random model's distributions are flat (median margins 0.06-0.44 nats here, the widest
    0.32 on the tiny Gemma 2), so a bound in nats alone can be wider than every margin it has and
    bind on nothing; the bound used must be below some step's margin, where a divergence would
    fail (asserted). Returns the gaps."""
    margins = sorted(sorted(top.values())[-1] - sorted(top.values())[-2] for _, tops in ref for top in tops)
    limit = min(bound, NEAR_TIE_MEDIANS * margins[len(margins) // 2])
    assert margins[-1] > limit, f"no step's margin exceeds the near-tie bound {limit:.3f}: it cannot bind"
    gaps = check_logprobs_close(got, ref)
    assert all(g <= limit for g in gaps), f"divergences at logprob gaps {gaps} (near-tie bound {limit:.3f})"
    return gaps


# ---------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("amx", [False, True])
def test_bf16_gemm_equals_the_rounded_product_and_is_batch_invariant(amx):
    (require_amx_kernel if amx else require_bf16_kernel)()
    torch.manual_seed(0)
    for n, k in ((960, 576), (576, 1536), (33, 577), (5, 40)):
        w, x, b = torch.randn(n, k), torch.randn(150, k), torch.randn(n)
        packed = gemm.pack_bf16(w)
        for bias in (b, None):  # (without a bias, whole AMX tiles are stored straight into y)
            y = gemm.linear(x, packed, n, bias, bits=16, amx=amx)
            # The exact product of the bf16-rounded inputs, plus the bias: only the float32 sums' order differs.
            ref = x.bfloat16().double() @ w.bfloat16().double().T + (0 if bias is None else b.double())
            torch.testing.assert_close(y.double(), ref, atol=2e-3, rtol=1e-5)
            for m in (1, 2, 13, 15, 16, 17, 31, 33, 64, 149):
                for start in (0, 1):
                    part = gemm.linear(x[start:start + m], packed, n, bias, bits=16, amx=amx)
                    assert torch.equal(part, y[start:start + m]), \
                        f"row results changed with the batch (m={m}, {start=}, bias={bias is not None})"


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_gemm_rounds_x_as_torch_does(amx):
    """x times the identity is x rounded to bfloat16 (every other term is an exact zero), ties to even
    as torch rounds, over random bit patterns of normal numbers far from the ends (the dot-product
    instructions flush subnormals; inf times zero would be NaN)."""
    (require_amx_kernel if amx else require_bf16_kernel)()
    torch.manual_seed(0)
    k = 53  # (three 16-lane runs and a tail)
    mantissa = torch.randint(0, 2**23, (40, k), dtype=torch.int32)
    exponent = torch.randint(127 - 60, 127 + 60, (40, k), dtype=torch.int32)
    sign = torch.randint(0, 2, (40, k), dtype=torch.int32)
    x = ((sign << 31) | (exponent << 23) | mantissa).view(torch.float32).clone()
    x[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20])  # ties both ways, past a tie
    x[1, 48:] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 3 * 2**-8), 2 - 2**-9, 1 + 2**-9])  # in the scalar tail
    y = gemm.linear(x, gemm.pack_bf16(torch.eye(k)), k, bits=16, amx=amx)
    assert torch.equal(y, x.bfloat16().float())


def int8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """llama.cpp's activation rounding written plainly, in float32 as the kernel does it: per row and
    run of 32, xq = round(x * (127 / max|x|)) and scale max|x| / 127; then the exact product (float64)
    of the rounded x with the dequantized weight."""
    xb = x.view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    xq = torch.round(xb * (127 / amax)).clamp(-127, 127)
    return (xq.double() * (amax / 127).double()).view(x.shape) @ w.double().T


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_gemm_equals_the_rounded_product_and_is_batch_invariant(bits):
    require_int8_kernel()
    torch.manual_seed(0)
    for n, k in ((960, 576), (576, 1536), (33, 64)):
        w, x, b = round_to_gguf_blocks(torch.randn(n, k) * 0.05, bits), torch.randn(150, k), torch.randn(n)
        packed = gemm_int8.pack(w)
        assert packed is not None and packed[1] == bits, "exact GGUF blocks must be recognised"
        y = gemm_int8.linear(x, packed[0], bits, n, b)
        ref = int8_reference(x, w) + b.double()
        torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
        for m in (1, 2, 5, 6, 7, 13, 64, 149):
            for start in (0, 1):
                part = gemm_int8.linear(x[start:start + m], packed[0], bits, n, b)
                assert torch.equal(part, y[start:start + m]), f"row results changed with the batch (m={m}, {start=})"
    assert gemm_int8.pack(torch.randn(64, 64)) is None  # plain float32: nothing to keep at 4 or 8 bits
    w = round_to_gguf_blocks(torch.randn(64, 64), bits)
    w[3, 40] += 1e-3  # one value off its block: the whole weight is refused, never approximated
    assert gemm_int8.pack(w) is None


def test_a_linear_layer_calls_its_bound_int8_weight_and_checks_what_it_is_given():
    """``Linear.pack_for_cpu`` binds the int8 weight and the bias once; the layer's output is the
    checked ``gemm_int8.linear``'s, 3-D inputs and strided rows included, and bad inputs are
    ``ValueError``s naming what is wrong, not a crash in C."""
    require_int8_kernel()
    from pagellm.layers.linear import Linear

    torch.manual_seed(2)
    lin = Linear(64, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(round_to_gguf_blocks(torch.randn_like(lin.weight) * 0.1, 4))
    assert lin.pack_for_cpu(int8=True) and lin.bound_i8 is not None
    fmt = lin.weight_format
    assert isinstance(fmt, Int8Packed)
    x = torch.randn(3, 5, 128)[..., ::2]  # rows whose last dimension is strided
    with torch.inference_mode():
        y = lin(x)
        assert y.shape == (3, 5, 40)
        assert torch.equal(y, gemm_int8.linear(x.contiguous(), fmt.packed, fmt.fmt, 40, lin.bias))
        assert torch.equal(lin(x[1, 2:3]), y[1, 2:3])
        wrong_width, wrong_dtype = torch.randn(2, 63), torch.randn(2, 64, dtype=torch.float64)
        for bad, match in ((wrong_width, r"\[\.\.\., 64\]"), (wrong_dtype, "float32")):
            with pytest.raises(ValueError, match=match):
                lin(bad)
    with pytest.raises(ValueError, match="does not fit"):
        gemm_int8.BoundWeight(fmt.packed, 4, 65, 64)


def test_long_prefill_through_the_int8_mlp_in_slices_gives_the_same_bits(monkeypatch):
    """``MLP.forward`` slices more than MLP_CHUNK_MIN_ROWS rows over the int8 kernels (cache-sized
    passes): the output is the unsliced pass's bit for bit, and a row's is its own alone. Over
    float32 weights (0.95x sliced) it never slices."""
    require_int8_kernel()
    from types import SimpleNamespace

    from pagellm.distributed import TensorParallelGroup
    from pagellm.models import decoder

    torch.manual_seed(1)
    config = SimpleNamespace(hidden_size=64, intermediate_size=96)
    mlp = decoder.MLP(config, TensorParallelGroup())
    with torch.no_grad():
        for lin in (mlp.gate_up_proj, mlp.down_proj):
            lin.weight.copy_(round_to_gguf_blocks(torch.randn_like(lin.weight) * 0.1, 4))
            assert lin.pack_for_cpu(int8=True) and isinstance(lin.weight_format, Int8Packed)
    sliced: list[int] = []
    real = mlp._forward
    monkeypatch.setattr(mlp, "_forward", lambda x: sliced.append(x.shape[0]) or real(x))
    x = torch.randn(decoder.MLP_CHUNK_MIN_ROWS + 77, 64)
    with torch.inference_mode():
        y = mlp(x)
        rows = decoder.MLP_CHUNK_ROWS
        assert sliced == [rows] * (len(x) // rows) + [len(x) % rows]
        assert torch.equal(y, real(x))
        assert torch.equal(y[300:301], real(x[300:301]))
        sliced.clear()
        mlp(x[:decoder.MLP_CHUNK_MIN_ROWS])
        assert sliced == [decoder.MLP_CHUNK_MIN_ROWS]
        plain = decoder.MLP(config, TensorParallelGroup())
        plain.gate_up_proj.pack_for_cpu()
        plain.down_proj.pack_for_cpu()
        assert not plain._sliceable()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_long_prefill_projects_its_qkv_in_slices_with_the_same_bits(ckpt_root, monkeypatch, arch):
    """A step of more than QKV_CHUNK_MIN_ROWS tokens over the int8 kernels projects its qkv in
    slices, each slice's K/V written to the cache before the attention reads them back (Qwen3: its
    q/k norms per slice), its queries over the dead normed input where a query row fits in an input
    row (Llama here; Qwen3's are wider), the output projection and a sliced MLP's output written over
    their dead inputs. Greedy tokens and logprobs are the run's without any of it (unsliced, fresh
    outputs) bit for bit, over a fresh chunk and a step whose first chunk follows cached tokens."""
    require_int8_kernel()
    from pagellm.models import decoder

    path = build_tiny_checkpoint(ckpt_root, arch)
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=rng).tolist() for n in (900, 500)]
    sliced: list[int] = []
    reused: list[tuple[str, int, bool]] = []  # (module, rows, output over its input)
    real = decoder.Attention._queries_in_slices
    real_attention, real_mlp = decoder.Attention.forward, decoder.MLP.forward
    allow = [True]

    def same(a, b):
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    def counted(self, rope, x, kv_cache, meta, over_input):
        sliced.append(x.shape[0])
        queries = real(self, rope, x, kv_cache, meta, over_input)
        assert over_input and same(queries, x) == (queries.shape[1] * queries.shape[2] <= x.shape[1])
        return queries

    def attention(self, rope, x, kv_cache, meta, reuse_input=False):
        out = real_attention(self, rope, x, kv_cache, meta, reuse_input and allow[0])
        reused.append(("attention", x.shape[0], same(out, x)))
        return out

    def mlp(self, x, reuse_input=False):
        out = real_mlp(self, x, reuse_input and allow[0])
        reused.append(("mlp", x.shape[0], same(out, x)))
        return out

    monkeypatch.setattr(decoder.Attention, "_queries_in_slices", counted)
    monkeypatch.setattr(decoder.Attention, "forward", attention)
    monkeypatch.setattr(decoder.MLP, "forward", mlp)
    runs = []
    for min_rows in (decoder.QKV_CHUNK_MIN_ROWS, 1 << 30):
        monkeypatch.setattr(decoder, "QKV_CHUNK_MIN_ROWS", min_rows)
        got, engine = engine_greedy_top(path, prompts, NEW_TOKENS, quantization="q8_0",
                                        max_num_batched_tokens=600, long_prefill_token_threshold=0)
        assert engine.model_info.dtype == "int8"
        runs.append((got, list(sliced), list(reused)))
        sliced.clear()
        reused.clear()
        allow[0] = False
    layers = transformers.AutoConfig.from_pretrained(path).num_hidden_layers
    assert runs[0][1] == [600] * layers * 2 and runs[1][1] == []  # (steps of 600, 600, then 201 tokens)
    # Every attention writes its output over its input; an MLP where it runs in slices (> 256 rows).
    assert all(over == (name == "attention" or rows > decoder.MLP_CHUNK_MIN_ROWS) for name, rows, over in runs[0][2])
    assert sum(over for *_, over in runs[0][2]) >= 4 * layers and not any(over for *_, over in runs[1][2])
    assert runs[0][0] == runs[1][0]


def test_only_backends_that_read_the_steps_kv_from_the_cache_let_it_be_written_in_slices():
    """``reads_kv_from_cache``: the reference's fresh prefill attends to the K/V it is given, so a
    step with one is never sliced; the CPU kernels' groups (and the reference's paged ones) read the
    cache. ``forward`` without K/V that are not written is a ``ValueError``."""
    from pagellm.attention.cpu_paged import CpuPagedAttention
    from pagellm.attention.torch_paged import TorchPagedAttention

    cpu = torch.device("cpu")
    chunks = [(0, 5, [0]), (16, 3, [1, 2])]  # a fresh chunk, one after cached tokens
    ref, kernels = TorchPagedAttention(), CpuPagedAttention(True, True, True)
    assert not ref.reads_kv_from_cache(ref.build_metadata([], [], chunks[:1], 16, cpu))
    assert ref.reads_kv_from_cache(ref.build_metadata([17], [[3, 4]], chunks[1:], 16, cpu))
    assert kernels.reads_kv_from_cache(kernels.build_metadata([17], [[3, 4]], chunks, 16, cpu))
    meta = ref.build_metadata([], [], chunks[:1], 16, cpu)
    cache = torch.zeros(64, 2, 16)
    with pytest.raises(ValueError, match="kv_written"):
        ref.forward(torch.zeros(5, 4, 16), None, None, cache, cache, meta, 0.25)


def test_int8_needs_gguf_blocks_and_the_kernel(ckpt_root, monkeypatch):
    path = build_tiny_checkpoint(ckpt_root, "llama")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(model=path, quantization="fp8").create_engine_config()
    monkeypatch.setenv("PAGELLM_CPU_INT8", "0")
    with pytest.raises(ValueError, match="needs the int8 GEMM kernel"):
        choose_numerics("auto", [torch.randn(64, 64)], quantization="gguf")
    monkeypatch.delenv("PAGELLM_CPU_INT8")
    require_int8_kernel()
    with pytest.raises(ValueError, match="quantization='gguf' found no weights the int8 kernel takes"):
        LLMEngine.from_engine_args(EngineArgs(model=path, quantization="gguf", kv_cache_memory="16MiB"))


def test_numerics_choice(monkeypatch):
    w = [torch.randn(64, 64)]
    assert choose_numerics("float32", w).compute_dtype == torch.float32
    monkeypatch.setenv("PAGELLM_CPU_BF16", "0")  # the ISA path disabled: auto must fall back, bfloat16 cannot run
    assert choose_numerics("auto", w).compute_dtype == torch.float32
    with pytest.raises(ValueError, match="no bfloat16 GEMM kernel"):
        choose_numerics("bfloat16", w)
    monkeypatch.delenv("PAGELLM_CPU_BF16")
    monkeypatch.setenv("PAGELLM_CPU_GEMM", "0")  # the GEMM kernels off: no bf16 either, auto is float32
    assert not gemm.bf16_supported() and choose_numerics("auto", w).compute_dtype == torch.float32
    monkeypatch.delenv("PAGELLM_CPU_GEMM")
    require_bf16_kernel()
    assert choose_numerics("bfloat16", w).compute_dtype == torch.bfloat16
    n = choose_numerics("auto", w, probe=True)
    assert n.compute_dtype in (torch.float32, torch.bfloat16) and "measured" in n.reason and not n.int8


def test_numerics_choice_for_gguf_blocks(monkeypatch):
    """Weights that are GGUF blocks: auto times int8 against the dtype it would otherwise choose;
    float32 and bfloat16 asked for never turn into int8; PAGELLM_CPU_INT8=0 turns the path off."""
    require_int8_kernel()
    w = [round_to_gguf_blocks(torch.randn(256, 128), 4), round_to_gguf_blocks(torch.randn(128, 256), 8)]
    n = choose_numerics("auto", w)
    assert "int8" in n.reason and "measured" in n.reason, n.reason
    assert not choose_numerics("float32", w).int8
    if gemm.bf16_supported():
        assert not choose_numerics("bfloat16", w).int8
    assert not choose_numerics("auto", w, probe=False).int8  # unprobed (tensor parallel): never
    assert choose_numerics("float32", w, quantization="gguf").int8  # asked for
    monkeypatch.setenv("PAGELLM_CPU_INT8", "0")
    assert not choose_numerics("auto", w).int8


def stored_in_bfloat16(ckpt_root: str, dtype: torch.dtype) -> str:
    """The tiny llama with its weights rounded to bfloat16, stored in ``dtype``."""
    path = os.path.join(ckpt_root, f"tiny-llama-bf16-stored-{str(dtype)[6:]}")
    if not os.path.exists(os.path.join(path, "config.json")):
        src = build_tiny_checkpoint(ckpt_root, "llama")
        hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        hf.to(dtype).save_pretrained(path, safe_serialization=True)
        transformers.AutoTokenizer.from_pretrained(src).save_pretrained(path)
    return path


def test_a_bfloat16_checkpoint_is_loaded_and_packed_without_a_float32_copy(ckpt_root, monkeypatch, caplog):
    """An HF checkpoint stored in bfloat16, run with bfloat16 GEMMs: its projections are loaded in
    bfloat16 (every Linear's weight is bfloat16 when loading ends, none float32) and give the bits of
    the same values stored in float32 (loaded in float32, then rounded to bfloat16 when packed)."""
    require_bf16_kernel()
    from pagellm.layers.linear import Linear
    from pagellm.models.decoder import DecoderForCausalLM

    paths = {dtype: stored_in_bfloat16(ckpt_root, dtype) for dtype in (torch.bfloat16, torch.float32)}
    seen: list[set[torch.dtype]] = []
    load = DecoderForCausalLM.load_weights

    def spy(self, weights):
        load(self, weights)
        seen.append({m.weight.dtype for m in self.modules() if isinstance(m, Linear)})
    monkeypatch.setattr(DecoderForCausalLM, "load_weights", spy)
    prompts = random_prompts(4, seed=3, hi=60)
    with caplog.at_level("INFO", logger="pagellm.worker.model_loader"):
        got16, _ = engine_greedy_top(paths[torch.bfloat16], prompts, 12, dtype="bfloat16")
    assert seen == [{torch.bfloat16}]
    assert any("projections loaded in bfloat16" in r.getMessage() for r in caplog.records)
    got32, _ = engine_greedy_top(paths[torch.float32], prompts, 12, dtype="bfloat16")
    assert seen[1] == {torch.float32}
    assert got16 == got32


def test_quantization_q8_0_quantizes_on_load_and_stays_logprob_close(ckpt_root, caplog):
    """``quantization="q8_0"`` on an HF checkpoint stored in bfloat16: every projection of the layers
    becomes gguf's Q8_0 blocks on load (loaded in bfloat16, never float32) and runs the int8 kernel;
    greedy tokens stay logprob-close to Hugging Face float32 on the same (bfloat16-valued) weights.
    A GGUF file is refused with an error naming the option."""
    require_int8_kernel()
    path = stored_in_bfloat16(ckpt_root, torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(6, seed=7, hi=100)
    ref = [hf_greedy_top(hf, p, NEW_TOKENS) for p in prompts]
    with caplog.at_level("INFO", logger="pagellm.worker.model_loader"):
        got, engine = engine_greedy_top(path, prompts, NEW_TOKENS, quantization="q8_0")
    assert engine.model_info.dtype == "int8"
    lines = [r.getMessage() for r in caplog.records]
    assert any("8 of 8 projections quantized to Q8_0" in m for m in lines), lines  # 2 layers x qkv, o, gate_up, down
    assert any("Q8_0 x8: int8 GEMMs (8-bit blocks)" in m for m in lines), lines
    assert any("projections loaded in bfloat16" in m for m in lines), lines
    assert_near_ties(got, ref, MAX_GAP["int8"])
    with pytest.raises(ValueError, match="quantization='q8_0' quantizes an HF checkpoint"):
        LLMEngine.from_engine_args(EngineArgs(model=None, quantization="q8_0", kv_cache_memory="32MiB"))


# ---------------------------------------------------------------------- the quality gate
# The other families too: bfloat16 GEMMs (the experts' grouped ones), a float16 cache read by the
# decode kernel with windows and soft-caps; Phi-3 served within its trained length (its short
# longrope factors, as HF takes them for these prompts). Not the tiny Mixtral: its prompt 1 leaves
# HF's top 5 at its second token in bfloat16, and so does HF itself with its attention and LM head
# weights and inputs rounded to bfloat16 (the same token): that checkpoint is too sensitive for the gate.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "qwen2_moe",
                                  "qwen3_moe"])
def test_bfloat16_is_logprob_close_to_hf_float32(ckpt_root, arch):
    require_bf16_kernel()
    path = build_tiny_checkpoint(ckpt_root, arch)
    prompts = random_prompts(8, seed=5, hi=120)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = [hf_greedy_top(hf, p, NEW_TOKENS) for p in prompts]
    extra = {"max_model_len": 512} if arch == "phi3" else {}
    got, engine = engine_greedy_top(path, prompts, NEW_TOKENS, dtype="bfloat16", **extra)
    assert engine.model_info.dtype == "bfloat16"
    # The tiny random models' next-token distributions are nearly flat (top logprobs about -5.5,
    # neighbours 0.01-0.1 nats apart), so most prompts meet a near tie within 24 tokens; what must
    # hold is that each divergence is one: measured gaps 0.0004-0.11 nats (llama, qwen2, qwen3).
    gaps = check_logprobs_close(got, ref)
    assert all(g <= MAX_GAP["tiny_bfloat16"] for g in gaps), f"divergences at HF logprob gaps {gaps}"


def test_a_16_bit_model_without_the_cpu_kernels_computes_in_its_own_dtype(ckpt_root, tmp_path):
    """``dtype="float16"`` (no CPU kernel takes it) and ``dtype="bfloat16"`` with the kernels off:
    the projections keep the model's dtype and ``F.linear`` runs in it (they were widened to
    float32 for packing, which then failed on 16-bit activations), logprob-close to HF float32."""
    import subprocess

    from pagellm.layers.linear import Linear

    path = build_tiny_checkpoint(ckpt_root, "llama")
    prompts = random_prompts(4, seed=7, hi=120)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got, engine = engine_greedy_top(path, prompts, NEW_TOKENS, dtype="float16")
    linears = [m for m in engine.executor.worker.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == torch.float16 and m.weight_format is None for m in linears)
    gaps = check_logprobs_close(got, [hf_greedy_top(hf, p, NEW_TOKENS) for p in prompts])
    assert all(g <= MAX_GAP["tiny_bfloat16"] for g in gaps), f"divergences at HF logprob gaps {gaps}"
    # A bfloat16 checkpoint with the kernels off, in a process of its own (the kernels are chosen
    # once per process).
    bf16 = str(tmp_path / "bf16")
    transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(bf16)
    transformers.AutoTokenizer.from_pretrained(path).save_pretrained(bf16)
    code = ("from pagellm import LLM, SamplingParams; import torch; from pagellm.layers.linear import Linear\n"
            f"llm = LLM({bf16!r}, dtype='bfloat16')\n"
            "out = llm.generate([[1, 5, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), "
            "use_tqdm=False)\n"
            "m = llm.llm_engine.executor.worker.model\n"
            "assert all(x.weight.dtype == torch.bfloat16 for x in m.modules() if isinstance(x, Linear))\n"
            "print(len(out[0].outputs[0].token_ids))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PAGELLM_CPU_KERNELS": "0"})
    assert run.returncode == 0 and run.stdout.split()[-1] == "6", run.stderr[-2000:]


def test_the_tiny_mixtrals_bfloat16_divergences_are_hfs_own(ckpt_root):
    """Why the tiny Mixtral is not in the gate above: where pagellm's bfloat16 run leaves the float32
    reference's top 5, HF itself does, at the same position with the same tokens, once its attention
    and LM head GEMMs see bfloat16-rounded weights and inputs (its experts are not ``nn.Linear``
    modules and stay float32), as pagellm's bfloat16 kernel rounds them. Random weights drawn at
    0.2 make this checkpoint that sensitive; the divergence is the numerics', not the engine's."""
    require_bf16_kernel()
    path = build_tiny_checkpoint(ckpt_root, "mixtral")
    prompts = random_prompts(8, seed=5, hi=120)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = [hf_greedy_top(hf, p, NEW_TOKENS) for p in prompts]
    got, _ = engine_greedy_top(path, prompts, NEW_TOKENS, dtype="bfloat16")
    rounded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, m in rounded.named_modules():
            if isinstance(m, torch.nn.Linear) and not name.endswith(".gate"):
                m.weight.copy_(m.weight.bfloat16().float())
                m.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    emulated = [hf_greedy_top(rounded, p, NEW_TOKENS) for p in prompts]
    far = 0
    for i in range(len(prompts)):
        try:
            check_logprobs_close([got[i]], [ref[i]])
        except AssertionError:
            far += 1
            pos = next(j for j, (x, y) in enumerate(zip(got[i][0], ref[i][0], strict=True)) if x != y)
            assert got[i][0][:pos + 1] == emulated[i][0][:pos + 1], f"prompt {i}: pagellm's divergence is its own"
    assert far > 0, "the tiny Mixtral now passes the gate: move it back into the test above"


# mode -> (engine arguments, the numerics the engine reports)
# mode -> (engine arguments, the GEMM numerics it must report). "int8_kv": float32 GEMMs over an
# int8 K/V cache (opt-in; through the int8 attention kernel where the machine has AVX-512).
MODES = {"bfloat16": ({"dtype": "bfloat16"}, "bfloat16"), "int8": ({"quantization": "gguf"}, "int8"),
         "int8_kv": ({"dtype": "float32", "kv_cache_dtype": "int8"}, "float32")}


def require_mode(mode: str) -> None:
    if mode != "int8_kv":  # (the int8 cache's pure PyTorch path runs anywhere)
        (require_bf16_kernel if mode == "bfloat16" else require_int8_kernel)()


@pytest.fixture(scope="module")
def smollm2_hf_top(smollm2_hf):
    """The prompts and HF float32's greedy tokens with each step's top-5, computed once for every mode."""
    tok, hf = smollm2_hf
    prompts = [tok.encode(p) for p in SMOL_PROMPTS]
    return prompts, [hf_greedy_top(hf, p, 32) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_smollm2_is_logprob_close_to_hf_float32(smollm2_hf_top, mode):
    require_mode(mode)
    prompts, ref = smollm2_hf_top
    kwargs, numerics = MODES[mode]
    got, engine = engine_greedy_top(None, prompts, 32, **kwargs)
    assert engine.model_info.dtype == numerics
    gaps = check_logprobs_close(got, ref)
    assert len(gaps) <= len(prompts) // 2, f"{len(gaps)} of {len(prompts)} prompts diverged from HF float32"
    assert all(g <= MAX_GAP[mode] for g in gaps), f"divergences at HF logprob gaps {gaps}"


def _perplexity(**kwargs) -> float:
    """The shipped text (benchmarks/data/quality_text.txt), teacher-forced through an engine."""
    sys.path.insert(0, BENCHMARKS)
    from quality import TEXT, perplexity

    engine = LLMEngine.from_engine_args(EngineArgs(model=None, kv_cache_memory="256MiB", **kwargs))
    with open(TEXT) as f:
        ids = engine.get_tokenizer().encode(f.read())
    assert len(ids) > 400
    try:
        return perplexity(engine, ids)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def float32_perplexity() -> float:
    return _perplexity(dtype="float32")


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_smollm2_perplexity_within_1_percent_of_float32(float32_perplexity, mode):
    require_mode(mode)
    ppl = {"float32": float32_perplexity, mode: _perplexity(**MODES[mode][0])}
    assert 1.0 < ppl["float32"] < 100.0, ppl  # the model reads the text as text
    assert abs(ppl[mode] / ppl["float32"] - 1.0) < 0.01, ppl
