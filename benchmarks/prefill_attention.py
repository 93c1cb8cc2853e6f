"""Prefill attention of one step: the compiled prefill kernel against the pure PyTorch path (SDPA)
and against decoding each prompt token (the decode kernel, one member per token: the same bits;
what the backend runs where the prefill kernel does not exist, AVX2 machines among them).

A step of prefill chunks, each ``(cached tokens, new tokens)``, with blocks scattered at random
over the cache; one "step" runs the attention of every layer (``torch_paged.forward``, K/V write
included), as the model does. The default step is W64's first: seven fresh prompts filling the
2,048-token budget. ``--cached N`` starts every chunk after N cached tokens (prefix-cache hits,
chunked prefill). Prints the best of ``--repeats`` for each path, the attention's useful GFLOP/s
(causal: only the scores a token may see) and the ratio, measured in the same run.

    python benchmarks/prefill_attention.py
    python benchmarks/prefill_attention.py --chunks 12 --new 160 --cached 384   # prefix384 hits
"""

from __future__ import annotations

import argparse
import random

from workload import add_shape_args, attention_step, interleaved_best, print_step_times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=7)
    ap.add_argument("--new", type=int, default=292, help="new tokens per chunk")
    ap.add_argument("--cached", type=int, default=0, help="cached tokens before each chunk")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cache-dtype", choices=("float32", "float16", "int8"), default="float32")
    add_shape_args(ap)
    args = ap.parse_args()

    import torch

    from pagellm.attention.cpu_paged import CpuPagedAttention
    from pagellm.attention.kv_quant import cache_head_dim, to_cache
    from pagellm.attention.torch_paged import TorchPagedAttention

    dtype = getattr(torch, args.cache_dtype)
    own = CpuPagedAttention.for_cache(torch.empty(1, args.heads[1], cache_head_dim(args.head_dim, dtype), dtype=dtype),
                                      torch.float32)
    if not own.decode_kernel:
        raise SystemExit("the decode kernel cannot run here (no compiler, or PAGELLM_CPU_KERNELS=0)")
    random.seed(0)
    torch.manual_seed(0)
    hq, hkv = args.heads
    d, bs, n_layers = args.head_dim, args.block_size, args.layers
    per_seq = -(-(args.cached + args.new) // bs)
    num_blocks = per_seq * args.chunks * 2
    kv = to_cache(torch.randn(n_layers, 2, num_blocks * bs, hkv, d), dtype)
    free = random.sample(range(num_blocks), num_blocks)
    chunks = [(args.cached, args.new, [free.pop() for _ in range(per_seq)]) for _ in range(args.chunks)]
    t = args.chunks * args.new
    qkv = torch.randn(t, (hq + 2 * hkv) * d)  # q, k, v as strided views of one projection, as in the model
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
    slots = torch.tensor([ids[p // bs] * bs + p % bs for c, n, ids in chunks for p in range(c, c + n)])

    def step_fn(backend: TorchPagedAttention):
        meta = backend.build_metadata([], [], chunks, bs, torch.device("cpu"))
        meta.slot_mapping = slots
        return attention_step(q, k, v, kv, meta, d ** -0.5)

    steps = {"pure PyTorch (SDPA)": step_fn(TorchPagedAttention())}
    if own.prefill_kernel:
        steps["prefill kernel"] = step_fn(CpuPagedAttention(decode_kernel=True, prefill_kernel=True,
                                                            write_kv_kernel=False))
    # Without the prefill kernel the backend runs every chunk token as a decode of its own position.
    steps["decode kernel per token"] = step_fn(CpuPagedAttention(decode_kernel=True, prefill_kernel=False,
                                                                 write_kv_kernel=False))
    with torch.inference_mode():
        best = interleaved_best(steps, args.repeats)
    # q.k and p.v: 2 x 2 x D flops per (query head, visible key) pair.
    visible = args.chunks * sum(args.cached + i + 1 for i in range(args.new))
    flops = 4 * d * hq * visible * n_layers
    print(f"{args.chunks} chunks of {args.new} new tokens after {args.cached} cached, {hq}/{hkv} heads of {d}, "
          f"{n_layers} layers, {torch.get_num_threads()} threads")
    print_step_times(best, "pure PyTorch (SDPA)", n_layers, flops, "GFLOP/s")


if __name__ == "__main__":
    main()
