"""Decode attention over a multi-GiB paged KV cache: the compiled kernel against the pure PyTorch path.

``--batch`` decodes with contexts drawn from ``--context``, their blocks scattered at random over a
``--cache-gib`` cache of ``--layers`` layers (SmolLM2-135M's shapes by default), so K/V come from
memory as in a real decode step, not from cache. One "step" runs the attention of every layer
(``torch_paged.forward``, K/V write included). Prints the best of ``--repeats`` for each path, the
K/V bytes read per second, and the ratio, measured in the same run.

    python benchmarks/decode_attention.py
    python benchmarks/decode_attention.py --batch 8 --context 1000 2000
    python benchmarks/decode_attention.py --context 450 700 --shared-prefix 384
    python benchmarks/decode_attention.py --cache-dtype float16 --hot    # compute bound: K/V from cache

``--hot`` gives every decode the same blocks (one cache-resident context), so the kernel's
arithmetic alone is timed; the gap to the default (blocks scattered over the whole cache) is
what memory costs.
"""

from __future__ import annotations

import argparse
import random

from workload import add_shape_args, attention_step, interleaved_best, print_step_times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, nargs=2, default=[300, 600], metavar=("MIN", "MAX"))
    ap.add_argument("--cache-gib", type=float, default=2.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cache-dtype", choices=("float32", "float16", "int8"), default="float32",
                    help="int8: a scale per token and KV head after its values (attention/kv_quant.py)")
    ap.add_argument("--hot", action="store_true", help="every decode reads the same blocks (from cache)")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="tokens every context starts with, in blocks all decodes share (a prefix-cache hit)")
    add_shape_args(ap)
    args = ap.parse_args()

    import torch

    from pagellm.attention import cpu_kernel
    from pagellm.attention.cpu_paged import CpuPagedAttention
    from pagellm.attention.kv_quant import cache_head_dim, to_cache
    from pagellm.attention.torch_paged import TorchPagedAttention

    if not cpu_kernel.available():
        raise SystemExit("the decode kernel cannot run here (no compiler, or PAGELLM_CPU_KERNELS=0)")
    random.seed(0)
    torch.manual_seed(0)
    hq, hkv = args.heads
    d, bs, n_layers = args.head_dim, args.block_size, args.layers
    dtype = getattr(torch, args.cache_dtype)
    row_bytes = hkv * cache_head_dim(d, dtype) * dtype.itemsize
    num_blocks = int(args.cache_gib * 2**30 / (n_layers * 2 * bs * row_bytes))
    kv = torch.empty(n_layers, 2, num_blocks * bs, hkv, cache_head_dim(d, dtype), dtype=dtype)
    for layer in range(n_layers):  # every page touched before timing (a layer at a time: int8's float temporaries)
        kv[layer] = to_cache(torch.randn(2, num_blocks * bs, hkv, d), dtype)
    lens = [random.randint(*args.context) for _ in range(args.batch)]
    shared = min(args.shared_prefix, *lens) // bs
    need = shared + sum(-(-n // bs) - shared for n in lens)
    if need > num_blocks:
        raise SystemExit(f"the cache holds {num_blocks} blocks; these contexts need {need}: raise --cache-gib")
    free = random.sample(range(num_blocks), num_blocks)
    prefix = [free.pop() for _ in range(shared)]
    tables = [prefix + [free.pop() for _ in range(-(-n // bs) - shared)] for n in lens]
    if args.hot:
        tables = [list(range(-(-n // bs))) for n in lens]
    q = torch.randn(args.batch, hq, d)
    k, v = torch.randn(args.batch, hkv, d), torch.randn(args.batch, hkv, d)
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)])

    def step_fn(kernel: bool):
        backend = CpuPagedAttention(decode_kernel=True, prefill_kernel=False, write_kv_kernel=False) if kernel \
            else TorchPagedAttention()
        meta = backend.build_metadata(lens, tables, [], bs, torch.device("cpu"))
        meta.slot_mapping = slots
        qo, ko, vo = (x[meta.decode_order] for x in (q, k, v))
        return attention_step(qo, ko, vo, kv, meta, d ** -0.5)

    steps = {"pure PyTorch (gather + SDPA)": step_fn(False), "decode kernel": step_fn(True)}
    with torch.inference_mode():
        best = interleaved_best(steps, args.repeats)
    read = sum(lens) * row_bytes * 2 * n_layers  # as if every decode read its own copy of the prefix
    print(f"{args.batch} decodes, contexts {args.context[0]}-{args.context[1]}, {shared * bs} tokens shared "
          f"(K/V {read / 2**20:.0f} MiB per step), "
          f"{num_blocks} blocks of {bs} over {args.cache_gib:g} GiB, {torch.get_num_threads()} threads")
    print_step_times(best, "pure PyTorch (gather + SDPA)", n_layers, read, "GB/s")


if __name__ == "__main__":
    main()
