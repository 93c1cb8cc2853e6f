"""GGUF blocks kept at their width: the fields read from a file's bytes against ``gguf``'s own
dequantizer (bit for bit), the int8 kernel over them against a float64 GEMM of ``gguf``'s floats
(within the bound that rounding x to 8 bits allows), batch invariance, and a model written as
K-quants that runs on those kernels and equals Hugging Face's GGUF loader in float32."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.kernels import gemm_int8
from pagellm.quantization import gguf_quant as gq
from pagellm.quantization.quant_blocks import combined_format
from pagellm.weights.gguf_write import DecoderShape, write_decoder_gguf

from conftest import require_int8_kernel, round_to_gguf_blocks

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
F16_SCALES = [0.0, 6e-8, 1e-4, 0.01, 1.0, 300.0, 65504.0]  # zero, subnormal, up to half precision's max


def int8_format(qtypes: list[T]) -> int | None:
    """The kernel format of a projection whose fused parts have ``qtypes``."""
    return combined_format(gq.part_format(t) for t in qtypes)


def random_blocks(qtype: T, rows: int, k: int, seed: int, scale: float | None = None) -> gq.GGUFBlocks:
    """Valid blocks with random bytes: any quants and 6-bit scales are valid, and every half-precision
    scale is set to a finite value (``scale``, or random magnitudes in [1e-3, 1e-1])."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows * k // block, size), dtype=np.uint8)
    nb = data.shape[0]

    def f16(n: int) -> np.ndarray:
        v = np.full(n, scale, np.float32) if scale is not None else rng.uniform(1e-3, 1e-1, n).astype(np.float32)
        return v.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype in (T.Q6_K, T.Q3_K):  # d last
        data[:, size - 2:size] = f16(nb)
    elif qtype == T.Q2_K:  # d, dmin last
        data[:, 80:82], data[:, 82:84] = f16(nb), f16(nb)
    else:
        data[:, 0:2] = f16(nb)
        if qtype in (T.Q4_1, T.Q4_K, T.Q5_K):
            data[:, 2:4] = f16(nb)
    return gq.GGUFBlocks(data.reshape(rows, -1), qtype, (rows, k))


def reference(b: gq.GGUFBlocks) -> np.ndarray:
    return gguf.dequantize(b.data, b.qtype).reshape(b.shape)


def rebuilt(b: gq.GGUFBlocks) -> np.ndarray:
    """The weight from the fields pagellm read, in float32 with the operations GGUF's format defines."""
    f32 = np.float32
    if b.qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        d, dmin, sc, mn, q = gq.kquant_fields(b)
        d16, dmin16 = np.repeat(d, 16, axis=1), np.repeat(dmin, 16, axis=1)
        for t, off in ((T.Q6_K, 32), (T.Q3_K, 4)):  # w = (d sc)(q - off), and mn must be sc with dmin = off d
            if b.qtype == t:
                assert np.array_equal(mn, sc) and np.array_equal(off * d, dmin)
                return np.repeat((d16 * sc).astype(f32), 16, axis=1) * (q.astype(f32) - off)
        return (np.repeat((d16 * sc).astype(f32), 16, axis=1) * q.astype(f32)
                - np.repeat((dmin16 * mn).astype(f32), 16, axis=1))
    d, m, q = gq.legacy_fields(b)
    d32, m32 = np.repeat(d, 32, axis=1), np.repeat(m, 32, axis=1)
    if b.qtype == T.Q4_0:  # w = d (q - 8), and m must be -8 d
        assert np.array_equal(m, -8 * d)
        return d32 * (q.astype(f32) - 8)
    return d32 * q.astype(f32) + m32


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([None, *F16_SCALES]))
def test_fields_equal_gguf_dequantize_bit_for_bit(qtype, seed, scale):
    b = random_blocks(qtype, 3, 512, seed, scale)
    np.testing.assert_array_equal(rebuilt(b), reference(b))


def packed(b: gq.GGUFBlocks, fmt: int) -> torch.Tensor:
    if fmt in (gemm_int8.K4, gemm_int8.K6):
        return gemm_int8.pack_kquant(*gq.kquant_fields(b), fmt)
    return gemm_int8.pack_blocks(*gq.legacy_fields(b), fmt)


