"""The fused CPU ops (``pagellm/kernels/cpu_ops.c``) against the PyTorch code they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagellm.attention.kv_quant import cache_head_dim, to_cache
from pagellm.kernels import cpu_ops
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import ApplyRotary, RotaryEmbedding, apply_rotary

from conftest import require_cpu_kernel


@pytest.fixture(autouse=True, scope="module")
def _built():
    require_cpu_kernel(cpu_ops.available)


@pytest.mark.parametrize("t", [1, 5, 300])
def test_rms_norm_matches_hf_arithmetic(t):
    torch.manual_seed(t)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x, res = torch.randn(t, 576) * 3, torch.randn(t, 576)
    with torch.inference_mode():
        ref = norm._norm(x)  # the pure PyTorch (HF) arithmetic
        ref_sum = x + res
        ref_res = norm._norm(ref_sum)
        assert torch.allclose(cpu_ops.rms_norm(x, norm.weight, 1e-5), ref, rtol=1e-6, atol=1e-6)
        got_res = res.clone()
        out = cpu_ops.rms_norm(x, norm.weight, 1e-5, got_res)
    assert torch.equal(got_res, ref_sum)  # residual updated in place, same float sum
    assert torch.allclose(out, ref_res, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t", [1, 50])
def test_fused_add_norm_writes_its_result_over_the_sublayer_output(t):
    """With a residual, RMSNorm's CPU path writes ``norm(x + residual)`` over ``x`` (vLLM's fused
    add-norm: the decoder's step holds one hidden-sized tensor fewer); the same bits as a new output,
    within float32 rounding of a float64 formula. Without a residual, ``x`` cannot be its output."""
    torch.manual_seed(t)
    norm = RMSNorm(576, 1e-5)
    norm.use_kernel = True
    with torch.no_grad():
        norm.weight.normal_()
    x, res = torch.randn(t, 576) * 3, torch.randn(t, 576)
    s = x.double() + res.double()
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    with torch.inference_mode():
        fresh = cpu_ops.rms_norm(x, norm.weight, 1e-5, res.clone())
        got_x, got_res = x.clone(), res.clone()
        out, out_res = norm(got_x, got_res)
    assert out.data_ptr() == got_x.data_ptr() and out_res.data_ptr() == got_res.data_ptr()
    assert torch.equal(out, fresh)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="x itself only with a residual"):
        cpu_ops.rms_norm(x, norm.weight, 1e-5, out=x)
    strided = torch.randn(t, 700)[:, :576]
    with torch.inference_mode():  # (a row-strided x: a new output, x untouched)
        kept = strided.clone()
        out, _ = norm(strided, res.clone())
    assert out.data_ptr() != strided.data_ptr() and torch.equal(strided, kept)


def test_rms_norm_reads_row_strided_input():
    x = torch.randn(7, 1000)[:, 100:676]
    w = torch.randn(576)
    ref = RMSNorm(576, 1e-6)
    with torch.no_grad():
        ref.weight.copy_(w)
    with torch.inference_mode():
        assert torch.allclose(cpu_ops.rms_norm(x, w, 1e-6), ref._norm(x.contiguous()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t", [1, 3, 50])
def test_per_head_rms_norm_reads_the_qkv_output_in_place(t, monkeypatch):
    """Qwen3's q/k norm: every head row of a strided [T, H, D] view of the qkv output, against a
    float64 formula; RMSNorm's kernel path takes it (3-D input, heads contiguous)."""
    torch.manual_seed(t)
    hq, hkv, d = 4, 2, 128
    qkv = torch.randn(t, (hq + 2 * hkv) * d) * 3
    q = qkv[:, :hq * d].view(t, hq, d)
    w = torch.randn(d)
    x = q.double()
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    got = cpu_ops.rms_norm_heads(q, w, 1e-6)
    assert got.shape == (t, hq, d) and got.is_contiguous()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    norm = RMSNorm(d, 1e-6)
    norm.use_kernel = True
    with torch.no_grad():
        norm.weight.copy_(w)
    calls = []
    monkeypatch.setattr(cpu_ops, "rms_norm_heads", lambda *a: calls.append(1) or got)
    with torch.inference_mode():
        norm(q)
    assert calls == [1]


