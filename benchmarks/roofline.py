"""Achieved model FLOP/s against this machine's GEMM peak, for prefill-heavy and decode-heavy steps.

1. GEMM peak: ``torch.nn.functional.linear`` at the model's weight shapes (fused qkv, o, gate_up,
   down, lm_head) for a decode-sized M (64) and a prefill-sized M (2048), float32 and bfloat16,
   and pagellm's packed-weight float32 kernel (``kernels/gemm.c``); the peak is the best of them.
2. A workload run (default: the first 32 requests of W64) with every ``execute_model`` timed; each
   step's model FLOPs are counted from its ``SchedulerOutput``: ``2 x tokens x weights`` for the
   layers, ``2 x sampled rows x vocab x hidden`` for the LM head, and ``4 x heads x head_dim x``
   (query x key pairs) for attention. Steps where prefill tokens outnumber decodes are
   "prefill-heavy", the rest "decode-heavy".

    python benchmarks/roofline.py
    python benchmarks/roofline.py --num-requests 64 --dtype float32
"""

from __future__ import annotations

import argparse
import os
import time

from workload import add_workload_args, load_workload


def gemm_peak(shapes: dict[str, tuple[int, int]], m: int, dtype, packed: bool = False, repeats: int = 5) -> float:
    """Best GFLOP/s of one pass over every weight shape at batch ``m`` (``packed``: the kernel)."""
    import torch

    from pagellm.kernels import gemm

    ws = {k: torch.randn(n_out, n_in, dtype=dtype) for k, (n_out, n_in) in shapes.items()}
    xs = {k: torch.randn(m, n_in, dtype=dtype) for k, (_, n_in) in shapes.items()}
    ps = {k: gemm.pack(w) for k, w in ws.items()} if packed else {}
    flops = sum(2 * m * n_out * n_in for n_out, n_in in shapes.values())
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for k, (n_out, _) in shapes.items():
                if packed:
                    gemm.linear(xs[k], ps[k], n_out)
                else:
                    torch.nn.functional.linear(xs[k], ws[k])
            best = min(best, time.perf_counter() - t)
    return flops / best / 1e9


def model_shapes(model) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """The model's weight shapes ``{name: (out, in)}`` (fused qkv, o, gate_up, down, lm_head) and
    the sizes the FLOP and byte counts need."""
    cfg = model.config
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    shapes = {name: (layer.out_features, layer.in_features) for name, layer in
              (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj))}
    shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
    dims = {
        "layers": cfg.num_hidden_layers,
        "layer_weights": sum(a * b for k, (a, b) in shapes.items() if k != "lm_head"),
        "lm_head": cfg.vocab_size * cfg.hidden_size,
        "q_heads": attn.num_heads,
        "head_dim": attn.head_dim,
        # K and V of every layer, float32
        "kv_bytes_per_token": 2 * attn.num_kv_heads * attn.head_dim * 4 * cfg.num_hidden_layers,
    }
    return shapes, dims


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, num_requests=32)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    import torch

    from pagellm import LLMEngine, SamplingParams
    from pagellm.config import EngineArgs
    from pagellm.kernels import gemm

    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, dtype=args.dtype))
    model = engine.executor.worker.model
    cfg = model.config
    shapes, dims = model_shapes(model)
    print("GEMM peak at the model's shapes (GFLOP/s, one pass over qkv, o, gate_up, down, lm_head):")
    peaks: dict = {}
    kernel = gemm.usable(torch.zeros(1, 1))
    for dtype, packed in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
        if packed and not kernel:
            continue
        for m in (64, 2048):
            rate = gemm_peak(shapes, m, dtype, packed)
            peaks[(dtype, m)] = max(rate, peaks.get((dtype, m), 0.0))
            name = f"{str(dtype).removeprefix('torch.')}{' packed' if packed else ''}"
            print(f"  {name:16s} M={m:5d}: {rate:7.1f}")

    layer_weights = dims["layer_weights"]
    n_layers, hd, nh = dims["layers"], dims["head_dim"], dims["q_heads"]
    stats = {"prefill-heavy": [0.0, 0.0, 0], "decode-heavy": [0.0, 0.0, 0]}  # seconds, flops, steps
    # Timed at the worker: the engine starts steps with ``submit_model``, and the in-process
    # executor calls the worker's ``execute_model`` for each.
    worker = engine.executor.worker
    execute = worker.execute_model

    def timed(so):
        t = time.perf_counter()
        out = execute(so)
        dt = time.perf_counter() - t
        tokens = sum(s.num_scheduled_tokens for s in so.scheduled)
        sampled = sum(len(s.sample_seq_ids or [s.seq_id]) for s in so.scheduled if s.do_sample)
        pairs = sum(s.num_scheduled_tokens * s.num_computed_tokens
                    + s.num_scheduled_tokens * (s.num_scheduled_tokens + 1) // 2 for s in so.scheduled)
        flops = 2 * tokens * layer_weights * n_layers + 2 * sampled * cfg.vocab_size * cfg.hidden_size \
            + 4 * nh * hd * pairs * n_layers
        decodes = sum(s.is_decode for s in so.scheduled)
        kind = "prefill-heavy" if tokens - decodes > decodes else "decode-heavy"
        row = stats[kind]
        row[0] += dt
        row[1] += flops
        row[2] += 1
        return out

    worker.execute_model = timed  # type: ignore[method-assign]
    reqs = load_workload(args.workload, args.num_requests)
    for i, r in enumerate(reqs):
        engine.add_request(str(i), {"prompt_token_ids": r["prompt_token_ids"]},
                           SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - t0
    dtype = engine.executor.worker.dtype
    print(f"\n{len(reqs)} requests of {os.path.basename(args.workload)}, {str(dtype).removeprefix('torch.')}, "
          f"wall {wall:.1f} s")
    print(f"{'steps':14s} {'count':>6s} {'time s':>8s} {'GFLOP/s':>9s} {'peak GFLOP/s':>13s} {'of peak':>8s}")
    for kind, (secs, flops, n) in stats.items():
        if not n:
            continue
        peak = peaks[(dtype, 2048 if kind == "prefill-heavy" else 64)]
        rate = flops / secs / 1e9
        print(f"{kind:14s} {n:6d} {secs:8.1f} {rate:9.1f} {peak:13.1f} {rate / peak:8.1%}")


if __name__ == "__main__":
    main()