def error_bound(x: torch.Tensor, w: np.ndarray, block: int) -> torch.Tensor:
    """|x W^T - y| allowed per output: each x rounded to the nearest of 255 levels of its block's
    max |x| (error <= max / 254) times |w|, plus float32 rounding of the result."""
    m, k = x.shape
    step = x.double().abs().reshape(m, k // block, block).amax(dim=2) / 254.0
    absw = torch.from_numpy(np.abs(w)).double().reshape(w.shape[0], k // block, block).sum(dim=2)
    exact = x.double().abs() @ torch.from_numpy(np.abs(w)).double().T
    return step @ absw.T * 1.001 + 1e-5 * exact + 1e-30


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_kernel_matches_float64_within_the_rounding_bound(qtype):
    require_int8_kernel()
    n, k = 70, 768  # a partial panel of outputs, three super-blocks
    b = random_blocks(qtype, n, k, seed=1)
    w = reference(b)
    fmt = int8_format([qtype])
    assert fmt is not None
    x = torch.randn(13, k)
    x[5] *= 1000.0  # rows of very different magnitudes
    bound_w = gemm_int8.BoundWeight(packed(b, fmt), fmt, n, k)
    y = bound_w(x)
    exact = x.double() @ torch.from_numpy(w).double().T
    block = 256 if fmt in (gemm_int8.K4, gemm_int8.K6) else 32
    err = (y.double() - exact).abs()
    bound = error_bound(x, w, block)
    assert bool((err <= bound).all()), f"max error / bound {float((err / bound).max()):.3f}"
    assert float((err / bound).max()) > 0.01  # (the activations really were rounded)
    for rows in (1, 4, 7):  # batch invariance: a row alone, or in other batches, gives the same bits
        assert torch.equal(bound_w(x[2:2 + rows]), y[2:2 + rows])
    into = torch.full((13, n), float("nan"))
    assert bound_w(x, out=into) is into and torch.equal(into, y)  # (written where it is told)
    with pytest.raises(ValueError, match="out must be float32"):
        bound_w(x, out=torch.empty(13, n + 1))
    if fmt == gemm_int8.K4:  # the 6-bit K6 format holds Q4_K too (a fused projection of mixed K types)
        assert torch.equal(gemm_int8.BoundWeight(packed(b, gemm_int8.K6), gemm_int8.K6, n, k)(x), y)


def cpu_has(flag: str) -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and flag in line.split() for line in f)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_K, T.Q3_K, T.Q2_K, T.Q8_0, T.Q4_1, T.Q4_0, T.Q5_0],
                         ids=lambda t: t.name)
def test_amx_tiles_give_the_vnni_path_bits(qtype):
    """Rows in tiles of 16 on AMX, the rest on VNNI, in every format: every row's bits are those of
    the VNNI path alone (Q6_K's signed scales and mins, the legacy 4- and 8-bit blocks included)."""
    require_int8_kernel()
    if not cpu_has("amx_int8") or os.environ.get("PAGELLM_CPU_AMX") == "0" or \
            "-mno-amx-int8" in os.environ.get("PAGELLM_CPU_CFLAGS", ""):
        pytest.skip("no AMX int8 on this CPU (or turned off by PAGELLM_CPU_AMX=0 or PAGELLM_CPU_CFLAGS)")
    assert gemm_int8.amx(), "the CPU has AMX int8 but the int8 kernel does not use it"
    n, k = 70, 768
    fmt = int8_format([qtype])
    b = random_blocks(qtype, n, k, seed=2)
    bound_w = gemm_int8.BoundWeight(packed(b, fmt), fmt, n, k)
    # 1,024 rows in one AMX call, then two tiles of 16 and five rows left over (AMX takes 32 rows and more)
    x = torch.randn(1061, k)
    x[20] *= 1000.0
    try:
        y = bound_w(x)
        gemm_int8.amx(False)
        assert not gemm_int8.amx()
        assert torch.equal(bound_w(x), y)
        for r in (0, 20, 1030, 1060):
            assert torch.equal(bound_w(x[r:r + 1]), y[r:r + 1])
        assert torch.equal(bound_w(x[1024:]), y[1024:])
    finally:
        gemm_int8.amx(True)
    exact = x.double() @ torch.from_numpy(reference(b)).double().T
    block = 256 if fmt in (gemm_int8.K4, gemm_int8.K6) else 32
    assert bool(((y.double() - exact).abs() <= error_bound(x, reference(b), block)).all())


# Builds of the int8 kernel for the paths other CPUs take, beside this machine's own.
ISA_BUILDS = {"AVX2": (["-mno-avx512f", "-mno-avxvnni"], ("avx2", "fma")), "plain C": (["-march=x86-64"], ())}