@pytest.mark.parametrize("t", [1, 40])
def test_rotary_in_place_equals_apply_rotary_exactly(t):
    rope = RotaryEmbedding(64, 4096, 100000.0)
    pos = torch.randint(0, 4096, (t,))
    cos, sin = rope.cos_sin(pos, torch.float32)
    qkv = torch.randn(t, (9 + 2 * 3) * 64)
    q = qkv[:, :576].view(t, 9, 64)
    k = qkv[:, 576:768].view(t, 3, 64)
    v_before = qkv[:, 768:].clone()
    ref_q, ref_k = apply_rotary(q.clone(), k.clone(), cos, sin)
    cpu_ops.rotary_(qkv[:, :768].view(t, 12, 64), cos, sin)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)  # same products and sums, no FMA
    assert torch.equal(qkv[:, 768:], v_before)  # v untouched


def test_rotary_table_grows_with_the_positions_and_keeps_its_bits():
    """A CPU table covers the positions seen (4,096 rows, doubled as needed), so a 32k-position
    model does not build 32k rows for short requests; entries are the same bits whatever the
    table's length, and equal a float64 formula."""
    rope = RotaryEmbedding(256, 32768, 10000.0)
    early = rope.cos_sin(torch.tensor([0, 7, 4095]), torch.float32)
    assert rope._cos.shape[0] == 4096
    late = rope.cos_sin(torch.tensor([0, 7, 4095, 9000]), torch.float32)
    assert rope._cos.shape[0] == 16384
    assert all(torch.equal(a, b[:3]) for a, b in zip(early, late, strict=True))
    whole = rope.cos_sin(torch.tensor([0, 7, 4095, 9000, 32767]), torch.float32)
    assert rope._cos.shape[0] == 32768 and all(torch.equal(a, b[:4]) for a, b in zip(late, whole, strict=True))
    inv = 1.0 / 10000.0 ** (torch.arange(0, 256, 2, dtype=torch.float64) / 256)
    angle = torch.tensor([0, 7, 4095, 9000, 32767], dtype=torch.float64)[:, None] * inv
    # (the float32 angle t * inv_freq is off by up to half an ulp of 32767 rad: ~2e-3 there)
    torch.testing.assert_close(whole[0][:, 0, :128].double(), angle.cos(), atol=4e-3, rtol=0)
    torch.testing.assert_close(whole[1][:, 0, 128:].double(), angle.sin(), atol=4e-3, rtol=0)
    with pytest.raises(IndexError):
        rope.cos_sin(torch.tensor([32768]), torch.float32)


@pytest.mark.parametrize("adjacent", [True, False])
def test_the_rotary_op_rotates_q_and_k_whether_or_not_they_share_rows(adjacent):
    """``ApplyRotary.forward_cpu`` rotates q and k in one pass when k's heads follow q's in each row
    (the fused qkv output), in two otherwise (Qwen3's q/k norms make new tensors); v untouched."""
    op = ApplyRotary()
    op.use_kernel = True
    t = 7
    cos, sin = RotaryEmbedding(64, 4096, 100000.0).cos_sin(torch.randint(0, 4096, (t,)), torch.float32)
    qkv = torch.randn(t, 15 * 64)
    v_before = qkv[:, 768:].clone()
    q, k = qkv[:, :576].view(t, 9, 64), qkv[:, 576:768].view(t, 3, 64)
    if not adjacent:
        q, k = q.clone(), k.clone()
    ref_q, ref_k = apply_rotary(q.clone(), k.clone(), cos, sin)
    got_q, got_k = op(q, k, (cos, sin))
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    assert torch.equal(qkv[:, 768:], v_before)


def test_silu_and_mul():
    gu = torch.randn(33, 2 * 1536) * 4
    ref = F.silu(gu[:, :1536]) * gu[:, 1536:]
    assert torch.allclose(cpu_ops.silu_and_mul(gu), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("i", [1536, 2048 + 7])
def test_gelu_tanh_and_mul_equals_a_float64_formula(i):
    """Gemma's GeGLU (vector lanes and the scalar tail) against gelu_pytorch_tanh in float64, and
    batch-invariant: a row's result does not depend on the rows beside it."""
    gu = torch.randn(33, 2 * i) * 4
    g, u = gu[:, :i].double(), gu[:, i:].double()
    ref = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3))) * u
    got = cpu_ops.gelu_tanh_and_mul(gu)
    # (near g = -4 and below, 1 + tanh cancels in float32, as it does in torch's own gelu: absolute error)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_ops.gelu_tanh_and_mul(gu[5:6]), got[5:6])


