"""On a GPU, one invocation (``gpu_check.sh``): the copy bandwidth measured on that GPU, then per model
shape pagellm (bfloat16, the CUDA backend, random weights: ``load_format="dummy"``) against HF
``generate`` (bfloat16, random weights, static batches of 32):

- one request's decode tok/s, with CUDA graphs (and eager, ``--eager``), and its share of the
  bandwidth roofline: the weights a token reads (every parameter but the input embedding's rows;
  a tied head reads the embedding once) over the measured bandwidth, against the measured time;
- TTFT of a 2,048-token prompt;
- W64 total tok/s (prompt + output, every request greedy with ``ignore_eos`` to its ``max_tokens``),
  and HF's in batches of 32, left-padded, each batch run to its longest request's ``max_tokens``;
- a ``torch.profiler`` summary of one steady decode step: GPU kernels, GPU busy time, and the
  host's gap (the step's wall time the GPU is idle).

    python benchmarks/gpu_bench.py --workload .gpu/workload_n64_seed0.json --tokenizer .gpu/tokenizer \\
        --shapes 135m 1.7b 8b
    python benchmarks/gpu_bench.py --device cpu --shapes tiny --num-requests 4   # the script's plumbing

Shapes are directories of a ``config.json`` and the tokenizer under ``~/.cache/pagellm/gpu`` (no
weights: speed does not depend on their values). Each result is a JSON line; a table ends the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

from workload import add_workload_args, load_workload

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    "1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=32, vocab_size=49152, tie_word_embeddings=True, rope_theta=130000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0),
}


def shape_dir(shape: str, tokenizer: str) -> str:
    """A Llama config in ``shape``'s dimensions with the tokenizer beside it (no weights)."""
    import transformers

    path = os.path.expanduser(f"~/.cache/pagellm/gpu/shape-{shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        transformers.AutoTokenizer.from_pretrained(tokenizer).save_pretrained(path)
        config = transformers.LlamaConfig(max_position_embeddings=8192, rms_norm_eps=1e-5, **SHAPES[shape])
        config.architectures = ["LlamaForCausalLM"]
        config.save_pretrained(path)  # (last: it marks the directory done)
    return path


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of ``repeats``."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def weight_bytes_per_token(path: str) -> int:
    """What one decode token reads of the weights in bfloat16: every parameter, but the input
    embedding's (a few rows) where the head has its own matrix."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())  # (a tied matrix is one parameter: counted once)
    if not config.tie_word_embeddings:
        n -= model.get_input_embeddings().weight.numel()
    return 2 * n


def single_decode(llm, prompt: dict, n: int = 256) -> float:
    """One request's decode speed: tokens after the first per second (the prefill excluded)."""
    from pagellm import SamplingParams

    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    first = ttft(llm, prompt)
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return (n - 1) / (time.perf_counter() - t - first)


def ttft(llm, prompt: dict) -> float:
    """Seconds to the first token of ``prompt`` (prefix caching off: every token computed)."""
    from pagellm import SamplingParams

    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t


def profile_decode_step(llm, prompt: dict, device: str) -> dict:
    """One steady decode step under ``torch.profiler``: its GPU kernels, their busy time (the union
    of their intervals), and the host gap (the step's wall time with the GPU idle)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pagellm import SamplingParams

    engine = llm.llm_engine
    engine.add_request("profiled", prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(8):  # (past the prefill, into steady decode)
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        _sync(device)
        t = time.perf_counter()
        engine.step()
        _sync(device)
        wall_us = 1e6 * (time.perf_counter() - t)
    engine.abort_request("profiled")
    while engine.has_unfinished_requests():
        engine.step()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # the union of the kernels' intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    return {"kernels": len(spans), "gpu_busy_us": round(busy, 1), "step_us": round(wall_us, 1),
            "host_gap_us": round(wall_us - busy, 1)}


def pagellm_run(path: str, reqs: list[dict], device: str, eager: bool) -> dict:
    import torch

    from pagellm import LLM, SamplingParams

    dtype = "bfloat16" if device == "cuda" else "float32"
    llm = LLM(model=path, device=device, dtype=dtype, load_format="dummy", enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up (Triton compiles its kernels)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    long_prompt = {"prompt_token_ids": torch.randint(100, 40000, (2048,), generator=torch.Generator().manual_seed(0))
                   .tolist()}
    ttft(llm, long_prompt)  # (warm-up: a 2,048-row chunk's kernels)
    result = {"w64_tok_s": sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs) / wall,
              "single_tok_s": single_decode(llm, prompts[0]), "ttft_2048_ms": 1e3 * ttft(llm, long_prompt),
              "backend": llm.llm_engine.executor.worker.model_runner.attn_backend.name}
    try:
        result["decode_step_profile"] = profile_decode_step(llm, prompts[0], device)
    except Exception as e:  # (a profiler that fails here must not lose the run's other figures)
        result["decode_step_profile"] = f"failed: {e!r}"
    del llm
    _release(device)
    if eager:
        llm = LLM(model=path, device=device, dtype=dtype, load_format="dummy", enforce_eager=True)
        result["single_eager_tok_s"] = single_decode(llm, prompts[0])
        del llm
        _release(device)
    return result


def _release(device: str) -> None:
    import torch

    gc.collect()  # (an engine's KV cache goes before the next one's is sized)
    if device == "cuda":
        torch.cuda.empty_cache()


def hf_run(path: str, reqs: list[dict], device: str, batch: int = 32) -> dict:
    import torch
    import transformers

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    total, start = 0, time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i:i + batch]
        width = max(len(r["prompt_token_ids"]) for r in group)
        pad = [width - len(r["prompt_token_ids"]) for r in group]
        ids = torch.tensor([[0] * p + r["prompt_token_ids"] for p, r in zip(pad, group, strict=True)], device=device)
        mask = torch.tensor([[0] * p + [1] * (width - p) for p in pad], device=device)
        longest = max(r["max_tokens"] for r in group)
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest, min_new_tokens=longest,
                        pad_token_id=0)
        total += sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in group)
    result = {"w64_tok_s": total / (time.perf_counter() - start)}
    del hf
    _release(device)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--tokenizer", default=".gpu/tokenizer", help="the shapes' tokenizer")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["135m"])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check the script's plumbing on a tiny shape")
    ap.add_argument("--eager", action="store_true", help="also one request without CUDA graphs (enforce_eager)")
    ap.add_argument("--no-hf", action="store_true", help="pagellm only")
    args = ap.parse_args()
    reqs = load_workload(args.workload, args.num_requests)
    bw = copy_bandwidth(args.device, nbytes=(1 << 30) if args.device == "cuda" else (1 << 28))
    print(json.dumps({"copy_bandwidth_GB_s": round(bw / 1e9, 1)}), flush=True)
    rows = []
    for shape in args.shapes:
        path = shape_dir(shape, args.tokenizer)
        ours = pagellm_run(path, reqs, args.device, args.eager)
        wbytes = weight_bytes_per_token(path)
        ours["weight_GB_per_token"] = round(wbytes / 1e9, 3)
        ours["roofline_pct"] = round(100 * wbytes * ours["single_tok_s"] / bw, 1)
        print(json.dumps({"shape": shape, "pagellm": ours}), flush=True)
        theirs = None if args.no_hf else hf_run(path, reqs, args.device)
        if theirs is not None:
            print(json.dumps({"shape": shape, "hf": theirs}), flush=True)
        rows.append((shape, ours, theirs))
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s; W64 = {len(reqs)} requests")
    print(f"{'shape':6s} {'1 req tok/s':>11s} {'roofline':>8s} {'TTFT 2048':>10s} {'W64 tok/s':>10s} {'HF W64':>8s} "
          f"{'x HF':>6s}  decode step")
    for shape, ours, theirs in rows:
        hf = theirs["w64_tok_s"] if theirs else float("nan")
        print(f"{shape:6s} {ours['single_tok_s']:11.0f} {ours['roofline_pct']:7.1f}% {ours['ttft_2048_ms']:8.1f}ms "
              f"{ours['w64_tok_s']:10.0f} {hf:8.0f} {ours['w64_tok_s'] / hf:6.2f}  {ours['decode_step_profile']}")


if __name__ == "__main__":
    main()