@pytest.mark.parametrize("isa", ISA_BUILDS)
def test_every_isa_path_gives_the_same_bits(isa):
    """The kernel built for AVX2 and for plain C gives, row for row, the bits of this machine's own
    build (AVX512-VNNI and AMX here, where the CPU has them), in every format, with a bias, a partial
    panel and rows of very different magnitudes: a row's result depends on neither the batch nor
    the CPU."""
    require_int8_kernel()
    extra, needs = ISA_BUILDS[isa]
    if not all(cpu_has(f) for f in needs):
        pytest.skip(f"this CPU cannot run {isa} code")
    from pagellm import kernels

    lib = kernels.build_source(os.path.join(os.path.dirname(gemm_int8.__file__), "gemm_int8.c"),
                               gemm_int8.SIGNATURES, extra)
    assert gemm_int8.isa(lib) == isa
    n, k = 70, 512
    runs = [(random_blocks(T.Q4_1, n, k, seed=9), gemm_int8.Q4_BLOCKS),
            (random_blocks(T.Q8_0, n, k, seed=10), gemm_int8.Q8_BLOCKS),
            (random_blocks(T.Q4_K, n, k, seed=11), gemm_int8.K4), (random_blocks(T.Q6_K, n, k, seed=12), gemm_int8.K6),
            (random_blocks(T.Q5_K, n, k, seed=13), gemm_int8.K6), (random_blocks(T.Q3_K, n, k, seed=15), gemm_int8.K6)]
    weights = [(packed(b, fmt), fmt, n) for b, fmt in runs]
    weights.append((gemm_int8.pack_parts(weights[2:4] + weights[:1]), gemm_int8.PARTS, 3 * n))
    from test_group_quant import blocks_of

    for layout in ("awq-g128", "gptq-4bit-per-channel", "gptq-8bit-sym-g32"):  # AWQ / GPTQ: groups of 128, 512
        g = blocks_of(layout, 72, k)[0]  # (AWQ packs 8 outputs a word: 72, a partial panel)
        weights.append((gemm_int8.pack_blocks(*g.int8_fields(), g.kernel_format()), g.kernel_format(), 72))
    x = torch.randn(37, k)  # 37 rows: AMX tiles for K4 on this machine's build
    x[3] *= 1000.0
    x[20] *= 1e-3
    for w, fmt, rows in weights:
        bias = torch.randn(rows)
        own = gemm_int8.BoundWeight(w, fmt, rows, k, bias)
        for m in (1, 6, 37):
            y = torch.empty(m, rows)
            assert lib.gemm_packed_i8(y.data_ptr(), rows, x.data_ptr(), k, w.data_ptr(), bias.data_ptr(),
                                      m, rows, k, fmt) == 0
            assert torch.equal(y, own(x[:m])), f"{gemm_int8.format_name(fmt)}, {m} rows"
    recognised = 0  # float weights that are exact blocks (half-precision d: subnormal to large) alike
    for bits in (4, 8):
        for scale in (1e-6, 1e-4, 0.05, 30.0, 3e4):
            w = round_to_gguf_blocks(torch.randn(40, 256) * scale, bits)
            own_packed = gemm_int8.pack(w)
            out = torch.zeros(gemm_int8.packed_size(40, 256, bits), dtype=torch.uint8)
            assert lib.pack_weight_i8(out.data_ptr(), w.data_ptr(), 40, 256, bits) == (own_packed is not None)
            assert own_packed is None or torch.equal(out, own_packed[0]), f"{bits} bits, scale {scale}"
            recognised += own_packed is not None
    assert recognised >= 8


