"""A mixture-of-experts model against the dense model of its active shape, on W64, in one invocation.

Builds once (cached under ``~/.cache/pagellm/moe``) two random-weight bfloat16 checkpoints with the
bundled SmolLM2 tokenizer: a Qwen3-MoE shape (hidden 768, 12 layers, 64 experts of 256 features,
top 4: ~0.53B parameters, ~0.085B active per token) and a Qwen3 dense model with the same attention
and an MLP of the active experts' width (4 x 256 = 1024 features). Each runs the W64 workload in a
fresh process (greedy, ``ignore_eos``, default numerics); prints total tokens/s of each and their
ratio, then the MoE model's ``time_breakdown.py`` table (the "mixture of experts" row: routing,
grouping and every expert's GEMMs).

    python benchmarks/moe.py                       # W64
    python benchmarks/moe.py --num-requests 16     # a quicker look
    python benchmarks/moe.py --dtype float32       # both models in the same numerics
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from workload import add_workload_args, load_workload

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = dict(hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, experts=64, top_k=4, expert_inter=256,
             vocab=49152)


def build(kind: str) -> str:
    """The cached checkpoint directory of ``kind`` ("moe" or "dense")."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from pagellm.config import resolve_model_source

    s = SHAPE
    path = os.path.join(os.path.expanduser("~/.cache/pagellm/moe"), kind)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    common = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
                  max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6, torch_dtype="bfloat16")
    if kind == "moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=s["experts"], num_experts_per_tok=s["top_k"],
                                             moe_intermediate_size=s["expert_inter"], norm_topk_prob=True,
                                             decoder_sparse_step=1, mlp_only_layers=[],
                                             architectures=["Qwen3MoeForCausalLM"])
    else:
        config = transformers.Qwen3Config(**common, intermediate_size=s["top_k"] * s["expert_inter"],
                                          architectures=["Qwen3ForCausalLM"])
    bundled = resolve_model_source(None).path
    transformers.AutoTokenizer.from_pretrained(os.path.dirname(bundled), gguf_file=os.path.basename(bundled)) \
        .save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    h, d = s["hidden"], s["head_dim"]
    shapes = {"model.embed_tokens.weight": (s["vocab"], h), "model.norm.weight": (h,)}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "self_attn.q_proj.weight": (s["heads"] * d, h),
                   p + "self_attn.k_proj.weight": (s["kv_heads"] * d, h),
                   p + "self_attn.v_proj.weight": (s["kv_heads"] * d, h),
                   p + "self_attn.o_proj.weight": (h, s["heads"] * d)}
        if kind == "moe":
            shapes[p + "mlp.gate.weight"] = (s["experts"], h)
            for e in range(s["experts"]):
                q = f"{p}mlp.experts.{e}."
                shapes |= {q + "gate_proj.weight": (s["expert_inter"], h), q + "up_proj.weight": (s["expert_inter"], h),
                           q + "down_proj.weight": (h, s["expert_inter"])}
        else:
            inter = s["top_k"] * s["expert_inter"]
            shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)}
    tensors = {n: torch.ones(dims, dtype=torch.bfloat16) if len(dims) == 1 else
               (torch.randn(dims, generator=g) * 0.02).to(torch.bfloat16) for n, dims in shapes.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    return path


def child(args: argparse.Namespace) -> None:
    from pagellm import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=4096, dtype=args.dtype)
    reqs = load_workload(args.workload, args.num_requests)
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    total = sum(len(r["prompt_token_ids"]) + r["max_tokens"] for r in reqs)
    print(json.dumps({"total_tok_s": total / wall, "numerics": llm.llm_engine.model_info.dtype}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-breakdown", action="store_true", help="skip the MoE model's time breakdown")
    ap.add_argument("--dtype", default="auto",
                    help="numerics of both models (default: what the engine picks for each on this machine)")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    out = {}
    for kind in ("dense", "moe"):
        path = build(kind)
        cmd = [sys.executable, __file__, "--child", "--model", path, "--workload", args.workload, "--dtype", args.dtype]
        if args.num_requests:
            cmd += ["--num-requests", str(args.num_requests)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[kind] = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"{kind:5s} {path}: {out[kind]['total_tok_s']:.1f} tok/s total ({out[kind]['numerics']})", flush=True)
    print(f"MoE / dense of the same active shape: {out['moe']['total_tok_s'] / out['dense']['total_tok_s']:.2f}x")
    if not args.no_breakdown:
        cmd = [sys.executable, os.path.join(HERE, "time_breakdown.py"), "--model", build("moe"),
               "--workload", args.workload, "--dtype", args.dtype]
        if args.num_requests:
            cmd += ["--num-requests", str(args.num_requests)]
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
