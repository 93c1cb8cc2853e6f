"""The state layers' CPU kernels (kernels/linear_attention.c) against a float64 formula written here
and the layers' PyTorch path: the same values, and one token's bits whatever the step around it
(alone or batched with other sequences, one chunk or split across steps)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from gguf_state_writers import _tile_rows

from pagellm.kernels import linear_attention as la

from conftest import require_cpu_kernel

HK, HV, K, V, TAPS = 2, 4, 16, 24, 4
CONV = 2 * HK * K + HV * V
WIDTH = CONV + HV * V + 2 * HV  # one in-projection row: qkv | z | b | a


def _params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a_log = torch.rand(HV, generator=g) * 2 - 1
    return dict(w=torch.randn(CONV, TAPS, generator=g) * 0.5, A=-a_log.exp(),  # (the model's -exp(A_log))
                dt_bias=torch.randn(HV, generator=g), norm_w=1 + 0.3 * torch.randn(V, generator=g))


def _proj(t: int, seed: int) -> torch.Tensor:
    return torch.randn(t, WIDTH, generator=torch.Generator().manual_seed(seed))


def _parts(proj: torch.Tensor):
    return proj.split([CONV, HV * V, HV, HV], dim=-1)


def _reference(proj: torch.Tensor, p) -> torch.Tensor:
    """One sequence from zero states, in float64, the formula of HF's recurrent form written out."""
    qkv, z, b, a = (x.double() for x in _parts(proj))
    w = p["w"].double()
    xp = torch.cat([torch.zeros(TAPS - 1, CONV, dtype=torch.float64), qkv])
    conv = torch.stack([(xp[t:t + TAPS].T * w).sum(-1) for t in range(qkv.shape[0])])
    mixed = conv * torch.sigmoid(conv)
    s = torch.zeros(HV, K, V, dtype=torch.float64)
    out = []
    for t in range(qkv.shape[0]):
        q, k, v = mixed[t].split([HK * K, HK * K, HV * V])
        q = F.normalize(q.view(HK, K), dim=-1, eps=0).repeat_interleave(HV // HK, 0) / K ** 0.5
        k = F.normalize(k.view(HK, K), dim=-1, eps=0).repeat_interleave(HV // HK, 0)
        v = v.view(HV, V)
        decay = torch.exp(p["A"].double() * F.softplus(a[t] + p["dt_bias"].double()))
        beta = torch.sigmoid(b[t])
        s = s * decay[:, None, None]
        s = s + k[:, :, None] * ((v - torch.einsum("hkv,hk->hv", s, k)) * beta[:, None])[:, None, :]
        o = torch.einsum("hkv,hk->hv", s, q)
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-6) * p["norm_w"].double()
        zt = z[t].view(HV, V)
        out.append((o * zt * torch.sigmoid(zt)).reshape(-1))
    return torch.stack(out)


def _kernel(proj: torch.Tensor, p, spans, states=None, tiled: bool = False):
    """The kernels over ``spans`` of ``proj``'s rows; returns the output and the states."""
    blocks = 1 + max(s[3] for s in spans)
    rec, conv = states if states is not None else (torch.zeros(blocks, HV, K, V), torch.zeros(blocks, CONV, TAPS - 1))
    qkv, z, b, a = _parts(proj)
    mixed = la.causal_conv(qkv, conv, p["w"], spans, silu=True)
    out = la.gated_delta_rule(mixed, z, b, a, p["A"], p["dt_bias"], p["norm_w"], 1e-6, rec, spans, HK, tiled)
    return out, (rec, conv)


def _tile(x: torch.Tensor, dim: int, head: int) -> torch.Tensor:
    """Value heads grouped by key head -> tiled, along ``dim``, as the GGUF test writer (and llama.cpp's
    ``_reorder_v_heads``) reorders them."""
    return torch.from_numpy(_tile_rows(x.numpy(), HK, HV, head, dim))


def test_tiled_value_heads_give_the_grouped_heads_bits_in_llama_cpps_order():
    """A GGUF file's DeltaNet keeps its value heads tiled (every tensor's rows permuted alike): the
    kernel with ``tiled`` must give each head exactly what the grouped order gives it."""
    require_cpu_kernel(la.available, "linear-attention kernels")
    p = _params(3)
    proj = _proj(9, seed=4)
    spans = [(0, 5, True, 0), (5, 4, True, 1)]
    grouped, (rec, _) = _kernel(proj, p, spans)
    qkv, z, b, a = _parts(proj)
    qk, v = qkv.split([2 * HK * K, HV * V], dim=-1)
    tiled_proj = torch.cat([qk, _tile(v, 1, V), _tile(z, 1, V), _tile(b, 1, 1), _tile(a, 1, 1)], dim=-1)
    wqk, wv = p["w"].split([2 * HK * K, HV * V])
    tp = dict(w=torch.cat([wqk, _tile(wv, 0, V)]), A=_tile(p["A"], 0, 1), dt_bias=_tile(p["dt_bias"], 0, 1),
              norm_w=p["norm_w"])
    got, (trec, _) = _kernel(tiled_proj, tp, spans, tiled=True)
    assert torch.equal(got, _tile(grouped, 1, V))
    assert torch.equal(trec, rec[:, _tile(torch.arange(HV), 0, 1)])
    assert not torch.equal(_tile(grouped, 1, V), grouped)  # (the orders differ: the test can fail)


def test_kernels_match_a_float64_formula():
    require_cpu_kernel(la.available, "linear-attention kernels")
    p = _params()
    proj = _proj(37, seed=1)
    got, _ = _kernel(proj, p, [(0, 37, True, 0)])
    ref = _reference(proj, p)
    assert torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-4), float((got.double() - ref).abs().max())


