"""Paged attention equals dense causal SDPA on random shapes (GQA, mixed chunks and decodes,
decodes sharing prefix blocks)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pagellm.attention import AttentionKind, cpu_kernel, get_attention_backend, select_attention_backend, torch_paged
from pagellm.attention.cpu_paged import CpuPagedAttention
from pagellm.attention.kv_quant import cache_head_dim, from_cache, to_cache
from pagellm.attention.torch_paged import TorchPagedAttention

from conftest import cpu_has, require_avx512_kernel, require_cpu_kernel


def _representable(shape, cache_dtype):
    """Random K/V values that a ``cache_dtype`` cache holds exactly."""
    x = torch.randn(*shape)
    if cache_dtype != torch.int8:
        return x.to(cache_dtype).float()
    q = torch.randint(-127, 128, shape).float()
    q[..., 0] = 127  # the absmax, so the scale comes out as the drawn power of two
    return q * 2.0 ** torch.randint(-8, -5, shape[:-1] + (1,)).float()  # |x| up to 1-4, like randn


def _dense_reference(q, k_all, v_all, num_computed, scale):
    """q [L, Hq, D] at positions num_computed.., k/v_all [num_computed + L, Hkv, D]."""
    hq, hkv = q.shape[1], k_all.shape[1]
    k = k_all.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    v = v_all.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    qh = q.transpose(0, 1)
    lq, lk = q.shape[0], k_all.shape[0]
    mask = torch.arange(lk)[None, :] <= (torch.arange(lq) + num_computed)[:, None]
    return F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale).transpose(0, 1).reshape(lq, -1)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 2), (9, 3), (14, 2), (18, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
# The compiled decode kernel against the same dense oracle; d = 64 takes its specialised branch,
# and the prefill kernel takes every chunk (queries strided, as in the model), over either cache.
# A float16 cache (kv_cache_dtype="float16") under float32 queries, pure path and kernel; its K/V
# values are drawn float16-representable so the float32 oracle stays exact. The same for an int8
# cache (rows of int8 times a power-of-two scale, which the cache stores exactly).
# Head sizes 80, 96, 128 and 256 take the AVX-512 path's wider instances (fewer query heads per group).
@pytest.mark.parametrize("decode_kernel,d,cache_dtype", [
    (False, 16, torch.float32), (True, 16, torch.float32), (True, 64, torch.float32),
    (False, 16, torch.float16), (True, 64, torch.float16), (False, 16, torch.int8), (True, 64, torch.int8),
    (True, 80, torch.float32), (True, 96, torch.int8), (True, 128, torch.float16), (True, 256, torch.float16),
    (True, 48, torch.float16)])
def test_paged_equals_dense(block_size, hq, hkv, seed, decode_kernel, d, cache_dtype, monkeypatch):
    monkeypatch.setattr(torch_paged, "MIN_SHARED_TOKENS", 4)  # exercise cascade groups on small shapes
    if decode_kernel:
        require_cpu_kernel(cpu_kernel.available)
        if cache_dtype != torch.float32:
            cache_row = torch.empty(1, hkv, cache_head_dim(d, cache_dtype), dtype=cache_dtype)
            require_avx512_kernel(lambda: cpu_kernel.usable_for(cache_row), f"decode kernel over a {cache_dtype} cache")

    def randn(*shape):
        return _representable(shape, cache_dtype)

    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 2000 // block_size + 64
    # Random, not zero: unwritten slots and block tails must not leak into the result.
    key_cache = to_cache(torch.randn(num_blocks * block_size, hkv, d), cache_dtype)
    value_cache = to_cache(torch.randn(num_blocks * block_size, hkv, d), cache_dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # A shared prefix (physical blocks and their K/V) that some decodes start with.
    shared_len = rng.randint(1, 6) * block_size if block_size > 1 else rng.randint(4, 40)
    shared_blocks = [free.pop() for _ in range(shared_len // block_size)]
    shared_k, shared_v = randn(shared_len, hkv, d), randn(shared_len, hkv, d)
    # (num_computed_tokens, num_new_tokens, shares_prefix): decodes, chunks with context, fresh prefills.
    shapes = [(rng.randint(1, 60), 1, False) for _ in range(rng.randint(0, 20))]
    shapes += [(shared_len + rng.randint(0, 40), 1, True) for _ in range(rng.randint(0, 12))]
    shapes += [(rng.randint(1, 50), rng.randint(2, 20), False) for _ in range(rng.randint(0, 3))]
    shapes += [(0, rng.randint(1, 30), False) for _ in range(rng.randint(1, 2))]
    seqs = []
    for num_computed, n, shares in shapes:
        total = num_computed + n
        k_all, v_all = randn(total, hkv, d), randn(total, hkv, d)
        blocks = list(shared_blocks) if shares else []
        if shares:
            k_all[:shared_len], v_all[:shared_len] = shared_k, shared_v
        blocks += [free.pop() for _ in range(-(-total // block_size) - len(blocks))]
        past = [blocks[p // block_size] * block_size + p % block_size for p in range(num_computed)]
        if past:
            key_cache[past] = to_cache(k_all[:num_computed], cache_dtype)
            value_cache[past] = to_cache(v_all[:num_computed], cache_dtype)
        seqs.append((num_computed, n, blocks, k_all, v_all, torch.randn(n, hq, d)))
    decodes = [s for s in seqs if s[1] == 1 and s[0] > 0]
    chunks = [s for s in seqs if not (s[1] == 1 and s[0] > 0)]
    prefill_kernel = decode_kernel and d % 16 == 0 and d <= 256 and cpu_has("avx512f")  # its sizes, on AVX-512
    # The backend the engine would choose for this cache: the reference, or the kernels that apply.
    backend = CpuPagedAttention.for_cache(key_cache, torch.float32) if decode_kernel else TorchPagedAttention()
    assert getattr(backend, "decode_kernel", False) == decode_kernel
    assert getattr(backend, "prefill_kernel", False) == prefill_kernel, "no prefill kernel (AVX-512?)"
    meta = backend.build_metadata([c + 1 for c, *_ in decodes], [b for _, _, b, *_ in decodes],
                                  [(c, n, b) for c, n, b, *_ in chunks], block_size, torch.device("cpu"))
    assert meta.backend is backend
    assert any(g.kind == AttentionKind.PREFILL_KERNEL for g in meta.groups) == prefill_kernel
    # (without the prefill kernel, the chunks' tokens are decodes too)
    assert any(g.kind == AttentionKind.DECODE_KERNEL for g in meta.groups) == (decode_kernel and (
        bool(decodes) or not prefill_kernel))
    assert sorted(meta.decode_order) == list(range(len(decodes)))
    if not decode_kernel and sum(s[2][:1] == shared_blocks[:1] for s in decodes) > 1 and shared_len >= 4:
        assert any(g.kind == AttentionKind.CASCADE_DECODE for g in meta.groups), "sharing decodes must cascade"
    order = [decodes[i] for i in meta.decode_order] + chunks
    slots = [b[p // block_size] * block_size + p % block_size for c, n, b, *_ in order for p in range(c, c + n)]
    meta.slot_mapping = torch.tensor(slots)
    q = torch.cat([s[5] for s in order])
    q = torch.cat([q.flatten(1), torch.randn(q.shape[0], 8)], dim=1)[:, :hq * d].view(q.shape)  # rows strided
    k = torch.cat([s[3][s[0]:] for s in order])
    v = torch.cat([s[4][s[0]:] for s in order])
    out = backend.forward(q, k, v, key_cache, value_cache, meta, d ** -0.5)
    start = 0
    for c, n, _, k_all, v_all, qs in order:
        ref = _dense_reference(qs, k_all, v_all, c, d ** -0.5)
        torch.testing.assert_close(out[start:start + n], ref, atol=1e-5, rtol=1e-5)
        start += n
    torch.testing.assert_close(from_cache(key_cache[slots], torch.float32), k)  # new K/V landed in their slots
    torch.testing.assert_close(from_cache(value_cache[slots], torch.float32), v)


def _windowed_reference(q, k_all, v_all, num_computed, scale, window, softcap):
    """float64: q [L, Hq, D] at positions num_computed.. over keys p - window < k <= p, each score
    s capped to softcap * tanh(s / softcap)."""
    hq, hkv = q.shape[1], k_all.shape[1]
    k = k_all.double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    v = v_all.double().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qpos = (torch.arange(q.shape[0]) + num_computed)[:, None]
    kpos = torch.arange(k_all.shape[0])[None, :]
    allowed = (kpos <= qpos) & ((qpos - kpos < window) if window is not None else True)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return (p @ v).transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("window,softcap", [(1, None), (5, None), (37, None), (None, 4.0), (16, 2.5)])
@pytest.mark.parametrize("d,cache_dtype,block_size", [
    (64, torch.float32, 16), (64, torch.float16, 3), (64, torch.int8, 16), (96, torch.float32, 16),
    (128, torch.float16, 16), (256, torch.int8, 5), (40, torch.float32, 16), (16, torch.float32, 1),
    (48, torch.float16, 16)])
def test_decode_kernel_with_a_window_and_a_softcap_equals_a_float64_formula(window, softcap, d, cache_dtype,
                                                                             block_size):
    """The decode kernel's sliding window and soft-cap (its AVX-512 path at head sizes 64 to 256 over
    each cache, its generic AVX-512 instance at 48 and 16, its portable path at 40) over decodes of
    every length around the window and block edges; the prefill chunks in the same step take the
    prefill kernel at the AVX-512 sizes (the reference at 40): a fresh one longer than the window and
    one after cached tokens."""
    require_cpu_kernel(cpu_kernel.available)
    if cache_dtype != torch.float32:
        row = torch.empty(1, 2, cache_head_dim(d, cache_dtype), dtype=cache_dtype)
        require_avx512_kernel(lambda: cpu_kernel.usable_for(row), f"decode kernel over a {cache_dtype} cache")
    hq, hkv = 8, 2
    torch.manual_seed(d + block_size)
    num_blocks = 4000 // block_size
    key_cache = to_cache(torch.randn(num_blocks * block_size, hkv, d), cache_dtype)
    value_cache = to_cache(torch.randn(num_blocks * block_size, hkv, d), cache_dtype)
    free = torch.randperm(num_blocks).tolist()
    backend = CpuPagedAttention.for_cache(key_cache, torch.float32)
    assert backend.decode_kernel, f"no decode kernel for a {cache_dtype} cache of head size {d}"
    seqs = []
    for num_computed, n in [(c, 1) for c in (1, 2, 4, 5, 6, 15, 16, 17, 36, 37, 38, 80)] + [(20, 7), (0, 90)]:
        total = num_computed + n
        k_all, v_all = (_representable((total, hkv, d), cache_dtype) for _ in range(2))
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        past = [blocks[p // block_size] * block_size + p % block_size for p in range(num_computed)]
        key_cache[past] = to_cache(k_all[:num_computed], cache_dtype)
        value_cache[past] = to_cache(v_all[:num_computed], cache_dtype)
        seqs.append((num_computed, n, blocks, k_all, v_all, torch.randn(n, hq, d) * 4))
    decodes, chunks = seqs[:-2], seqs[-2:]
    meta = backend.build_metadata([c + 1 for c, *_ in decodes], [b for _, _, b, *_ in decodes],
                                  [(c, n, b) for c, n, b, *_ in chunks], block_size, torch.device("cpu"))
    assert any(g.kind == AttentionKind.DECODE_KERNEL for g in meta.groups)
    assert any(g.kind == AttentionKind.PREFILL_KERNEL for g in meta.groups) == (d % 16 == 0 and cpu_has("avx512f"))
    order = [decodes[i] for i in meta.decode_order] + chunks
    meta.slot_mapping = torch.tensor([b[p // block_size] * block_size + p % block_size
                                      for c, n, b, *_ in order for p in range(c, c + n)])
    q = torch.cat([s[5] for s in order])
    out = backend.forward(q, torch.cat([s[3][s[0]:] for s in order]), torch.cat([s[4][s[0]:] for s in order]),
                          key_cache, value_cache, meta, d ** -0.5, window=window, softcap=softcap)
    start = 0
    for c, n, _, k_all, v_all, qs in order:
        ref = _windowed_reference(qs, k_all, v_all, c, d ** -0.5, window, softcap)
        torch.testing.assert_close(out[start:start + n].double(), ref, atol=2e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 64), (32, 1, 64), (16, 8, 128), (5, 1, 128)])
def test_prefill_kernel_over_long_contexts(hq, hkv, d):
    """Chunks after thousands of cached tokens and a long fresh prompt: the prefill kernel's tiling
    changes with the context length (fewer query tokens per task), the result must not."""
    backend = CpuPagedAttention.for_cache(torch.empty(1, hkv, d), torch.float32)
    require_avx512_kernel(lambda: backend.prefill_kernel, "prefill attention kernel")
    torch.manual_seed(0)
    bs = 16
    shapes = [(3000, 40), (0, 1100), (1999, 1)]
    num_blocks = sum(-(-(c + n) // bs) for c, n in shapes) + 8
    key_cache, value_cache = torch.randn(num_blocks * bs, hkv, d), torch.randn(num_blocks * bs, hkv, d)
    free = torch.randperm(num_blocks).tolist()
    chunks, qs, ks, vs, refs = [], [], [], [], []
    for c, n in shapes:
        blocks = [free.pop() for _ in range(-(-(c + n) // bs))]
        k_all, v_all = torch.randn(c + n, hkv, d), torch.randn(c + n, hkv, d)
        past = [blocks[p // bs] * bs + p % bs for p in range(c)]
        key_cache[past], value_cache[past] = k_all[:c], v_all[:c]
        q = torch.randn(n, hq, d)
        chunks.append((c, n, blocks))
        qs.append(q), ks.append(k_all[c:]), vs.append(v_all[c:])
        refs.append(_dense_reference(q, k_all, v_all, c, d ** -0.5))
    meta = backend.build_metadata([], [], chunks, bs, torch.device("cpu"))
    meta.slot_mapping = torch.tensor([b[p // bs] * bs + p % bs for c, n, b in chunks for p in range(c, c + n)])
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), key_cache, value_cache, meta, d ** -0.5)
    torch.testing.assert_close(out, torch.cat(refs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("d,hq,window,softcap", [
    (64, 9, None, None), (128, 6, None, None), (80, 3, None, None), (96, 12, None, 30.0), (256, 6, None, None),
    (64, 9, 50, None), (128, 6, 512, None), (256, 12, 40, 50.0), (256, 3, 1, None),
    (32, 12, None, None), (48, 6, 40, 30.0), (112, 3, None, None)])  # the generic instance's sizes
@pytest.mark.parametrize("prefill", ["kernel", "as_decodes"])
def test_prefill_kernel_gives_the_decode_kernels_bits(cache_dtype, d, hq, window, softcap, prefill):
    """Prompt tokens through the prefill kernel and the same tokens decoded one by one give the same
    bits (a request preempted by recompute prefills tokens it had decoded, and a cached answer
    repeated in a prompt was decoded): fresh chunks, chunks after thousands of cached tokens,
    one-token chunks, grouped-query heads, every cache type, every head size with a kernel, sliding
    windows (shorter and longer than the chunks, one token) and soft-caps (Gemma 2: 50). Without
    the prefill kernel (no AVX-512: "as_decodes", on every machine) each chunk token is a decode
    of its own position, through the decode kernel's path for this CPU."""
    hkv, bs, num_blocks = 3, 16, 400
    backend = CpuPagedAttention.for_cache(torch.empty(1, hkv, cache_head_dim(d, cache_dtype), dtype=cache_dtype),
                                          torch.float32)
    if prefill == "kernel":
        require_avx512_kernel(lambda: backend.prefill_kernel and backend.decode_kernel,
                              "prefill and decode attention kernels")
    else:
        require_cpu_kernel(lambda: backend.decode_kernel, f"decode kernel over a {cache_dtype} cache")
        backend = CpuPagedAttention(decode_kernel=True, prefill_kernel=False, write_kv_kernel=backend.write_kv_kernel)
    torch.manual_seed(3)
    key_cache = to_cache(torch.randn(num_blocks * bs, hkv, d), cache_dtype)
    value_cache = to_cache(torch.randn(num_blocks * bs, hkv, d), cache_dtype)
    free = torch.randperm(num_blocks).tolist()
    chunks, tokens = [], []  # tokens: (position + 1, block ids, slot) of every query row
    for num_computed, n in [(0, 37), (100, 50), (333, 1), (5, 300), (2500, 64)]:
        blocks = [free.pop() for _ in range(-(-(num_computed + n) // bs))]
        chunks.append((num_computed, n, blocks))
        tokens += [(p + 1, blocks, blocks[p // bs] * bs + p % bs) for p in range(num_computed, num_computed + n)]
    q, k, v = torch.randn(len(tokens), hq, d), torch.randn(len(tokens), hkv, d), torch.randn(len(tokens), hkv, d)

    meta = backend.build_metadata([], [], chunks, bs, torch.device("cpu"))
    assert [g.kind for g in meta.groups] == [AttentionKind.PREFILL_KERNEL if prefill == "kernel"
                                             else AttentionKind.DECODE_KERNEL]
    meta.slot_mapping = torch.tensor([slot for *_, slot in tokens])
    kc, vc = key_cache.clone(), value_cache.clone()
    prefilled = backend.forward(q, k, v, kc, vc, meta, d ** -0.5, window, softcap)

    meta = backend.build_metadata([n for n, *_ in tokens], [b for _, b, _ in tokens], [], bs, torch.device("cpu"))
    assert {g.kind for g in meta.groups} == {AttentionKind.DECODE_KERNEL}
    order = torch.tensor(meta.decode_order)  # the decode rows in the backend's order
    meta.slot_mapping = torch.tensor([tokens[i][2] for i in meta.decode_order])
    decoded = torch.empty_like(prefilled)
    decoded[order] = backend.forward(q[order], k[order], v[order], key_cache.clone(), value_cache.clone(), meta,
                                     d ** -0.5, window, softcap)
    assert torch.equal(prefilled, decoded)
    if window is not None or softcap is not None:  # and both are the formula (so neither ignored them)
        start = 0
        for c, n, blocks in chunks:  # (every K/V as the cache holds them after the step)
            slots = [blocks[p // bs] * bs + p % bs for p in range(c + n)]
            k_all, v_all = from_cache(kc[slots], torch.float32), from_cache(vc[slots], torch.float32)
            ref = _windowed_reference(q[start:start + n], k_all, v_all, c, d ** -0.5, window, softcap)
            torch.testing.assert_close(prefilled[start:start + n].double(), ref, atol=2e-5, rtol=1e-5)
            start += n


def test_backend_is_chosen_once_per_cache(monkeypatch):
    """The registry picks "cpu" where a kernel applies and the kernel-free reference otherwise;
    the reference never touches a kernel (it is the oracle)."""
    assert get_attention_backend("torch") is TorchPagedAttention
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash")
    bf16 = select_attention_backend(torch.empty(4, 2, 64, dtype=torch.bfloat16), torch.bfloat16)
    assert type(bf16) is TorchPagedAttention
    monkeypatch.setenv("PAGELLM_CPU_KERNELS", "0")
    assert type(select_attention_backend(torch.empty(4, 2, 64), torch.float32)) is TorchPagedAttention
    monkeypatch.delenv("PAGELLM_CPU_KERNELS")
    require_cpu_kernel(cpu_kernel.available)
    cpu = select_attention_backend(torch.empty(4, 2, 64), torch.float32)
    assert isinstance(cpu, CpuPagedAttention) and cpu.decode_kernel and cpu.write_kv_kernel
    assert "cpu_kernel" not in vars(torch_paged) and "cpu_ops" not in vars(torch_paged)


def _bf16_tiles_reference(q, k_all, v_all, num_computed, scale):
    """float64, the AMX prefill kernel's numerics written out: q, K and V rounded to bfloat16, the
    softmax weights exp(s - max) rounded to bfloat16 before P V, their float64 sum divided out."""
    def bf(x):
        return x.to(torch.bfloat16).double()

    hq, hkv = q.shape[1], k_all.shape[1]
    k = bf(k_all).repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    v = bf(v_all).repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    s = bf(q).transpose(0, 1) @ k.transpose(1, 2) * scale
    allowed = torch.arange(k_all.shape[0])[None, :] <= (torch.arange(q.shape[0]) + num_computed)[:, None]
    s = s.masked_fill(~allowed, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return ((bf(e) @ v) / e.sum(-1, keepdim=True)).transpose(0, 1).reshape(q.shape[0], -1)


def _bf16_tiles_backend(hkv, d, cache_dtype):
    from conftest import require_kernel

    backend = CpuPagedAttention.for_cache(torch.empty(1, hkv, d, dtype=cache_dtype), torch.float32,
                                          bf16_prefill=True)
    require_kernel(lambda: backend.prefill_bf16_tiles, "AMX prefill attention kernel",
                   ("avx512f", "amx_bf16", "amx_tile"), ("PAGELLM_CPU_AMX",))
    return backend


def _run_steps(backend, steps, key_cache, value_cache, d):
    """Each step a list of ``(num_computed, q, k, v, blocks)``: one-token ones after cached tokens go
    in as decodes (as a pooling run's scheduler hands them over), the rest as chunks. The output
    rows of each entry, in the order given."""
    bs, outs = 16, {}
    for step in steps:
        decodes = [i for i, (c, q, *_) in enumerate(step) if c > 0 and q.shape[0] == 1]
        chunks = [i for i in range(len(step)) if i not in decodes]
        meta = backend.build_metadata([step[i][0] + 1 for i in decodes], [step[i][4] for i in decodes],
                                      [(step[i][0], step[i][1].shape[0], step[i][4]) for i in chunks], bs,
                                      torch.device("cpu"))
        assert {g.kind for g in meta.groups} == {AttentionKind.PREFILL_KERNEL}
        order = [decodes[j] for j in meta.decode_order] + chunks
        meta.slot_mapping = torch.tensor([step[i][4][p // bs] * bs + p % bs for i in order
                                          for p in range(step[i][0], step[i][0] + step[i][1].shape[0])])
        out = backend.forward(*(torch.cat([step[i][j] for i in order]) for j in (1, 2, 3)), key_cache, value_cache,
                              meta, d ** -0.5)
        start = 0
        for i in order:
            n = step[i][1].shape[0]
            outs[id(step[i])] = out[start:start + n]
            start += n
    return [outs[id(e)] for step in steps for e in step]


@pytest.mark.parametrize("hq,hkv,d,cache_dtype", [(16, 8, 128, torch.float16), (9, 3, 64, torch.float32),
                                                  (6, 3, 128, torch.float32), (32, 1, 64, torch.float16)])
def test_bf16_tile_prefill_equals_its_float64_formula(hq, hkv, d, cache_dtype):
    """The prefill kernel on AMX bfloat16 tiles (pooling runs in bfloat16 numerics) against its
    numerics written in float64: fresh chunks, chunks after thousands of cached tokens, one-token
    chunks, grouped-query heads, both head sizes, a float32 or float16 cache."""
    backend = _bf16_tiles_backend(hkv, d, cache_dtype)
    torch.manual_seed(0)
    bs, shapes = 16, [(0, 37), (100, 50), (333, 1), (5, 300), (2500, 64), (0, 700), (40, 1)]
    num_blocks = sum(-(-(c + n) // bs) for c, n in shapes) + 8
    key_cache = torch.randn(num_blocks * bs, hkv, d).to(cache_dtype)
    value_cache = torch.randn(num_blocks * bs, hkv, d).to(cache_dtype)
    free = torch.randperm(num_blocks).tolist()
    step, full = [], []
    for c, n in shapes:
        blocks = [free.pop() for _ in range(-(-(c + n) // bs))]
        k_all, v_all = (torch.randn(c + n, hkv, d).to(cache_dtype).float() for _ in range(2))
        past = [blocks[p // bs] * bs + p % bs for p in range(c)]
        key_cache[past], value_cache[past] = k_all[:c].to(cache_dtype), v_all[:c].to(cache_dtype)
        step.append((c, torch.randn(n, hq, d), k_all[c:], v_all[c:], blocks))
        full.append((k_all, v_all))
    outs = _run_steps(backend, [step], key_cache, value_cache, d)
    for (c, q, *_), (k_all, v_all), out in zip(step, full, outs, strict=True):
        torch.testing.assert_close(out.double(), _bf16_tiles_reference(q, k_all, v_all, c, d ** -0.5),
                                   rtol=0, atol=2e-3)
        # bfloat16's rounding, not float32 attention (which meets 1e-5: test_prefill_kernel_over_long_contexts)
        assert (out - _dense_reference(q, k_all, v_all, c, d ** -0.5)).abs().max() > 1e-4


def test_bf16_tile_prefill_is_batch_and_chunk_invariant():
    """A row's bits depend only on its query, its position and the keys before it: the same prompts
    prefilled together, one by one, and cut into chunks (some of one token) in other steps."""
    hq, hkv, d, bs = 8, 2, 128, 16
    backend = _bf16_tiles_backend(hkv, d, torch.float16)
    torch.manual_seed(1)
    lens = [300, 45, 1, 600, 17]
    key_cache = torch.zeros(200 * bs, hkv, d, dtype=torch.float16)
    value_cache = torch.zeros_like(key_cache)
    free = torch.randperm(200).tolist()
    prompts = []
    for n in lens:
        prompts.append((torch.randn(n, hq, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d),
                        [free.pop() for _ in range(-(-n // bs))]))

    def cut(i, a, b):
        q, k, v, blocks = prompts[i]
        return (a, q[a:b], k[a:b], v[a:b], blocks)

    together = _run_steps(backend, [[cut(i, 0, n) for i, n in enumerate(lens)]], key_cache, value_cache, d)
    alone = [_run_steps(backend, [[cut(i, 0, n)]], key_cache, value_cache, d)[0] for i, n in enumerate(lens)]
    cuts = {0: [0, 1, 130, 131, 300], 1: [0, 44, 45], 2: [0, 1], 3: [0, 257, 258, 599, 600], 4: [0, 16, 17]}
    steps = [[cut(i, c[s], c[s + 1]) for i, c in cuts.items() if s + 1 < len(c)] for s in range(4)]
    chunked = _run_steps(backend, steps, key_cache, value_cache, d)
    rejoined = [torch.cat([o for (c, q, *_, blocks), o in zip([e for st in steps for e in st], chunked, strict=True)
                           if blocks is prompts[i][3]]) for i in range(len(lens))]
    for i in range(len(lens)):
        assert torch.equal(together[i], alone[i]), i
        assert torch.equal(together[i], rejoined[i]), i
