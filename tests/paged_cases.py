"""Paged-attention cases shared by the Triton kernel's tests (interpreter on a CPU, compiled on a
GPU): sequences with random K/V in random blocks, run through any backend's metadata and forward."""

from __future__ import annotations

import torch

BLOCK = 16
NUM_BLOCKS = 24


def run_backend(backend, seqs, caches, hq, hkv, d, dtype, window=None, softcap=None, device="cpu"):
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
                                  torch.device(device))
    order = [decodes[j] for j in meta.decode_order] + chunks
    qs, ks, vs, slots = [], [], [], []
    for i in order:
        ctx, ql, blocks, q, k, v = seqs[i]
        qs.append(q)
        ks.append(k[ctx - ql:])
        vs.append(v[ctx - ql:])
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx - ql, ctx)]
    meta.slot_mapping = torch.tensor(slots, device=device)
    key_cache, value_cache = key_cache.to(device), value_cache.to(device)
    out = backend.forward(torch.cat(qs).to(device, dtype), torch.cat(ks).to(device, dtype),
                          torch.cat(vs).to(device, dtype), key_cache.view(-1, hkv, d), value_cache.view(-1, hkv, d),
                          meta, d ** -0.5, window, softcap)
    rows, r = {}, 0
    for i in order:
        rows[i] = out[r:r + seqs[i][1]].float().cpu()
        r += seqs[i][1]
    return [rows[i] for i in range(len(seqs))]


def sequences(shapes, hq, hkv, d, seed):
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