def test_the_convolution_is_the_pytorch_paths_bits():
    """Without the SiLU, the kernel's convolution is the layer's PyTorch sums in their order."""
    require_cpu_kernel(la.available, "linear-attention kernels")
    p = _params()
    x = _proj(9, seed=2)[:, :CONV]  # (rows strided, as the projection's)
    state = torch.randn(3, CONV, TAPS - 1)
    spans = [(0, 5, False, 2), (5, 4, True, 0)]
    ref_state = state.clone()
    ref = torch.empty(9, CONV)
    for row0, n, fresh, block in spans:  # (the layer's native sums, written out)
        xp = torch.cat([torch.zeros(TAPS - 1, CONV) if fresh else ref_state[block].t(), x[row0:row0 + n]])
        acc = xp[0:n] * p["w"][:, 0]
        for j in range(1, TAPS):
            acc = acc + xp[j:j + n] * p["w"][:, j]
        ref[row0:row0 + n] = acc
        ref_state[block] = xp[n:].t()
    got = la.causal_conv(x, state, p["w"], spans, silu=False)
    assert torch.equal(got, ref) and torch.equal(state, ref_state)


def test_a_tokens_bits_do_not_depend_on_the_step_around_it():
    """Three sequences in one step, each alone, and each split into chunks over several steps (the
    states carried in their blocks between them): the same output and state bits."""
    require_cpu_kernel(la.available, "linear-attention kernels")
    p = _params(3)
    lens = [23, 1, 9]
    proj = _proj(sum(lens), seed=4)
    rows = [sum(lens[:i]) for i in range(3)]
    spans = [(rows[i], lens[i], True, 2 * i + 1) for i in range(3)]
    together, (rec, conv) = _kernel(proj, p, spans)
    for i, (r0, n, _, block) in enumerate(spans):
        alone, (rec1, conv1) = _kernel(proj[r0:r0 + n], p, [(0, n, True, block)])
        assert torch.equal(alone, together[r0:r0 + n]), f"sequence {i} alone"
        assert torch.equal(rec1[block], rec[block]) and torch.equal(conv1[block], conv[block])
        # the same tokens in chunks of up to 5 per step, the last two steps single decodes
        cuts = sorted({0, n, *range(0, n, 5), max(n - 2, 0), max(n - 1, 0)})
        states, outs = None, []
        for c0, c1 in itertools.pairwise(cuts):
            out, states = _kernel(proj[r0 + c0:r0 + c1], p, [(0, c1 - c0, c0 == 0, block)], states)
            outs.append(out)
        assert torch.equal(torch.cat(outs), together[r0:r0 + n]), f"sequence {i} in chunks"
        assert torch.equal(states[0][block], rec[block]) and torch.equal(states[1][block], conv[block])


