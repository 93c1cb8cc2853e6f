"""The packed-weight GEMM kernel (``kernels/gemm.c``) against ``F.linear``, and ``layers.Linear`` on it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagellm.distributed import TensorParallelGroup
from pagellm.kernels import gemm
from pagellm.layers.linear import Linear
from pagellm.layers.parallel import RowParallelLinear
from pagellm.quantization.weight_formats import QUANTIZED_MAX_ROWS, Float32Packed

from conftest import require_f32_gemm_kernel


@pytest.fixture(autouse=True)
def _built(request: pytest.FixtureRequest) -> None:
    if request.node.name.startswith("test_disabled"):
        return
    require_f32_gemm_kernel()


def _close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    # Summation order differs from MKL's: allow a few ulps of the largest partial sums.
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * k)


# N not a multiple of 32 (masked last panel), K of 1, odd and model-sized; M across tile sizes
# (14 rows) and, for K = 1536, across row blocks (168 rows each).
@pytest.mark.parametrize("n", [1, 17, 32, 33, 99, 960])
@pytest.mark.parametrize("k", [1, 7, 576, 1536])
@pytest.mark.parametrize("m", [1, 5, 14, 15, 64, 300])
def test_matches_f_linear(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    p = gemm.pack(w)
    _close(gemm.linear(x, p, n), F.linear(x, w), k)
    _close(gemm.linear(x, p, n, b), F.linear(x, w, b), k)


def test_strided_and_batched_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g)
    p = gemm.pack(w)
    wide = torch.randn(9, 50, generator=g)
    x = wide[:, 10:34]  # row stride 50: read in place
    _close(gemm.linear(x, p, 40), F.linear(x, w), 24)
    x3 = torch.randn(2, 3, 24, generator=g)
    _close(gemm.linear(x3, p, 40), F.linear(x3, w), 24)
    assert gemm.linear(torch.empty(0, 24), p, 40).shape == (0, 40)


def test_rows_do_not_depend_on_the_batch() -> None:
    """Each output is one in-order sum over k, whatever the tile or row block a row lands in:
    a sequence's logits are bit-identical whether it decodes alone or in a batch of 400."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(70, 1536, generator=g), torch.randn(400, 1536, generator=g)
    p = gemm.pack(w)
    full = gemm.linear(x, p, 70)
    for i in (0, 13, 14, 167, 168, 399):
        assert torch.equal(full[i], gemm.linear(x[i:i + 1], p, 70)[0])
    assert torch.equal(full[20:277], gemm.linear(x[20:277], p, 70))


def test_avx2_build_gives_this_machines_bits() -> None:
    """The kernel built for AVX2 (``-mno-avx512f``: 3-row tiles of four 8-lane vectors) gives, row for
    row, the bits of this machine's own build (14-row AVX-512 tiles where the CPU has them), float32
    and 4/8-bit copies, with a bias and a partial panel: a row's result depends on neither the batch
    nor the CPU, and float32 stays batch-invariant where MKL would take over without the kernel."""
    import os

    from pagellm import kernels

    from conftest import _cpu_flags

    if not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU cannot run AVX2 code")
    lib = kernels.build_source(os.path.join(os.path.dirname(gemm.__file__), "gemm.c"), gemm.SIGNATURES,
                               ["-mno-avx512f", "-mno-avxvnni"])
    assert lib.gemm_f32_supported() == 1 and lib.gemm_bf16_supported() == 0
    n, k = 70, 576
    g = torch.Generator().manual_seed(5)
    x, bias = torch.randn(40, k, generator=g), torch.randn(n, generator=g)
    x[3] *= 1000.0
    for bits in (32, 4, 8):
        w = torch.randn(n, k, generator=g) if bits == 32 else _gguf_weight(n, k, bits, bits)
        own = gemm.pack(w) if bits == 32 else gemm.pack_quantized(w, bits)
        assert own is not None
        if bits == 32:
            packed = torch.empty(lib.packed_size_f32(n, k), dtype=torch.float32)
            lib.pack_weight_f32(packed.data_ptr(), w.data_ptr(), n, k)
        else:
            packed = torch.empty(lib.packed_size_q(n, k, bits), dtype=torch.float32)
            assert lib.pack_weight_q(packed.data_ptr(), w.data_ptr(), n, k, bits) == 1
        assert torch.equal(packed.view(torch.int32), own.view(torch.int32)), bits  # (q bytes: NaN as floats)
        for m in (1, 2, 3, 4, 17, 40):
            y = torch.empty(m, n)
            if bits == 32:
                lib.gemm_packed_f32(y.data_ptr(), n, x.data_ptr(), k, packed.data_ptr(), bias.data_ptr(), m, n, k)
            else:
                lib.gemm_packed_q(y.data_ptr(), n, x.data_ptr(), k, packed.data_ptr(), bias.data_ptr(), m, n, k, bits)
            assert torch.equal(y, gemm.linear(x[:m], own, n, bias, bits=bits)), (bits, m)
        _close(y[4:], F.linear(x[4:], w, bias), k)  # (row 3's magnitude is beyond _close's bound)


