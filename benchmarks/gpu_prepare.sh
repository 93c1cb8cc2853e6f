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
# The commit before issue 64's kernels, to measure on the same GPU (its W64 at 1.7B is the baseline
# the acceptance's 2x is taken against on a GPU kind other than the H100 it was first measured on).
BASE=${GPU_BASELINE:-3ff0225}
rm -rf .gpu/baseline && mkdir -p .gpu/baseline
git archive "$BASE" pagellm benchmarks | tar -x -C .gpu/baseline && echo "$BASE" > .gpu/baseline/COMMIT
du -sh .gpu
