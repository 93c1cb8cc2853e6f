"""A random-weight GGUF in a real model's shape, made as llama.cpp makes one from a checkpoint: HF's own
class writes the checkpoint (bfloat16), llama.cpp's ``convert_hf_to_gguf.py`` converts it to F16 and its
``llama-quantize`` to the type asked. Speed does not depend on the weights' values, so this is the file
the side-by-side benchmarks read (``llama_cpp_side_by_side.py``); llama.cpp is built outside this tree,
never a dependency.

    python benchmarks/make_random_gguf.py --shape qwen3.5-2b --llama-cpp ../peers/llama.cpp \
        --quantize ../peers/build-native/bin/llama-quantize --out ../peers/q35

The tokenizer is the bundled SmolLM2's (its vocabulary padded to the shape's), which llama.cpp's
converter knows as the ``smollm`` pre-tokenizer.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# Qwen/Qwen3.5-2B's text config: 18 gated-DeltaNet layers and 6 gated full-attention layers.
SHAPES = {
    "qwen3.5-2b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                       linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                       linear_value_head_dim=128, tie_word_embeddings=True, max_position_embeddings=262144),
}

CONVERT = r"""
import os, runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, os.path.join(root, "gguf-py")]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"  # (the padded vocabulary's hash is new)
sys.argv[0] = os.path.join(root, "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def write_checkpoint(fields: dict, path: str) -> None:
    """Random bfloat16 weights in HF's own class for ``fields`` (a config's, with its ``model_type``)
    and the bundled model's tokenizer beside them; its config.json, written last, marks it done."""
    import torch
    import transformers

    from pagellm.config import resolve_model_source
    from pagellm.tokenizer import Tokenizer

    fields = dict(fields)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    Tokenizer(resolve_model_source(None)).hf.save_pretrained(path)
    model.save_pretrained(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree (its convert_hf_to_gguf.py)")
    p.add_argument("--quantize", required=True, help="llama.cpp's llama-quantize binary")
    p.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    p.add_argument("--out", required=True, help="a folder: the checkpoint, the F16 file and the quantized one")
    args = p.parse_args()
    hf = os.path.join(args.out, args.shape)
    f16 = os.path.join(args.out, f"{args.shape}-f16.gguf")
    final = os.path.join(args.out, f"{args.shape}-{args.type.lower()}.gguf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        write_checkpoint(SHAPES[args.shape], hf)
    if not os.path.exists(f16):
        subprocess.run([sys.executable, "-c", CONVERT, os.path.abspath(args.llama_cpp), hf, "--no-mtp",
                        "--outtype", "f16", "--outfile", f16], check=True)
    subprocess.run([args.quantize, f16, final, args.type], check=True)
    print(final)


if __name__ == "__main__":
    main()