def test_formats_for_fused_parts():
    assert int8_format([T.Q4_K, T.Q4_K]) == gemm_int8.K4
    assert int8_format([T.Q5_K, T.Q6_K]) == gemm_int8.K6
    assert int8_format([T.Q4_0, T.Q4_1]) == gemm_int8.Q4_BLOCKS
    assert int8_format([T.Q5_0, T.Q8_0]) == gemm_int8.Q8_BLOCKS
    assert int8_format([T.Q4_K, T.Q4_K, T.Q6_K]) == gemm_int8.PARTS  # q, k 4-bit beside a 6-bit v
    assert int8_format([T.Q4_K, T.Q8_0]) == gemm_int8.PARTS  # legacy and K mixed
    assert int8_format([T.Q4_K, T.Q5_1]) is None  # no kernel format for one: dequantized


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_packing_a_slice_of_rows_at_a_time_gives_the_same_bytes(qtype, monkeypatch):
    require_int8_kernel()
    from pagellm.quantization import weight_formats

    parts = [random_blocks(qtype, 70, 512, seed=6), random_blocks(qtype, 50, 512, seed=7)]
    fmt = int8_format([qtype])
    whole = packed(gq.GGUFBlocks(np.concatenate([b.data for b in parts]), qtype, (120, 512)), fmt)
    monkeypatch.setattr(weight_formats, "PACK_ROWS", 32)  # slices that cut across the parts' boundary
    assert torch.equal(weight_formats._pack_blocks(parts, fmt), whole)
    with pytest.raises(ValueError, match="whole panels"):
        gemm_int8.pack_kquant(*gq.kquant_fields(random_blocks(T.Q4_K, 8, 256, seed=8)), gemm_int8.K4,
                              torch.empty(gemm_int8.packed_size(64, 256, gemm_int8.K4), dtype=torch.uint8), 16)


def test_parts_run_each_in_its_own_format():
    """A fused weight of Q4_K, Q6_K and Q8_0 runs of rows: each run's columns are bit for bit what its
    own packed weight gives, in batches that use AMX and that do not."""
    require_int8_kernel()
    k = 512
    runs = [(random_blocks(T.Q4_K, 64, k, seed=3), gemm_int8.K4), (random_blocks(T.Q6_K, 40, k, seed=4), gemm_int8.K6),
            (random_blocks(T.Q8_0, 30, k, seed=5), gemm_int8.Q8_BLOCKS)]
    alone = [gemm_int8.BoundWeight(packed(b, fmt), fmt, b.shape[0], k) for b, fmt in runs]
    fused = gemm_int8.pack_parts([(packed(b, fmt), fmt, b.shape[0]) for b, fmt in runs])
    assert [(f, n) for f, n, _ in gemm_int8.parts_of(fused)] == [(gemm_int8.K4, 64), (gemm_int8.K6, 40),
                                                                 (gemm_int8.Q8_BLOCKS, 30)]
    bias = torch.randn(134)
    bound = gemm_int8.BoundWeight(fused, gemm_int8.PARTS, 134, k, bias)
    for m in (1, 37):
        x = torch.randn(m, k)
        assert torch.equal(bound(x), torch.cat([w(x) for w in alone], dim=1) + bias)
    with pytest.raises(ValueError, match="does not fit"):
        gemm_int8.BoundWeight(fused, gemm_int8.PARTS, 133, k)


@pytest.mark.parametrize("qtype, quantize, tol", [(T.Q4_K, gq.quantize_q4_k, 0.12), (T.Q6_K, gq.quantize_q6_k, 0.03)],
                         ids=["Q4_K", "Q6_K"])
def test_k_quant_writer_round_trips_through_gguf(qtype, quantize, tol):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((40, 512)) * rng.uniform(1e-3, 1.0, (40, 1))).astype(np.float32)
    w[3] = 0.0  # an all-zero row: zero scales, no NaN
    raw = quantize(w)
    assert raw.shape == (40, 512 // 256 * gguf.GGML_QUANT_SIZES[qtype][1])
    back = gguf.dequantize(raw, qtype).reshape(w.shape)
    assert np.isfinite(back).all() and not back[3].any()
    rel = np.linalg.norm(back - w, axis=1) / np.maximum(np.linalg.norm(w, axis=1), 1e-30)
    assert rel.max() < tol, rel.max()


# ---------------------------------------------------------------- a model written as K-quants

# Q4_K_M's pattern on a tiny Llama whose rows are multiples of 256: Q4_K, with Q6_K for some
# attn_v / ffn_down and for the tied embedding; one Q8_0 and one Q5_0 from the legacy fallbacks, and
# one Q5_1 (no kernel format: dequantized).
KQ_TYPES = {"blk.0.attn_v": T.Q6_K, "blk.0.ffn_down": T.Q6_K, "blk.1.attn_v": T.Q8_0, "blk.1.ffn_down": T.Q5_0,
            "blk.1.attn_output": T.Q5_1, "token_embd": T.Q6_K}


def write_kquant_llama(path: str, bundled: str) -> None:
    """A 2-layer Llama (hidden 256, 4 heads, 2 KV heads, MLP 512) with the bundled SmolLM2's
    tokenizer and random weights, every matrix quantized as ``KQ_TYPES`` says (Q4_K otherwise)."""
    rng = np.random.default_rng(0)

    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if len(shape) == 1:  # norms
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (rng.standard_normal(shape) * (0.25 if name == "token_embd" else 0.08)).astype(np.float32)
    shape = DecoderShape(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, context=2048, rope_theta=10000.0)
    counts = write_decoder_gguf(path, shape, tensor, lambda name: KQ_TYPES.get(name, T.Q4_K), bundled)
    assert counts == {"Q6_K": 3, "Q8_0": 1, "Q5_0": 1, "Q5_1": 1, "Q4_K": 9, "F32": 5}, counts


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory, smollm2_path):
    path = str(tmp_path_factory.mktemp("kquant") / "tiny-llama-Q4_K_M.gguf")
    write_kquant_llama(path, smollm2_path)
    return path


PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,", "Once upon a time, in a small village"]


def test_kquant_gguf_in_float32_equals_hf_gguf_loader(kquant_gguf):
    from test_hf_parity import assert_equal_but_float32_ties, engine_greedy, hf_greedy

    directory, name = os.path.split(kquant_gguf)
    tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    prompts = [tok.encode(p) for p in PROMPTS]
    ref = hf_greedy(hf, prompts)
    got, _ = engine_greedy(kquant_gguf, prompts, dtype="float32")
    assert_equal_but_float32_ties(hf, prompts, got, ref)


def test_kquant_gguf_runs_its_blocks_on_the_int8_kernel(kquant_gguf, caplog):
    """quantization="gguf" (dtype auto alike): every matrix the kernel takes is packed from the file's blocks (no float
    weight is written for it), the numerics line names each type, and greedy tokens stay
    logprob-close to float32 (each side's token in the other's top 5)."""
    require_int8_kernel()
    from test_numerics import MAX_GAP, assert_near_ties, engine_greedy_top

    from pagellm import LLM

    with caplog.at_level("INFO", logger="pagellm.worker.model_loader"):
        LLM(model=kquant_gguf, kv_cache_memory="32MiB")  # dtype auto: the same, unasked
        auto = [r.getMessage() for r in caplog.records if r.getMessage().startswith("numerics: ")]
        caplog.clear()
        llm = LLM(model=kquant_gguf, quantization="gguf", kv_cache_memory="32MiB")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("numerics: quantized"))
    assert auto[0] == line, auto
    assert "dtype auto on a quantized checkpoint: every projection is stored blocks" in auto[1], auto
    for part in ("Q4_K x9: int8 GEMMs (K4 super-blocks)", "Q6_K x2: int8 GEMMs (K6", "Q8_0 x1: int8 GEMMs (8-bit",
                 "Q6_K (tied LM head) x1: int8 GEMMs (K6", "Q5_0 x1: int8 GEMMs (8-bit", "Q5_1 x1: dequantized"):
        assert part in line, line
    model = llm.llm_engine.executor.worker.model
    from pagellm.layers.linear import Linear
    from pagellm.quantization.weight_formats import Int8Packed

    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    int8 = {n: m.weight_format for n, m in linears.items() if isinstance(m.weight_format, Int8Packed)}
    formats = {n: f.fmt for n, f in int8.items()}
    parts = {n: [(k, rows) for k, rows, _ in gemm_int8.parts_of(f.packed)]
             for n, f in int8.items() if f.fmt == gemm_int8.PARTS}
    # q and k (256 + 128 rows) in Q4_K's own format beside a Q6_K, then a Q8_0, v
    assert parts == {"model.layers.0.self_attn.qkv_proj": [(gemm_int8.K4, 384), (gemm_int8.K6, 128)],
                     "model.layers.1.self_attn.qkv_proj": [(gemm_int8.K4, 384), (gemm_int8.Q8_BLOCKS, 128)]}
    assert formats["model.layers.0.mlp.gate_up_proj"] == gemm_int8.K4
    assert formats["model.layers.1.mlp.down_proj"] == gemm_int8.Q8_BLOCKS  # Q5_0
    assert model.tied_head.weight_format.fmt == gemm_int8.K6  # the Q6_K embedding's blocks
    assert "model.layers.1.self_attn.o_proj" not in formats  # Q5_1: dequantized
    assert all(m.weight.is_meta for n, m in linears.items() if n in formats)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    got, _ = engine_greedy_top(kquant_gguf, prompts, 16, quantization="gguf")
    ref, _ = engine_greedy_top(kquant_gguf, prompts, 16, dtype="float32")
    # (Random weights give flat distributions, so greedy paths part at small gaps; a broken kernel
    # gives tokens outside float32's top 5, or divergences at wide gaps.)
    assert_near_ties(got, ref, MAX_GAP["int8"])


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0])
def test_embedding_rows_are_gguf_dequantizer_rows_few_or_many(qtype):
    """``gather_rows`` (an embedding kept as blocks): a decode step's few ids (read from their fields
    directly) and a prefill's many (deduplicated, through ``gguf``) give ``gguf.dequantize``'s rows bit
    for bit, with a row order (llama's q/k permutation style) and without."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((300, 128)) * 0.05).astype(np.float32)
    data = gguf.quantize(w, qtype)
    ref = gguf.dequantize(data, qtype).reshape(300, 128)
    order = rng.permutation(300)
    for blocks, rows in ((gq.GGUFBlocks(data, qtype, (300, 128)), ref),
                         (gq.GGUFBlocks(data, qtype, (300, 128), order), ref[order])):
        for ids in (torch.tensor([7]), torch.tensor([[3, 3], [299, 0]]), torch.randint(0, 300, (gq.FEW_ROWS + 1,))):
            got = blocks.gather_rows(ids)
            assert got.dtype == torch.float32 and got.shape == (*ids.shape, 128)
            assert torch.equal(got, torch.from_numpy(rows[ids.numpy()])), (qtype, ids.shape)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1])
def test_embedding_rows_of_a_mapped_file_are_read_without_mapping_a_page(qtype, tmp_path):
    """A GGUF file's embedding (blocks in a ``np.memmap`` of the file, as ``gguf``'s reader maps it):
    the rows looked up are ``gguf.dequantize``'s, read from the file (``mapped_files.read_memmap_rows``),
    and none of the mapping's pages becomes resident (through the mapping, 256 rows spread over the
    file would be at least 1 MiB; 2 MiB each where the kernel maps large folios whole)."""
    from conftest import mapped_kib

    rng = np.random.default_rng(6)
    w = (rng.standard_normal((8192, 256)) * 0.05).astype(np.float32)
    data = gguf.quantize(w, qtype)
    ref = gguf.dequantize(data, qtype).reshape(8192, 256)
    path = tmp_path / "blocks.bin"
    path.write_bytes(b"\0" * 100 + data.tobytes())  # (at an offset, as a GGUF file's tensor data is)
    mapped = np.memmap(path, mode="r")[100:].reshape(data.shape)
    order = rng.permutation(8192)
    ids = torch.from_numpy(rng.permutation(8192)[:256])

    for blocks, rows in ((gq.GGUFBlocks(mapped, qtype, (8192, 256)), ref),
                         (gq.GGUFBlocks(mapped, qtype, (8192, 256), order), ref[order])):
        for got_ids in (ids, ids[:3]):
            assert torch.equal(blocks.gather_rows(got_ids), torch.from_numpy(rows[got_ids.numpy()]))
    assert mapped_kib(str(path)) == 0
    assert np.array_equal(mapped[ids.numpy()], data[ids.numpy()]) and mapped_kib(str(path)) >= 1024  # (it can fail)


def test_q8_0_on_packing_quantizes_each_slice_as_the_whole(monkeypatch):
    """A float weight quantized to Q8_0 a slice of rows at a time as it is packed (an AWQ checkpoint's
    LM head): every slice's values are ``gguf``'s quantizer's for those rows, and the packed weight
    is the one packed from the whole weight's blocks (Q8_0 is per block of 32 along a row)."""
    require_int8_kernel()
    from pagellm.quantization import weight_formats

    w = torch.randn(300, 96) * torch.logspace(-3, 2, 300)[:, None]
    lazy = gq.Q8_0OnPacking(lambda lo, hi: w[lo:hi], tuple(w.shape))
    whole = gguf.dequantize(gguf.quantize(w.numpy(), T.Q8_0), T.Q8_0)
    assert lazy.type_name == "Q8_0" and lazy.kernel_format() == gemm_int8.Q8_BLOCKS
    assert np.array_equal(lazy.take(37, 211).dequantize().numpy(), whole[37:211])
    blocks = gq.GGUFBlocks(gguf.quantize(w.numpy(), T.Q8_0), T.Q8_0, tuple(w.shape))
    whole_packed = weight_formats._pack_blocks([blocks], gemm_int8.Q8_BLOCKS)
    monkeypatch.setattr(weight_formats, "PACK_ROWS", 64)  # 5 slices, each quantized on its own
    assert torch.equal(weight_formats._pack_blocks([lazy], gemm_int8.Q8_BLOCKS), whole_packed)
