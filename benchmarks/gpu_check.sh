#!/usr/bin/env bash
# On the GPU machine (the device tool: run with carry [".gpu"] after benchmarks/gpu_prepare.sh here):
# installs the carried wheels, runs the GPU test subset (tests/gpu, then the Triton kernel's tests
# compiled), then W64 and single-request decode against HF generate on the same GPU. One log on
# stdout, inside 8 minutes. Example: timeout_s 500, command "bash benchmarks/gpu_check.sh".
# --quick leaves out the 1.7B shape (a first run, leaving device time for a second).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD  # (pagellm from the checkout: nothing to build for a GPU)
LOGS=${GPU_CHECK_LOGS:-/tmp/gpu_check}  # (the tests' whole output; stdout has its end)
mkdir -p "$LOGS"
export PAGELLM_TEST_TOKENIZER=$PWD/.gpu/tokenizer  # (the tests' tiny checkpoints take it: no bundled model there)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
$PY -m pip install -q --no-index --find-links .gpu/wheels gguf fastapi uvicorn httptools pyzmq llguidance peft accelerate psutil 2>&1 | tail -3
echo "== GPU tests"
timeout 240 $PY -m pytest tests/gpu -q -rA -p no:cacheprovider --durations=5 2>&1 | tee "$LOGS/gpu_tests.log" | tail -40  # (every failure, not the first)
echo "== W64 and one request: pagellm vs HF generate, bfloat16, same GPU"
timeout 200 $PY benchmarks/gpu_bench.py --workload .gpu/workload_n64_seed0.json --tokenizer .gpu/tokenizer 2>&1 \
    | grep -v Warning | tail -8
if [ "${1:-}" != --quick ] && [ "$SECONDS" -lt 330 ]; then  # (time left in the 8 minutes: the 1.7B shape too)
    echo "== the same at SmolLM2-1.7B's shape (random weights)"
    timeout $((470 - SECONDS)) $PY benchmarks/gpu_bench.py --workload .gpu/workload_n64_seed0.json \
        --tokenizer .gpu/tokenizer --shape 1.7b 2>&1 | grep -v Warning | tail -8
fi
echo "== done in ${SECONDS} s"
