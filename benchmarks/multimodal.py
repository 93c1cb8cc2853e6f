"""Images per second with the encoder cache on and off: W64's prompts, each carrying one of 8 images.

Builds once (cached under ``~/.cache/pagellm/multimodal``) a random-weight bfloat16 Qwen2-VL
checkpoint: Qwen2-VL-2B's vision tower (32 layers, 1280 wide, 16 heads, 2x2 merge) and, so that a
2-core run takes minutes, a text decoder of SmolLM2-360M's shape with M-RoPE; the bundled SmolLM2
tokenizer plus Qwen2-VL's vision tokens; an image processor that makes every 224x224 image 64 rows.
Each request is a W64 prompt followed by its image (so no two requests share a prefix: the prefix
cache cannot stand in for the encoder cache), greedy, ``ignore_eos``, W64's output lengths.

Both runs in fresh processes, in one invocation: the encoder cache on (the default: an image seen
before is neither processed nor encoded again) and off (``mm_processor_cache_gb=0``: every request
processes and encodes its own image). Prints images/s of each, their ratio, and each run's step
breakdown (schedule, model, of which the vision encoder, output).

    python benchmarks/multimodal.py                     # W64
    python benchmarks/multimodal.py --num-requests 16   # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from workload import add_workload_args, load_workload

ROOT = os.path.expanduser("~/.cache/pagellm/multimodal")
VISION = dict(depth=32, embed_dim=1280, hidden_size=960, num_heads=16, mlp_ratio=4, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
TEXT = dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
            num_key_value_heads=5, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_scaling={"type": "mrope", "mrope_section": [16, 8, 8]})
SIDE = 224
SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build() -> str:
    import torch
    import transformers
    from safetensors.torch import save_file

    from pagellm.config import resolve_model_source

    path = os.path.join(ROOT, "qwen2-vl-2b-vision-360m-text")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    bundled = resolve_model_source(None).path
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(bundled), gguf_file=os.path.basename(bundled))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    config = transformers.Qwen2VLConfig(
        text_config=dict(model_type="qwen2_vl_text", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, **TEXT), vision_config=VISION,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    config.dtype = "bfloat16"
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in transformers.Qwen2VLForConditionalGeneration(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.ones(s, dtype=torch.bfloat16) if len(s) == 1 and "norm" in n else
               (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()
               if n != "lm_head.weight"}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    tok.save_pretrained(path)
    transformers.Qwen2VLImageProcessor(min_pixels=SIDE * SIDE, max_pixels=SIDE * SIDE).save_pretrained(path)
    return path


def images(n: int) -> list:
    import numpy as np
    from PIL import Image

    rs = np.random.RandomState(0)
    return [Image.fromarray((rs.rand(SIDE, SIDE, 3) * 255).astype("uint8")) for _ in range(n)]


def child(args: argparse.Namespace) -> None:
    from pagellm import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=4096, mm_processor_cache_gb=4.0 if args.cache == "on" else 0)
    tok = llm.get_tokenizer()
    tail = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    pics = images(8)
    reqs = load_workload(args.workload, args.num_requests)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"] + tail, "multi_modal_data": {"image": pics[i % 8]}}
               for i, r in enumerate(reqs)]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    warm = images(9)[8:]  # an image no request carries: the warm-up leaves nothing in any cache
    llm.generate([{"prompt_token_ids": [1, 2] + tail, "multi_modal_data": {"image": warm[0]}}],
                 SamplingParams(max_tokens=2), use_tqdm=False)
    stats = llm.llm_engine.iteration_stats
    before = (stats.schedule_seconds, stats.model_seconds, stats.encoder_seconds, stats.output_seconds)
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    after = (stats.schedule_seconds, stats.model_seconds, stats.encoder_seconds, stats.output_seconds)
    sched = llm.llm_engine.scheduler.make_stats()
    print(json.dumps({"images_s": len(reqs) / wall, "wall": wall, "numerics": llm.llm_engine.model_info.dtype,
                      "breakdown": [a - b for a, b in zip(after, before, strict=True)],
                      "encoded": sched.encoder_cache_misses, "hits": sched.encoder_cache_hits}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", choices=["on", "off"], default="on", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    path = build()
    out = {}
    for cache in ("off", "on"):
        cmd = [sys.executable, __file__, "--child", "--model", path, "--workload", args.workload, "--cache", cache]
        if args.num_requests:
            cmd += ["--num-requests", str(args.num_requests)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = out[cache] = json.loads(res.stdout.strip().splitlines()[-1])
        sched, model, enc, output = r["breakdown"]
        print(f"encoder cache {cache:3s}: {r['images_s']:.2f} images/s ({r['wall']:.1f} s; {r['encoded']} images "
              f"encoded, {r['hits']} found cached; {r['numerics']})", flush=True)
        print(f"    step breakdown: schedule {sched:.1f} s, model {model:.1f} s (vision encoder {enc:.1f} s), "
              f"output {output:.1f} s", flush=True)
    print(f"encoder cache on / off: {out['on']['images_s'] / out['off']['images_s']:.2f}x images/s")


if __name__ == "__main__":
    main()
