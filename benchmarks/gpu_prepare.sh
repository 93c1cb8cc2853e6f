#!/usr/bin/env bash
# Here, before a GPU run: what the GPU machine lacks, into .gpu/ (git-ignored), which the device
# tool's run carries (carry: [".gpu"]). Its image has Python 3.12, torch, Triton and transformers
# but not pagellm's server and GGUF dependencies, the bundled model's tokenizer, or the W64 workload; nothing
# can be fetched there. Then run benchmarks/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .gpu/wheels
cp ../shared/bench/workload_n64_seed0.json .gpu/
# Wheels for the GPU machine's Python (3.12, x86-64 Linux), with their dependencies.
$PY -m pip download -q -d .gpu/wheels --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    gguf fastapi uvicorn httptools pyzmq llguidance
# peft for the LoRA test, without its torch requirement (the GPU machine has its own CUDA torch).
$PY -m pip download -q -d .gpu/wheels --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --no-deps peft accelerate psutil
# The bundled model's file is over the carry limit: its tokenizer goes, and the GPU builds random
# weights in its shape (speed does not depend on weight values).
$PY -c "from pagellm.config import resolve_model_source; from pagellm.tokenizer import Tokenizer; \
Tokenizer(resolve_model_source(None)).hf.save_pretrained('.gpu/tokenizer')"
du -sh .gpu