@pytest.mark.parametrize("tiled", [False, True])
def test_the_layers_pytorch_path_matches_the_kernels(tiled):
    """The PyTorch path (the layer's off the CPU kernels) against the kernels on the same step, in
    either order of the value heads."""
    require_cpu_kernel(la.available, "linear-attention kernels")
    from types import SimpleNamespace

    from pagellm.attention.metadata import StateMetadata
    from pagellm.distributed import TensorParallelGroup
    from pagellm.models.qwen3_5 import GatedDeltaNet

    cfg = SimpleNamespace(hidden_size=32, linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=K,
                          linear_value_head_dim=V, linear_conv_kernel_dim=TAPS, rms_norm_eps=1e-6,
                          linear_value_heads_tiled=tiled)
    layer = GatedDeltaNet(cfg, TensorParallelGroup())
    p = _params(5)
    with torch.no_grad():
        layer.conv_weight.copy_(p["w"])
        layer.A.copy_(p["A"])
        layer.dt_bias.copy_(p["dt_bias"])
        layer.norm.weight.copy_(p["norm_w"])
    proj = _proj(12, seed=6)
    spans = [(0, 7, True, 0), (7, 1, False, 1), (8, 4, True, 2)]
    states = (torch.randn(3, HV, K, V) * 0.1, torch.randn(3, CONV, TAPS - 1))
    native_states = tuple(s.clone() for s in states)
    got, states = _kernel(proj, p, spans, states, tiled)
    ref = layer.forward_native(*_parts(proj), native_states, StateMetadata.in_place(spans))
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-4), float((got - ref).abs().max())
    for a, b in zip(states, native_states, strict=True):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4)


# Mamba2 (Granite 4): 4 heads of 8 features in 2 groups of B/C, a 6-wide state.
MH, MP, MN, MG = 4, 8, 6, 2
MCONV = MH * MP + 2 * MG * MN


def _mamba_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return dict(A=-(torch.rand(MH, generator=g) * 2).exp(), dt_bias=torch.randn(MH, generator=g),
                d=1 + 0.3 * torch.randn(MH, generator=g), norm_w=1 + 0.3 * torch.randn(MH * MP, generator=g))


