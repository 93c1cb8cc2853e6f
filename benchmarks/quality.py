"""The quality gate of every non-float32 mode, measured: perplexity of a fixed text and greedy
divergence from float32 on the parity prompts.

For each ``--dtype``: the perplexity of ``benchmarks/data/quality_text.txt`` (teacher-forced: one
prefill of the whole text through the engine's own model, attention backend and GEMM numerics, the
log-probability of every next token), its ratio to float32's, and on the HF-parity prompts how many
greedy continuations diverge from float32's (pagellm float32 equals HF float32 token for token) and
whether, where they diverge, each side's token is in the other's top 5 (vLLM's
``check_logprobs_close``).

    python benchmarks/quality.py                       # float32 vs bfloat16 and int8 (where this machine has them)
    python benchmarks/quality.py --dtype float32 auto auto+gguf   # DTYPE+gguf: quantization="gguf" (int8 GEMMs)
    python benchmarks/quality.py --dtype float32 auto+gguf auto+gguf@float32   # @KV: kv_cache_dtype
"""

from __future__ import annotations

import argparse
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "data", "quality_text.txt")
TOP = 5


def perplexity(engine, token_ids: list[int]) -> float:
    """exp(mean NLL of token i+1 given tokens 0..i), one forward of the whole text in the engine's
    worker (in-process executor), with its model, attention backend and numerics."""
    import torch

    worker = engine.executor.worker
    runner, cache = worker.model_runner, worker.cache_engine
    bs = runner.block_size
    n = len(token_ids)
    blocks = list(range(-(-n // bs)))
    if len(blocks) > engine.kv_cache_manager.num_blocks:
        raise SystemExit("the text needs more KV blocks than the engine has")
    meta = runner.attn_backend.build_metadata([], [], [(0, n, blocks)], bs, runner.device)
    meta.slot_mapping = torch.arange(n, dtype=torch.long)  # blocks 0.. in order: slot = position
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(token_ids), torch.arange(n), cache.kv_caches, meta)
        logits = runner.model.compute_logits(hidden[:-1]).float()
        nll = -torch.log_softmax(logits, -1).gather(1, torch.tensor(token_ids[1:])[:, None]).squeeze(1)
    return math.exp(nll.double().mean().item())


def greedy_top(engine, prompts: list[list[int]], new_tokens: int):
    from pagellm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=TOP)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [(done[str(i)].token_ids, [set(sorted(lp, key=lambda t: lp[t].rank)[:TOP]) for lp in done[str(i)].logprobs])
            for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", nargs="+", default=None,
                    help="modes to measure, DTYPE or DTYPE+gguf (default: float32, bfloat16, auto+gguf)")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from pagellm import LLMEngine
    from pagellm.config import EngineArgs
    from pagellm.kernels import gemm, gemm_int8
    from pagellm.kernels.machine import cpu_info

    from test_hf_parity import SMOL_PROMPTS

    modes = args.dtype or (["float32"] + (["bfloat16"] if gemm.bf16_supported() else [])
                           + (["auto+gguf"] if gemm_int8.supported() else []))
    print(f"machine: {cpu_info().summary()}")
    rows, ref = [], None
    for mode in modes:
        spec, _, kv = mode.partition("@")
        dtype, _, quantization = spec.partition("+")
        engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, dtype=dtype, quantization=quantization or None,
                                                       kv_cache_dtype=kv or "auto", kv_cache_memory="256MiB"))
        tok = engine.get_tokenizer()
        with open(TEXT) as f:
            ids = tok.encode(f.read())
        ppl = perplexity(engine, ids)  # first: the fresh engine's blocks hold nothing cached yet
        outs = greedy_top(engine, [tok.encode(p) for p in SMOL_PROMPTS], args.new_tokens)
        engine.shutdown()
        if ref is None:
            ref = (ppl, outs)
        diverged, close = 0, True
        for (ta, topa), (tb, topb) in zip(outs, ref[1], strict=True):
            for pos, (x, y) in enumerate(zip(ta, tb, strict=True)):
                if x != y:
                    diverged += 1
                    close &= x in topb[pos] and y in topa[pos]
                    break
        info = engine.model_info
        rows.append((f"{mode} ({info.dtype}, {info.kv_cache_dtype} KV)", ppl, ppl / ref[0], diverged, close))
    print(f"\n{len(ids)} text tokens, {len(SMOL_PROMPTS)} prompts x {args.new_tokens} greedy tokens")
    print(f"{'mode (numerics, KV)':44s} {'perplexity':>10s} {'vs first':>9s} {'diverged':>9s} {'top-5 close':>11s}")
    for name, ppl, ratio, diverged, close in rows:
        print(f"{name:44s} {ppl:10.4f} {ratio:9.4f} {diverged:>5d}/{len(SMOL_PROMPTS):<3d} {str(close):>11s}")


if __name__ == "__main__":
    main()