@pytest.mark.parametrize("t,k", [(1, 1), (3, 2), (40, 4)])
def test_moe_combine_equals_pytorchs_products_and_adds(t, k):
    """Each token's weighted expert rows added in slot order: the reference op's bits (a mul, then
    one add per slot), and a float64 formula's value."""
    from pagellm.layers.moe import CombineExperts

    torch.manual_seed(t)
    y = torch.randn(t * k + 5, 96)
    pos = torch.randperm(t * k + 5)[:t * k].view(t, k)
    w = torch.rand(t, k)
    got = cpu_ops.moe_combine(y, pos, w)
    assert torch.equal(got, CombineExperts().forward_native(y, pos, w))
    ref = (y.double()[pos] * w.double()[..., None]).sum(1)
    assert torch.allclose(got.double(), ref, atol=1e-6)
    with pytest.raises(ValueError, match="pos must index"):
        cpu_ops.moe_combine(y, pos + 100, w)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
def test_write_kv_from_strided_views(cache_dtype):
    t, hkv, d = 20, 3, 64
    qkv = torch.randn(t, (9 + 2 * hkv) * d)
    qkv[3, 576:640] = 0  # an all-zero head row: scale 0, no division by it
    qkv[4, 576] = 1e-30  # a tiny one
    k = qkv[:, 576:768].view(t, hkv, d)
    v = qkv[:, 768:].view(t, hkv, d)
    dc = cache_head_dim(d, cache_dtype)
    kc, vc = torch.zeros(64, hkv, dc, dtype=cache_dtype), torch.zeros(64, hkv, dc, dtype=cache_dtype)
    ref_k, ref_v = kc.clone(), vc.clone()
    slots = torch.randperm(64)[:t]
    # torch's rounding (nearest even; for int8, kv_quant's scale and rounding) is the reference
    ref_k.index_copy_(0, slots, to_cache(k, cache_dtype))
    ref_v.index_copy_(0, slots, to_cache(v, cache_dtype))
    cpu_ops.write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_argmax_logsumexp_matches_torch() -> None:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(7, 1100, generator=g) * 5
    x = wide[:, :1037]  # row stride 1100, a length that is no multiple of the vector width
    x[1, 40] = x[1, 900] = x[1].max() + 1  # a tie: the first index wins, as in torch
    x[2, :500] = float("-inf")  # banned tokens (min_tokens, penalties)
    x[3, 12] = float("nan")  # torch's answer for a NaN row
    x[4] = float("-inf")
    idx, lse = cpu_ops.argmax_logsumexp(x)
    assert torch.equal(idx, x.argmax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), rtol=1e-6, atol=1e-6, equal_nan=True)
    assert idx[1] == 40
    assert torch.equal(cpu_ops.argmax(x), idx)
    empty_idx, empty_lse = cpu_ops.argmax_logsumexp(torch.empty(0, 5))
    assert empty_idx.shape == empty_lse.shape == (0,)


@pytest.mark.parametrize("vocab", [37, 1000, 49152])
def test_apply_token_bitmask_kernel_equals_unpacked_bits(vocab, monkeypatch):
    """The kernel, the torch fallback (a GPU's path) and a per-token loop agree: a bit set keeps the logit, a bit
    clear makes it -inf; rows and mask rows map in any order; padding bits past the vocabulary and
    rows not listed are left alone."""
    import numpy as np

    from pagellm.sampling import sampler

    rng = np.random.default_rng(vocab)
    rows_n = 5
    bitmask = rng.integers(-2**31, 2**31 - 1, size=(rows_n, (vocab + 31) // 32 + 1), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1  # everything allowed
    bitmask[1, ::2] = 0  # whole words banned
    logits = torch.randn(rows_n + 2, vocab)
    rows, mask_rows = [1, 2, 3, 4, 6], [4, 3, 2, 1, 0]
    kernel = logits.clone()
    sampler.apply_token_bitmask(kernel, bitmask, rows, mask_rows)
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    fallback = logits.clone()
    sampler.apply_token_bitmask(fallback, bitmask, rows, mask_rows)
    ref = logits.clone()
    for r, m in zip(rows, mask_rows, strict=True):
        allowed = [(int(bitmask[m, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        ref[r, torch.tensor(allowed) == 0] = float("-inf")
    assert torch.equal(kernel, ref) and torch.equal(fallback, ref)
    assert torch.equal(kernel[[0, 5]], logits[[0, 5]])