def _mamba_reference(xbc: torch.Tensor, dt: torch.Tensor, z: torch.Tensor, p, dt_min: float = 0.0) -> torch.Tensor:
    """One sequence from a zero state, in float64: HF's selective state update written out, then the
    gated group norm."""
    xbc, dt, z = xbc.double(), dt.double(), z.double()
    s = torch.zeros(MH, MP, MN, dtype=torch.float64)
    a = p["A"].double()
    ys = []
    for t in range(xbc.shape[0]):
        x, b, c = xbc[t].split([MH * MP, MG * MN, MG * MN])
        b = b.view(MG, MN).repeat_interleave(MH // MG, 0)
        c = c.view(MG, MN).repeat_interleave(MH // MG, 0)
        d = F.softplus(dt[t] + p["dt_bias"].double()).clamp(min=dt_min)  # (HF's dt_limit floor)
        s = s * torch.exp(d * a)[:, None, None] + (d[:, None] * b)[:, None, :] * x.view(MH, MP)[:, :, None]
        ys.append(((s * c[:, None, :]).sum(-1) + x.view(MH, MP) * p["d"].double()[:, None]).reshape(-1))
    h = torch.stack(ys) * z * torch.sigmoid(z)
    h = h.view(-1, MG, MH * MP // MG)
    h = h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6)
    return h.reshape(-1, MH * MP) * p["norm_w"].double()


def _mamba_kernel(xbc, dt, z, p, spans, state=None, dt_min: float = 0.0):
    state = state if state is not None else torch.zeros(1 + max(s[3] for s in spans), MH, MP, MN)
    y = la.mamba2_ssm(xbc, dt, p["A"], p["dt_bias"], p["d"], state, spans, MG, dt_min=dt_min)
    return la.gated_group_norm(y, z, p["norm_w"], MH * MP // MG, 1e-6), state


def test_mamba2_kernels_match_a_float64_formula_and_keep_their_bits_in_any_step():
    require_cpu_kernel(la.available, "linear-attention kernels")
    g = torch.Generator().manual_seed(7)
    p = _mamba_params(1)
    lens = [19, 1, 6]
    t = sum(lens)
    proj = torch.randn(t, MCONV + MH + MH * MP, generator=g)  # (xbc | dt | z: rows strided, as one projection's)
    xbc, dt, z = proj[:, :MCONV].contiguous(), proj[:, MCONV:MCONV + MH], proj[:, MCONV + MH:]
    rows = [sum(lens[:i]) for i in range(3)]
    together, state = _mamba_kernel(xbc, dt, z, p, [(rows[i], lens[i], True, i) for i in range(3)])
    for i, (r0, n) in enumerate(zip(rows, lens, strict=True)):
        sl = slice(r0, r0 + n)
        ref = _mamba_reference(xbc[sl], dt[sl], z[sl], p)
        assert torch.allclose(together[sl].double(), ref, atol=2e-5, rtol=1e-4), float((together[sl] - ref).abs().max())
        # one token at a time (decodes), carried in the block: the same bits
        st, outs = None, []
        for j in range(n):
            out, st = _mamba_kernel(xbc[r0 + j:r0 + j + 1], dt[r0 + j:r0 + j + 1], z[r0 + j:r0 + j + 1], p,
                                    [(0, 1, j == 0, i)], st)
            outs.append(out)
        assert torch.equal(torch.cat(outs), together[sl]) and torch.equal(st[i], state[i]), f"sequence {i} decoded"


def test_mamba2_steps_floored_at_dt_min_match_the_formula():
    """Nemotron-H floors each step's ``softplus(dt + dt_bias)`` at ``time_step_limit[0]``: the kernel with
    a floor that binds on a good share of the steps against the float64 formula clamped alike."""
    require_cpu_kernel(la.available, "linear-attention kernels")
    g = torch.Generator().manual_seed(11)
    p = _mamba_params(3)
    t, floor = 9, 0.5
    proj = torch.randn(t, MCONV + MH + MH * MP, generator=g)
    xbc, dt, z = proj[:, :MCONV].contiguous(), proj[:, MCONV:MCONV + MH], proj[:, MCONV + MH:]
    bound = (F.softplus(dt + p["dt_bias"]) < floor).float().mean()
    assert 0.1 < bound < 0.9, float(bound)  # (the floor binds on some steps, not all)
    got, _ = _mamba_kernel(xbc, dt, z, p, [(0, t, True, 0)], dt_min=floor)
    ref = _mamba_reference(xbc, dt, z, p, dt_min=floor)
    assert torch.allclose(got.double(), ref, atol=2e-5, rtol=1e-4), float((got - ref).abs().max())
    unfloored, _ = _mamba_kernel(xbc, dt, z, p, [(0, t, True, 0)])
    assert not torch.allclose(got, unfloored, atol=1e-3)


@pytest.mark.parametrize("dt_min", [0.0, 0.5])
def test_the_mamba2_layers_pytorch_path_matches_the_kernels(dt_min):
    require_cpu_kernel(la.available, "linear-attention kernels")
    from types import SimpleNamespace

    from pagellm.attention.metadata import StateMetadata
    from pagellm.distributed import TensorParallelGroup
    from pagellm.models.granite_hybrid import Mamba2Mixer

    cfg = SimpleNamespace(hidden_size=16, mamba_n_heads=MH, mamba_d_head=MP, mamba_d_state=MN, mamba_n_groups=MG,
                          mamba_expand=2, mamba_d_conv=TAPS, mamba_proj_bias=False, mamba_conv_bias=True,
                          rms_norm_eps=1e-6, mamba_dt_min=dt_min)
    layer = Mamba2Mixer(cfg, TensorParallelGroup())
    p = _mamba_params(2)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        layer.conv_weight.copy_(torch.randn(MCONV, TAPS, generator=g) * 0.5)
        layer.conv_bias.copy_(torch.randn(MCONV, generator=g))
        layer.A.copy_(p["A"])
        layer.dt_bias.copy_(p["dt_bias"])
        layer.D.copy_(p["d"])
        layer.norm.weight.copy_(p["norm_w"])
    z, xbc, dt = torch.randn(11, MH * MP + MCONV + MH, generator=g).split([MH * MP, MCONV, MH], dim=-1)
    spans = [(0, 6, True, 0), (6, 1, False, 1), (7, 4, False, 2)]
    states = (torch.randn(3, MH, MP, MN) * 0.1, torch.randn(3, MCONV, TAPS - 1))
    native = tuple(s.clone() for s in states)
    conv = la.causal_conv(xbc, states[1], layer.conv_weight, spans, True, layer.conv_bias)
    y = la.mamba2_ssm(conv, dt, layer.A, layer.dt_bias, layer.D, states[0], spans, MG, dt_min=layer.dt_min)
    got = la.gated_group_norm(y, z, layer.norm.weight, MH * MP // MG, 1e-6)
    ref = layer.forward_native(z, xbc, dt, native, StateMetadata.in_place(spans))
    assert torch.allclose(got, ref, atol=2e-5, rtol=1e-4), float((got - ref).abs().max())
    for a, b in zip(states, native, strict=True):
        assert torch.allclose(a, b, atol=2e-5, rtol=1e-4)
