"""Where a W64 run spends its time: scheduling, input preparation, model ops, attention, sampling.

Wraps the engine's functions with exclusive timers (a nested call's time is not counted twice):

    scheduling          Scheduler.schedule + update_from_output
    input preparation   ModelRunner.execute_model's own Python (flat batch, slot_mapping) + build_metadata
    linear (GEMM)       every nn.Linear in the layers, but the experts'; an MLP fused on AMX whole
    mixture of experts  the MoE layers whole: routing, grouping, the experts' and shared expert's GEMMs
    attention           the paged attention backend (K/V write, decode kernel / SDPA)
    other model ops     embedding, RMSNorm, rotary, SiLU*mul, residual adds (model time minus the above)
    lm head             compute_logits at the sampled rows
    sampling            the sampler (greedy / top-k / top-p, logprobs)
    output processing   the rest of LLMEngine.step: detokenization, stop checks, RequestOutputs
    decode graph        a decode step's layers in one C call (worker/decode_graph.py), where the
                        engine takes it: its GEMMs, attention and small ops are then not split;
                        ``--no-decode-graph`` runs decode steps layer by layer to split them

Each step is classed prefill-heavy (more prefill tokens than decodes) or decode-heavy. With
``--torch-profiler N`` it also prints torch.profiler's op table over N steps of each kind.

The timers cost time of their own, and on a batch-1 step, whose code comes back from memory after
the model's pass, about 10-20 us a timed call: the split above over-states the host's share.
``--host-only`` times three calls only (the model's forward, the LM head, the sampler) and prints
the host's time as each step's wall time less theirs: the figure to compare across commits.

    python benchmarks/time_breakdown.py                      # W64
    python benchmarks/time_breakdown.py --num-requests 16 --torch-profiler 3
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections import defaultdict

from workload import add_workload_args, load_workload

CATEGORIES = ("scheduling", "input preparation", "linear (GEMM)", "mixture of experts", "attention", "other model ops",
              "decode graph", "lm head", "sampling", "output processing")
HOST = ("scheduling", "input preparation", "output processing")


class ExclusiveTimers:
    """Per-category time, each call's nested timed calls subtracted (a stack of open timers)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [category, start, child time]

    def wrap(self, fn, category: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._stack.append([category, time.perf_counter(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                cat, start, child = self._stack.pop()
                dt = time.perf_counter() - start
                self.totals[cat] += dt - child
                if self._stack:
                    self._stack[-1][2] += dt
        return timed

    def take(self) -> dict[str, float]:
        out, self.totals = dict(self.totals), defaultdict(float)
        return out


class GemmStats:
    """Each projection call's time, rows and FLOPs (2 x rows x in x out) by step kind and weight
    format (``gemm_label``); the LM head as its own row. Decode steps through the decode graph run
    their GEMMs inside one C call, so only ``--no-decode-graph`` splits theirs."""

    def __init__(self, kind_of_step) -> None:
        self.kind_of_step = kind_of_step  # () -> this step's kind
        self.rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0])  # s, flops, calls, rows

    def wrap(self, fn, label: str, in_features: int, out_features: int):
        @functools.wraps(fn)
        def timed(x, *args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(x, *args, **kwargs)
            finally:
                row = self.rows[(self.kind_of_step(), label)]
                n = x.numel() // x.shape[-1]
                row[0] += time.perf_counter() - t
                row[1] += 2.0 * n * in_features * out_features
                row[2] += 1
                row[3] += n
        return timed

    def print(self) -> None:
        print("GEMMs by step kind and weight format (rows: mean rows per call):")
        print(f"  {'kind':14s} {'format':34s} {'calls':>7s} {'rows':>6s} {'seconds':>8s} {'GFLOP':>8s} {'GFLOP/s':>8s}")
        for (kind, label), (sec, flops, calls, rows) in sorted(self.rows.items()):
            print(f"  {kind:14s} {label:34s} {calls:7d} {rows / max(calls, 1):6.0f} {sec:8.2f} {flops / 1e9:8.1f} "
                  f"{flops / 1e9 / max(sec, 1e-9):8.1f}")


def gemm_label(linear) -> str:
    """The projection's weight format and the kernel path it takes here."""
    from pagellm.kernels import gemm_int8
    from pagellm.quantization.weight_formats import Int8Packed

    fmt = linear.weight_format
    if fmt is None:
        return f"torch F.linear ({str(linear.weight.dtype).removeprefix('torch.')})"
    if isinstance(fmt, Int8Packed):
        amx = " / AMX from 32 rows" if gemm_int8.amx() else ""
        return f"int8 {gemm_int8.format_name(fmt.fmt)} ({gemm_int8.isa()}{amx})"
    return f"{fmt.name} packed"


def instrument(engine, timers: ExclusiveTimers, gemms: GemmStats | None = None) -> None:
    import torch

    sched = engine.scheduler
    sched.schedule = timers.wrap(sched.schedule, "scheduling")
    sched.update_from_output = timers.wrap(sched.update_from_output, "scheduling")
    runner = engine.executor.worker.model_runner
    runner.execute_model = timers.wrap(runner.execute_model, "input preparation")
    backend = runner.attn_backend  # its methods, wrapped on this instance
    backend.build_metadata = timers.wrap(backend.build_metadata, "input preparation")
    backend.forward = timers.wrap(backend.forward, "attention")
    model = runner.model
    model.forward = timers.wrap(model.forward, "other model ops")
    model.compute_logits = timers.wrap(model.compute_logits, "lm head")
    runner.sampler.forward = timers.wrap(runner.sampler.forward, "sampling")
    from pagellm.kernels.decode_graph import DecodeGraph
    DecodeGraph.run = timers.wrap(DecodeGraph.run, "decode graph")  # (slotted: wrapped on the class)
    from pagellm.layers.moe import SparseMoeBlock
    moe = [m for m in model.model.layers.modules() if isinstance(m, SparseMoeBlock)]
    in_moe = {id(p) for block in moe for p in block.modules()}
    for block in moe:  # routing, grouping, every expert's and the shared expert's GEMMs
        for m in block.modules():
            if m is block or isinstance(m, torch.nn.Linear):
                m.forward = timers.wrap(m.forward, "mixture of experts")
    for m in model.model.layers.modules():  # not the LM head's, which counts as "lm head"
        if isinstance(m, torch.nn.Linear) and id(m) not in in_moe:
            fwd = m.forward if gemms is None else gemms.wrap(m.forward, gemm_label(m), m.in_features, m.out_features)
            m.forward = timers.wrap(fwd, "linear (GEMM)")
    if gemms is not None:
        text = engine.executor.worker.text_config
        model.compute_logits = timers.wrap(gemms.wrap(model.compute_logits.__wrapped__, "LM head",
                                                      text.hidden_size, text.vocab_size), "lm head")
    from pagellm.kernels import gemm
    gemm.mlp_silu_amx = timers.wrap(gemm.mlp_silu_amx, "linear (GEMM)")  # (an MLP's two GEMMs and SiLU in one call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="gguf: int8 GEMMs over the GGUF blocks")
    ap.add_argument("--kv-cache-dtype", default="auto", help="K/V cache element type (auto: chosen per machine)")
    ap.add_argument("--torch-profiler", type=int, default=0, metavar="N",
                    help="also print torch.profiler's op table over N steps of each kind")
    ap.add_argument("--no-prefix-caching", action="store_true", help="run with enable_prefix_caching=False")
    ap.add_argument("--gemms", action="store_true",
                    help="also each projection's time and GFLOP/s by step kind and weight format")
    ap.add_argument("--host-only", action="store_true",
                    help="time only the model, LM head and sampler; host = step wall time less theirs")
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="multi-step decoding: passes per decode-only schedule (host per step is then per pass)")
    ap.add_argument("--no-decode-graph", action="store_true",
                    help="decode steps layer by layer (PAGELLM_DECODE_GRAPH=0), so their ops are split too")
    args = ap.parse_args()
    if args.no_decode_graph:
        os.environ["PAGELLM_DECODE_GRAPH"] = "0"

    import torch

    from pagellm import LLMEngine, SamplingParams
    from pagellm.config import EngineArgs

    multi_step = {"num_scheduler_steps": args.num_scheduler_steps} if args.num_scheduler_steps != 1 else {}
    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                                   kv_cache_dtype=args.kv_cache_dtype,
                                                   enable_prefix_caching=not args.no_prefix_caching, **multi_step))
    reqs = load_workload(args.workload, args.num_requests)
    for i, r in enumerate(reqs):
        engine.add_request(str(i), {"prompt_token_ids": r["prompt_token_ids"]},
                           SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True))
    timers = ExclusiveTimers()
    kind_of_last = {"kind": "prefill-heavy"}
    gemms = GemmStats(lambda: kind_of_last["kind"]) if args.gemms else None
    passes: dict[str, int] = defaultdict(int)  # forward passes by step kind (a multi-step step runs several)
    if args.host_only:
        runner = engine.executor.worker.model_runner
        for obj, name in ((runner.model, "forward"), (runner.model, "compute_logits"), (runner.sampler, "forward")):
            setattr(obj, name, timers.wrap(getattr(obj, name), "model"))
        forward = runner.model.forward

        def counted(*a, **kw):
            passes[kind_of_last["kind"]] += 1
            return forward(*a, **kw)

        runner.model.forward = counted
    else:
        instrument(engine, timers, gemms)
        engine.step = timers.wrap(engine.step, "output processing")
    kinds = {"prefill-heavy": defaultdict(float), "decode-heavy": defaultdict(float)}
    counts: dict[str, int] = defaultdict(int)
    tokens: dict[str, int] = defaultdict(int)
    profiled: dict[str, int] = defaultdict(int)
    schedule = engine.scheduler.schedule

    def classify(*a, **kw):
        so = schedule(*a, **kw)
        decodes = sum(s.is_decode for s in so.scheduled)
        n = sum(s.num_scheduled_tokens for s in so.scheduled)
        kind_of_last["kind"] = "prefill-heavy" if n - decodes > decodes else "decode-heavy"
        tokens[kind_of_last["kind"]] += n
        return so

    engine.scheduler.schedule = classify
    t0 = time.perf_counter()
    wall_by_kind: dict[str, float] = defaultdict(float)
    while engine.has_unfinished_requests():
        ts = time.perf_counter()
        prof = None
        if any(profiled[k] < args.torch_profiler for k in kinds):  # stop once every kind has its table
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof.__enter__()
        engine.step()
        kind = kind_of_last["kind"]
        if prof is not None:
            prof.__exit__(None, None, None)
            if profiled[kind] < args.torch_profiler:
                profiled[kind] += 1
                if profiled[kind] == args.torch_profiler:
                    print(f"\ntorch.profiler, one {kind} step:")
                    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        wall_by_kind[kind] += time.perf_counter() - ts
        counts[kind] += 1
        for cat, dt in timers.take().items():
            kinds[kind][cat] += dt
    wall = time.perf_counter() - t0
    n_tok = sum(r["prompt_len"] + r["max_tokens"] for r in reqs)
    if args.host_only:
        print(f"\n{len(reqs)} requests, {n_tok} tokens, wall {wall:.1f} s, {n_tok / wall:.1f} total tok/s")
        print("host per step, ms (step wall time less the model, LM head and sampler; a step is a forward pass):")
        for k in kinds:
            n = max(passes[k], 1)
            print(f"  {k:14s} {1e3 * (wall_by_kind[k] - kinds[k]['model']) / n:6.3f}  "
                  f"(of {1e3 * wall_by_kind[k] / n:.3f}, {passes[k]} passes in {counts[k]} schedules)")
        return
    print(f"\n{len(reqs)} requests, {n_tok} tokens, wall {wall:.1f} s, {n_tok / wall:.1f} total tok/s"
          + (" (torch.profiler on: slower)" if args.torch_profiler else ""))
    print(f"{'':20s}" + "".join(f"{k:>24s}" for k in kinds) + f"{'all':>16s}")
    print(f"{'steps':20s}" + "".join(f"{counts[k]:>24d}" for k in kinds) + f"{sum(counts.values()):>16d}")
    print(f"{'tokens':20s}" + "".join(f"{tokens[k]:>24d}" for k in kinds) + f"{sum(tokens.values()):>16d}")
    for cat in CATEGORIES:
        row = f"{cat:20s}"
        for k in kinds:
            row += f"{kinds[k][cat]:>14.2f} s {100 * kinds[k][cat] / max(wall_by_kind[k], 1e-9):5.1f} %"
        total = sum(kinds[k][cat] for k in kinds)
        print(row + f"{total:>9.2f} s {100 * total / wall:4.1f} %")
    print(f"{'wall':20s}" + "".join(f"{wall_by_kind[k]:>14.2f} s {'':7s}" for k in kinds) + f"{wall:>9.2f} s")
    # The engine's own Python around the model: what a persistent input batch and cheaper outputs cut.
    print("host per step, ms (schedule + prepare + output):")
    for k in kinds:
        parts = [1e3 * kinds[k][c] / max(counts[k], 1) for c in HOST]
        print(f"  {k:14s} {sum(parts):6.3f}  ({' + '.join(f'{x:.3f}' for x in parts)})")
    if gemms is not None:
        gemms.print()


if __name__ == "__main__":
    main()