def test_bad_arguments_raise() -> None:
    w = torch.randn(8, 4)
    p = gemm.pack(w)
    with pytest.raises(ValueError, match="does not fit"):
        gemm.linear(torch.randn(2, 5), p, 8)
    with pytest.raises(ValueError, match="bias"):
        gemm.linear(torch.randn(2, 4), p, 8, torch.randn(7))
    with pytest.raises(ValueError, match="float32"):
        gemm.linear(torch.randn(2, 4, dtype=torch.float64), p, 8)
    with pytest.raises(ValueError, match="cannot pack"):
        gemm.pack(w.to(torch.bfloat16))


def test_linear_layer_takes_the_kernel_for_every_batch_and_a_row_is_its_own() -> None:
    """Small and prefill-sized batches all go through the packed kernel, so a row's output is the
    same bits alone, in a 200-row batch or at another offset (MKL's is not: its blocking changes
    with the batch size, and under a 16-bit or int8 K/V cache that flipped greedy tokens)."""
    torch.manual_seed(0)
    layer = Linear(576, 40, bias=True).eval()  # K long enough for MKL's blocking to show
    x = torch.randn(200, 576)
    with torch.no_grad():
        want = layer(x)
        assert layer.pack_for_cpu() and isinstance(fmt := layer.weight_format, Float32Packed)
        assert layer.pack_for_cpu()  # idempotent
        got = layer(x)
        _close(got, want, 576)
        assert torch.equal(got, gemm.linear(x, fmt.packed, 40, layer.bias))
        for rows in (slice(0, 1), slice(7, 8), slice(0, 129), slice(150, 200)):
            assert torch.equal(layer(x[rows]), got[rows]), rows


_GGUF_TYPES = {4: gguf.GGMLQuantizationType.Q4_1, 8: gguf.GGMLQuantizationType.Q8_0}


