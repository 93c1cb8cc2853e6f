"""The CUDA backend's Triton attention kernel, run on the CPU by Triton's interpreter
(``TRITON_INTERPRET=1``) against the torch reference backend: decodes and chunks (fresh, after a
prefix, several in a step), GQA, head sizes that need padding, every cache dtype, sliding windows
and soft-caps. Small shapes: the interpreter runs each program in numpy."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # (before triton is imported: it decides at import)

from pagellm.attention.cuda_paged import CudaPagedAttention  # noqa: E402
from pagellm.attention.torch_paged import TorchPagedAttention  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 24


def _run(backend, seqs, caches, hq, hkv, d, dtype, window=None, softcap=None):
    """Each sequence ``(context length, query length, block ids, q, k, v)`` (``q`` its query rows,
    ``k``/``v`` every position's) through ``backend``: the cache holds each one's earlier K/V, the
    step writes the new. Returns each sequence's output rows ``[ql, Hq * D]``."""
    key_cache, value_cache = (c.clone() for c in caches)
    for ctx, ql, blocks, _, k, v in seqs:
        for p in range(ctx - ql):
            slot = blocks[p // BLOCK] * BLOCK + p % BLOCK
            key_cache[slot], value_cache[slot] = k[p].to(key_cache.dtype), v[p].to(value_cache.dtype)
    decodes = [i for i, s in enumerate(seqs) if s[1] == 1 and s[0] > 1]
    chunks = [i for i in range(len(seqs)) if i not in decodes]
    meta = backend.build_metadata([seqs[i][0] for i in decodes], [seqs[i][2] for i in decodes],
                                  [(seqs[i][0] - seqs[i][1], seqs[i][1], seqs[i][2]) for i in chunks], BLOCK,
                                  torch.device("cpu"))
    order = [decodes[j] for j in meta.decode_order] + chunks
    qs, ks, vs, slots = [], [], [], []
    for i in order:
        ctx, ql, blocks, q, k, v = seqs[i]
        qs.append(q)
        ks.append(k[ctx - ql:])
        vs.append(v[ctx - ql:])
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx - ql, ctx)]
    meta.slot_mapping = torch.tensor(slots)
    out = backend.forward(torch.cat(qs).to(dtype), torch.cat(ks).to(dtype), torch.cat(vs).to(dtype),
                          key_cache.view(-1, hkv, d), value_cache.view(-1, hkv, d), meta, d ** -0.5, window, softcap)
    rows, r = {}, 0
    for i in order:
        rows[i] = out[r:r + seqs[i][1]].float()
        r += seqs[i][1]
    return [rows[i] for i in range(len(seqs))]


def _sequences(shapes, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    seqs, used = [], 0
    for ctx, ql in shapes:
        n = -(-ctx // BLOCK)
        blocks, used = perm[used:used + n], used + n
        seqs.append((ctx, ql, blocks, torch.randn(ql, hq, d, generator=g), torch.randn(ctx, hkv, d, generator=g),
                     torch.randn(ctx, hkv, d, generator=g)))
    return seqs


# (context length, query length): decodes (one at a block edge), a fresh chunk, a chunk after a
# prefix that ends mid-block, a one-token prompt.
SHAPES = [(37, 1), (16, 1), (70, 1), (21, 21), (53, 19), (1, 1)]


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (8, 2, 64), (6, 2, 80)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kernel_equals_the_reference(hq, hkv, d, cache_dtype):
    seqs = _sequences(SHAPES, hq, hkv, d, seed=hq * d)
    caches = [torch.zeros(NUM_BLOCKS * BLOCK, hkv, d, dtype=cache_dtype) for _ in range(2)]
    ref = _run(TorchPagedAttention(), seqs, caches, hq, hkv, d, torch.float32)
    got = _run(CudaPagedAttention.for_cache(caches[0], torch.float32), seqs, caches, hq, hkv, d, torch.float32)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"sequence {SHAPES[i]}: {m}")


@pytest.mark.parametrize("window,softcap", [(24, None), (None, 2.0), (9, 3.0)])
def test_windows_and_softcaps_equal_the_reference(window, softcap):
    hq, hkv, d = 8, 2, 32
    seqs = _sequences(SHAPES, hq, hkv, d, seed=7)
    caches = [torch.zeros(NUM_BLOCKS * BLOCK, hkv, d) for _ in range(2)]
    ref = _run(TorchPagedAttention(), seqs, caches, hq, hkv, d, torch.float32, window, softcap)
    got = _run(CudaPagedAttention(), seqs, caches, hq, hkv, d, torch.float32, window, softcap)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, i=i: f"sequence {SHAPES[i]}: {m}")


def test_16_bit_queries_stay_close_and_an_int8_cache_is_refused():
    """Float16 queries over a bfloat16 cache. (Bfloat16 queries run on the GPU only: Triton 3.9's
    interpreter multiplies bfloat16 tiles wrongly, ``tl.dot`` of two random 16x16 tiles off by 1e10.)"""
    hq, hkv, d = 8, 2, 64
    seqs = _sequences(SHAPES, hq, hkv, d, seed=3)
    caches = [torch.zeros(NUM_BLOCKS * BLOCK, hkv, d, dtype=torch.bfloat16) for _ in range(2)]
    ref = _run(TorchPagedAttention(), seqs, caches, hq, hkv, d, torch.float32)
    got = _run(CudaPagedAttention(), seqs, caches, hq, hkv, d, torch.float16)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="int8 is not supported on CUDA"):
        CudaPagedAttention.for_cache(torch.zeros(4, 1, 8, dtype=torch.int8), torch.float32)
