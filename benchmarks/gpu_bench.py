"""On a GPU: pagellm (bfloat16, the CUDA backend) against HF ``generate`` (bfloat16, static batches of
32) on W64, and one request's decode speed, in one invocation on the same GPU (``gpu_check.sh``).

    python benchmarks/gpu_bench.py --workload .gpu/workload_n64_seed0.json --tokenizer .gpu/tokenizer
    python benchmarks/gpu_bench.py --model /path/to/checkpoint      # another model (HF directory)

Without ``--model``: random bfloat16 weights in SmolLM2-135M's shape (``--shape 1.7b``: SmolLM2-1.7B's)
with the given tokenizer, built once under ``~/.cache/pagellm/gpu`` (speed does not depend on weights).

W64: every request greedy with ``ignore_eos`` to its ``max_tokens``; total tokens (prompt + output)
per second. HF's batches are left-padded and each runs to its longest request's ``max_tokens``
(padding counts nothing). Single request: the first W64 prompt, 256 new tokens, tokens/s of decode
(the prefill's time taken out), with CUDA graphs and with ``enforce_eager=True``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from workload import add_workload_args, load_workload

HERE = os.path.dirname(os.path.abspath(__file__))


SHAPES = {"135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3),
          "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                       num_key_value_heads=32)}


def random_checkpoint(shape: str, tokenizer: str) -> str:
    import torch
    import transformers

    path = os.path.expanduser(f"~/.cache/pagellm/gpu/smollm2-{shape}-random")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    config = transformers.LlamaConfig(vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                                      tie_word_embeddings=True, rope_theta=100000.0, **SHAPES[shape])
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(tokenizer).save_pretrained(path)
    return path


def pagellm_w64(model: str | None, reqs: list[dict]) -> dict:
    import gc

    import torch

    from pagellm import LLM, SamplingParams

    llm = LLM(model=model, device="cuda", dtype="bfloat16")
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up (Triton compiles its kernel)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    backend = llm.llm_engine.executor.worker.model_runner.attn_backend.name
    result = {"w64_tok_s": sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs) / wall,
              "single_tok_s": single_decode(llm, prompts[0]), "backend": backend}
    del llm
    gc.collect()  # (the first engine's KV cache goes before the second's is allocated)
    torch.cuda.empty_cache()
    eager = LLM(model=model, device="cuda", dtype="bfloat16", enforce_eager=True)
    result["single_eager_tok_s"] = single_decode(eager, prompts[0])
    return result


def single_decode(llm, prompt: dict, n: int = 256) -> float:
    """One request's decode speed: tokens after the first per second (the prefill excluded)."""
    from pagellm import SamplingParams

    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return (n - 1) / (time.perf_counter() - t - first)


def hf_w64(model: str | None, reqs: list[dict], batch: int = 32) -> dict:
    import torch
    import transformers

    from pagellm.config import resolve_model_source

    src = resolve_model_source(model)
    kw = {"gguf_file": os.path.basename(src.path)} if src.is_gguf else {}
    path = os.path.dirname(src.path) if src.is_gguf else src.path
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw).cuda().eval()
    total, start = 0, time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i:i + batch]
        width = max(len(r["prompt_token_ids"]) for r in group)
        ids = torch.tensor([[0] * (width - len(r["prompt_token_ids"])) + r["prompt_token_ids"] for r in group],
                           device="cuda")
        mask = torch.tensor([[0] * (width - len(r["prompt_token_ids"])) + [1] * len(r["prompt_token_ids"])
                             for r in group], device="cuda")
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(r["max_tokens"] for r in group),
                        min_new_tokens=max(r["max_tokens"] for r in group), pad_token_id=0)
        total += sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in group)
    return {"w64_tok_s": total / (time.perf_counter() - start)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--tokenizer", default=".gpu/tokenizer", help="for the random checkpoint (without --model)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="135m")
    args = ap.parse_args()
    if args.model is None:
        args.model = random_checkpoint(args.shape, args.tokenizer)
    reqs = load_workload(args.workload, args.num_requests)
    ours = pagellm_w64(args.model, reqs)
    print(json.dumps({"pagellm": ours}), flush=True)
    theirs = hf_w64(args.model, reqs)
    print(json.dumps({"hf": theirs}), flush=True)
    print(f"W64: pagellm bf16 ({ours['backend']} backend) {ours['w64_tok_s']:.0f} tok/s, HF generate bf16 (batches "
          f"of 32) {theirs['w64_tok_s']:.0f} tok/s: {ours['w64_tok_s'] / theirs['w64_tok_s']:.2f}x")
    print(f"one request decodes at {ours['single_tok_s']:.0f} tok/s with CUDA graphs, "
          f"{ours['single_eager_tok_s']:.0f} tok/s eager (enforce_eager): "
          f"{ours['single_tok_s'] / ours['single_eager_tok_s']:.2f}x")


if __name__ == "__main__":
    main()