def _gguf_weight(n: int, k: int, seed: int, bits: int) -> torch.Tensor:
    """A [n, k] weight as a GGUF Q4_1 (``bits`` 4) or Q8_0 (8) model holds it: quantized and
    dequantized by the gguf package."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    t = _GGUF_TYPES[bits]
    return torch.from_numpy(gguf.dequantize(gguf.quantize(w, t), t).reshape(n, k).astype(np.float32))


# N past one panel and not a multiple of 32; K of one block and model-sized; M across tile sizes.
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("n", "k"), [(33, 32), (960, 576), (70, 1536)])
def test_quantized_copy_gives_the_float32_kernels_results_bit_for_bit(n: int, k: int, bits: int) -> None:
    w = _gguf_weight(n, k, n + k, bits)
    p32, pq = gemm.pack(w), gemm.pack_quantized(w, bits)
    assert pq is not None, f"a dequantized {_GGUF_TYPES[bits].name} weight must pack in {bits} bits"
    assert pq.numel() * 3 < p32.numel()  # 0.75 or 1.125 bytes per weight against 4
    g = torch.Generator().manual_seed(n * k)
    b = torch.randn(n, generator=g)
    for m in (1, 2, 7, 14, 15, 16, 29):
        x = torch.randn(m, k, generator=g)
        assert torch.equal(gemm.linear(x, pq, n, bits=bits), gemm.linear(x, p32, n))
        assert torch.equal(gemm.linear(x, pq, n, b, bits=bits), gemm.linear(x, p32, n, b))
    xs = torch.randn(5, 2 * k, generator=g)[:, :k]  # strided rows
    assert torch.equal(gemm.linear(xs, pq, n, bits=bits), gemm.linear(xs, p32, n))
    _close(gemm.linear(xs, pq, n, bits=bits), F.linear(xs, w), k)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_copy_refused_unless_every_value_is_exact(bits: int) -> None:
    w = _gguf_weight(40, 64, 1, bits)
    assert gemm.pack_quantized(w, bits) is not None
    nudged = w.clone()
    nudged[37, 50] = torch.nextafter(nudged[37, 50], torch.tensor(1.0))  # one value one ulp off
    assert gemm.pack_quantized(nudged, bits) is None
    assert gemm.pack_quantized(torch.randn(40, 64), bits) is None  # a float32 model
    assert gemm.pack_quantized(w[:, :48].contiguous(), bits) is None  # K not a multiple of 32
    assert gemm.pack_quantized(_gguf_weight(40, 64, 1, 12 - bits), bits) is None  # the other format
    with pytest.raises(ValueError, match="does not fit"):
        gemm.linear(torch.randn(2, 64), gemm.pack(w), 40, bits=bits)  # a float32 copy is not a quantized one
    with pytest.raises(ValueError, match="bits"):
        gemm.linear(torch.randn(2, 64), gemm.pack(w), 40, bits=12)
    with pytest.raises(ValueError, match="bits"):
        gemm.pack_quantized(w, 2)


@pytest.mark.parametrize("bits", [4, 8])
def test_linear_layer_takes_the_quantized_copy_for_the_smallest_batches(bits: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    layer = Linear(64, 40, bias=True).eval()
    rows = QUANTIZED_MAX_ROWS[bits]
    taken: list[int] = []  # both copies give the same results, so record which one each call read
    real = gemm.linear
    monkeypatch.setattr(gemm, "linear", lambda *a, bits=32: taken.append(bits) or real(*a, bits=bits))
    with torch.no_grad():
        w = _gguf_weight(40, 64, 2, bits)
        layer.weight.copy_(w)
        assert layer.pack_for_cpu() and isinstance(fmt := layer.weight_format, Float32Packed)
        assert fmt.quantized is not None and fmt.q_bits == bits
        assert layer.weight.is_meta  # every batch reads a packed copy: the float weight is dropped
        small, mid = torch.randn(rows, 64), torch.randn(rows + 1, 64)
        _close(layer(small), F.linear(small, w, layer.bias), 64)
        _close(layer(mid), F.linear(mid, w, layer.bias), 64)
        assert taken == [bits, 32]
        plain = Linear(64, 40, bias=False)
        assert plain.pack_for_cpu() and isinstance(fmt := plain.weight_format, Float32Packed)
        assert fmt.quantized is None  # random float32: no quantized copy


def test_row_parallel_adds_the_bias_once() -> None:
    torch.manual_seed(0)
    layer = RowParallelLinear((0, 32), 16, bias=True, tp=TensorParallelGroup()).eval()
    x = torch.randn(3, 32)
    with torch.no_grad():
        want = F.linear(x, layer.weight, layer.bias)
        layer.pack_for_cpu()
        _close(layer(x), want, 32)


def test_disabled_keeps_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGELLM_CPU_GEMM", "0")
    layer = Linear(8, 4, bias=False)
    assert not layer.pack_for_cpu()
    assert layer.weight is not None and layer.weight_format is None


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "bfloat16_amx"])
def test_grouped_weights_give_each_row_its_own_weights_bits(kind: str) -> None:
    """``linear_grouped`` (a mixture of experts' projections in one call) against each group's own
    ``linear`` call: the same bits for every row (empty groups, a partial last panel, a group longer
    than a row block), and close to ``F.linear`` over the weights as packed (bfloat16-rounded)."""
    from conftest import require_amx_kernel, require_bf16_kernel

    bits, amx = (32, False) if kind == "float32" else (16, kind.endswith("amx"))
    if bits == 16:
        (require_amx_kernel if amx else require_bf16_kernel)()
    torch.manual_seed(0)
    n, k, counts = 100, 1536, [0, 1, 5, 0, 40, 200, 13]
    weights = [torch.randn(n, k) * 0.05 for _ in counts]
    packed = [gemm.pack(w) if bits == 32 else gemm.pack_bf16(w) for w in weights]
    x = torch.randn(sum(counts), k)
    offsets = torch.tensor([0, *np.cumsum(counts)], dtype=torch.int64)
    got = gemm.linear_grouped(x, torch.tensor([p.data_ptr() for p in packed]), offsets, n, bits, amx)
    for g, (w, p) in enumerate(zip(weights, packed, strict=True)):
        rows = x[offsets[g]:offsets[g + 1]]
        own = gemm.linear(rows, p, n, bits=bits, amx=amx)
        assert torch.equal(got[offsets[g]:offsets[g + 1]], own), g
        if bits == 16:  # the kernel's inputs, rounded as it rounds them; float32 sums in another order
            torch.testing.assert_close(own, F.linear(rows.bfloat16().float(), w.bfloat16().float()),
                                       rtol=1e-4, atol=1e-4)
        else:
            _close(own, F.linear(rows, w), k)
    with pytest.raises(ValueError, match="offsets must rise"):
        gemm.linear_grouped(x, torch.tensor([p.data_ptr() for p in packed]), offsets - 1, n, bits, amx)


@pytest.mark.parametrize("hidden,inter", [(80, 64), (576, 1536), (1024, 160)])
def test_fused_mlp_on_amx_gives_the_unfused_bits(hidden: int, inter: int) -> None:
    """``mlp_silu_amx`` (gate/up, SiLU * up and down in one call, the activations kept bfloat16) against
    the three calls it replaces: the same bits for every row count (padding rows, several row blocks,
    a partial panel of K at hidden 80); and close to the float64 formula over the rounded inputs."""
    from pagellm.kernels import cpu_ops

    from conftest import require_amx_kernel

    require_amx_kernel()
    torch.manual_seed(0)
    wgu, wd = torch.randn(2 * inter, hidden) * 0.1, torch.randn(hidden, inter) * 0.1
    pgu, pd = gemm.pack_bf16(wgu), gemm.pack_bf16(wd)
    x = torch.randn(700, hidden)
    for m in (1, 15, 16, 17, 33, 150, 700):
        got = gemm.mlp_silu_amx(x[:m], pgu, pd, hidden, inter)
        act = cpu_ops.silu_and_mul(gemm.linear(x[:m], pgu, 2 * inter, bits=16, amx=True))
        want = gemm.linear(act, pd, hidden, bits=16, amx=True)
        assert torch.equal(got, want), m
    gu = x.bfloat16().double() @ wgu.bfloat16().double().T
    act64 = F.silu(gu[:, :inter]) * gu[:, inter:]
    ref = act64.float().bfloat16().double() @ wd.bfloat16().double().T
    # (act rounded to bfloat16 on both sides; a float32 sum's last bit can move that rounding)
    torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().mean()))
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm.mlp_silu_amx(x, pgu, pd, hidden, inter - 16)
