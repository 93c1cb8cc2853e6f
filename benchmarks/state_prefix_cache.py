"""Prefix caching of state layers' states: the second of two requests sharing a ``--prefix``-token
prefix (an agent's system prompt and history), time to its first token with prefix caching on and
off, for a hybrid model (Qwen3.5's layout: gated DeltaNet and gated attention, 3:1) and a dense one
(Qwen3's) of about the same size, all in one invocation; and what share of a prefill and of a
decode step the DeltaNet's per-token kernels take.

    python benchmarks/state_prefix_cache.py                  # 4,096-token prefix, 0.6-0.8B shapes
    python benchmarks/state_prefix_cache.py --prefix 1024 --layers 8

The checkpoints are random weights in real shapes (speed does not depend on their values), written
once with transformers' own classes in bfloat16 and cached under ~/.cache/pagellm/bench/. Each run
is a fresh process; compare ratios within this invocation (the machine line is printed first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
CACHE = os.path.expanduser("~/.cache/pagellm/bench")

from make_random_gguf import write_checkpoint  # noqa: E402

# Qwen3.5 0.8B's layout (hidden 1024, DeltaNet heads 16 of 128, attention 8 heads of 256 over 2 KV
# heads, a quarter of each rotated), and Qwen3-0.6B's dense shape beside it.
SHAPES = {
    "hybrid": dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_size=1024,
                   intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                   linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                   linear_value_head_dim=128, linear_conv_kernel_dim=4),
    "dense": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=1024, intermediate_size=3072,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128),
}


def build(kind: str, layers: int) -> str:
    path = os.path.join(CACHE, f"{kind}-{layers}l")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    # (the bundled model's tokenizer: the prompts are token ids below its vocabulary)
    cfg = dict(SHAPES[kind], vocab_size=151936, num_hidden_layers=layers, max_position_embeddings=32768,
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    if kind == "hybrid":
        cfg["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    write_checkpoint(cfg, path)
    return path


def child(path: str, prefix: int, suffix: int, caching: bool) -> dict:
    import numpy as np

    from pagellm import EngineArgs, LLMEngine, SamplingParams
    from pagellm.kernels import linear_attention as la

    spent = {"kernels": 0.0}
    for name in ("causal_conv", "gated_delta_rule"):
        fn = getattr(la, name)

        def timed(*a, _fn=fn, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent["kernels"] += time.perf_counter() - t
        setattr(la, name, timed)
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, enable_prefix_caching=caching,
                                                   max_model_len=prefix + suffix + 64, kv_cache_memory="2GiB"))
    rng = np.random.default_rng(0)
    shared = rng.integers(100, 40000, prefix).tolist()
    out = {"block_size": engine.block_size}
    for i in range(2):
        ids = shared + rng.integers(100, 40000, suffix).tolist()
        spent["kernels"] = 0.0
        engine.add_request(str(i), {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=17,
                                                                              ignore_eos=True))
        t0, first, steps = time.perf_counter(), None, []
        while engine.has_unfinished_requests():
            s0, k0 = time.perf_counter(), spent["kernels"]
            outs = engine.step()
            steps.append((time.perf_counter() - s0, spent["kernels"] - k0))
            if first is None and outs and outs[0].outputs[0].token_ids:
                first = time.perf_counter() - t0
                prefill = (sum(s for s, _ in steps), sum(k for _, k in steps))
                steps = []
        decode = (sum(s for s, _ in steps[1:]), sum(k for _, k in steps[1:]))  # (the first decode step aside)
        out[f"ttft_{i}"] = first
        out[f"prefill_kernel_share_{i}"] = prefill[1] / prefill[0]
        out[f"decode_kernel_share_{i}"] = decode[1] / decode[0] if decode[0] else 0.0
        out[f"decode_tok_s_{i}"] = (len(steps) - 1) / decode[0] if decode[0] else 0.0
    out["hits"] = engine.scheduler.prefix_cache_stats.hits
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        path, caching = json.loads(args.child)
        print("RESULT " + json.dumps(child(path, args.prefix, args.suffix, caching)))
        return
    subprocess.run([sys.executable, os.path.join(HERE, "..", "..", "shared", "bench", "machine_probe.py")], check=False)
    print(f"two requests sharing a {args.prefix}-token prefix (+{args.suffix} tokens each), {args.layers} layers")
    print(f"{'model':8} {'caching':8} {'block':>6} {'TTFT 1st':>9} {'TTFT 2nd':>9} {'hits':>6} "
          f"{'kernels/prefill':>16} {'kernels/decode':>15}")
    results = {}
    for kind in ("hybrid", "dense"):
        path = build(kind, args.layers)
        for caching in (False, True):
            proc = subprocess.run([sys.executable, __file__, "--prefix", str(args.prefix), "--suffix", str(args.suffix),
                                   "--child", json.dumps([path, caching])], capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:])
                raise SystemExit(f"{kind} caching={caching} failed")
            r = results[(kind, caching)] = json.loads(line[7:])
            print(f"{kind:8} {'on' if caching else 'off':8} {r['block_size']:>6} {r['ttft_0']:>8.2f}s "
                  f"{r['ttft_1']:>8.2f}s {r['hits']:>6} {r['prefill_kernel_share_0']:>15.1%} "
                  f"{r['decode_kernel_share_1']:>14.1%}")
    for kind in ("hybrid", "dense"):
        off, on = results[(kind, False)], results[(kind, True)]
        print(f"{kind}: second request's TTFT, caching on / off = {on['ttft_1'] / off['ttft_1']:.3f} "
              f"({on['ttft_1']:.2f} s vs {off['ttft_1']:.2f} s)")


if __name__ == "__main__":
    main()
