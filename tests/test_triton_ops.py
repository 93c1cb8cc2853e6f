"""The Triton ops (``kernels/triton_ops.py``) under Triton's interpreter against their layers'
``forward_native`` (the torch reference): RMSNorm with and without the residual add, over rows and
over heads split from a fused qkv output; SiLU and GeLU(tanh) times up; rotary, whole and partial,
in place and with the K/V cache write. Float32 within rounding, float16 within its own. On a GPU
they run compiled in the engine (tests/gpu)."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter's tests (a GPU runs tests/gpu, compiled)", allow_module_level=True)

from pagellm.kernels import triton_ops  # noqa: E402
from pagellm.layers.activation import GeluTanhAndMul, SiluAndMul  # noqa: E402
from pagellm.layers.norm import RMSNorm  # noqa: E402
from pagellm.layers.rotary import ApplyRotary, RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.float16]


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)


def _on_triton(op):
    op.use_kernel, op.use_triton = False, True
    return op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 80])
def test_rms_norm_with_and_without_the_residual_add_equals_the_reference(dtype, n):
    g = torch.Generator().manual_seed(n)
    norm = RMSNorm(n, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(n, generator=g).to(dtype)
    x, residual = (torch.randn(5, n, generator=g).to(dtype) for _ in range(2))
    ref, ref_res = norm.forward_native(x, residual)
    op = _on_triton(norm)
    torch.testing.assert_close(op(x), norm.forward_native(x), **_tol(dtype))
    res = residual.clone()
    got, got_res = op(x, res)
    assert got_res is res  # (updated in place: the decoder owns the residual stream)
    torch.testing.assert_close(got_res, ref_res, rtol=0, atol=0)  # (one add in the input's dtype)
    torch.testing.assert_close(got, ref, **_tol(dtype))


def test_rms_norm_over_heads_reads_them_in_place_from_the_qkv_output():
    """Qwen3's q/k norms: ``[T, H, D]`` views of a fused projection output (row stride the whole row)."""
    g = torch.Generator().manual_seed(1)
    d, hq, hkv = 32, 4, 2
    qkv = torch.randn(3, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, :hq * d].view(3, hq, d)
    norm = RMSNorm(d, eps=1e-6)
    norm.weight.data = torch.randn(d, generator=g)
    torch.testing.assert_close(_on_triton(norm)(q), norm.forward_native(q), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op_cls", [SiluAndMul, GeluTanhAndMul])
def test_activation_times_up_equals_the_reference(dtype, op_cls):
    g = torch.Generator().manual_seed(2)
    gate_up = (3 * torch.randn(4, 2 * 1100, generator=g)).to(dtype)  # (two column blocks, the last partial)
    op = op_cls()
    torch.testing.assert_close(_on_triton(op_cls())(gate_up), op.forward_native(gate_up), **_tol(dtype))


def _qkv_and_rope(d, rot, hq=4, hkv=2, t=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(d + rot)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    table = RotaryEmbedding(rot, 4096, 10000.0)
    rope = table.cos_sin(torch.tensor([0, 3, 17, 200, 4000][:t]), dtype)
    return qkv, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), rope


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,rot", [(64, 64), (80, 60), (32, 16)])
def test_rotary_in_place_equals_the_reference(dtype, d, rot):
    _, q, k, _, rope = _qkv_and_rope(d, rot, dtype=dtype)
    ref_q, ref_k = ApplyRotary().forward_native(q, k, rope)
    got_q, got_k = _on_triton(ApplyRotary())(q, k, rope)
    assert got_q.data_ptr() == q.data_ptr()  # (rotated where they are: views of the qkv output)
    torch.testing.assert_close(got_q, ref_q, **_tol(dtype))
    torch.testing.assert_close(got_k, ref_k, **_tol(dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,rot", [(64, 64), (80, 60)])
def test_rotary_writes_the_rotated_keys_and_the_values_into_their_slots(cache_dtype, d, rot):
    _, q, k, v, rope = _qkv_and_rope(d, rot)
    ref_q, ref_k = ApplyRotary().forward_native(q, k, rope)
    ref_v = v.clone()
    key_cache = torch.full((40, 2, d), 7.0, dtype=cache_dtype)
    value_cache = torch.full((40, 2, d), 7.0, dtype=cache_dtype)
    slots = torch.tensor([33, 2, 17, 5, 38])
    triton_ops.rotary_and_write_kv(q, k, v, *rope, key_cache, value_cache, slots)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-5)
    # (a bfloat16 cache within one of its units: the interpreter's conversion may round the other way)
    tol = dict(rtol=1e-5, atol=1e-5) if cache_dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(key_cache[slots].float(), ref_k.to(cache_dtype).float(), **tol)
    torch.testing.assert_close(value_cache[slots].float(), ref_v.to(cache_dtype).float(), **tol)
    others = torch.ones(40, dtype=torch.bool)
    others[slots] = False
    assert (key_cache[others] == 7).all() and (value_cache[others] == 7).all()  # nothing else written
