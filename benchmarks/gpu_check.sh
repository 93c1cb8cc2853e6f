#!/usr/bin/env bash
# On the GPU machine (the device tool: run with carry [".gpu"] after benchmarks/gpu_prepare.sh here):
# installs the carried wheels, runs the GPU test subset (tests/gpu: the Triton kernels compiled,
# split-K and the fused ops included; float32 equal to HF), then benchmarks/gpu_bench.py: the copy
# bandwidth, and per shape (135M, 1.7B, 8B; random weights, no files) one request's decode and its
# roofline share, TTFT of 2,048 tokens, W64 against HF generate, a profiled decode step; then the
# baseline commit's W64 at 1.7B on the same GPU (.gpu/baseline) where time is left. One log on stdout,
# inside 9 minutes. Example: timeout_s 560, command "bash benchmarks/gpu_check.sh".
# --quick: the tests and the 135M shape only (a first run, leaving device time for a second).
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
timeout 220 $PY -m pytest tests/gpu -q -rA -p no:cacheprovider --durations=5 2>&1 | tee "$LOGS/gpu_tests.log" | tail -40  # (every failure, not the first)
BENCH="$PY benchmarks/gpu_bench.py --workload .gpu/workload_n64_seed0.json --tokenizer .gpu/tokenizer"
echo "== 135M shape: pagellm (graphs and eager) vs HF generate, bfloat16, same GPU"
timeout 120 $BENCH --shapes 135m --eager 2>&1 | grep -v Warning | tail -6
echo "== the same with the Triton ops off (PAGELLM_TRITON_OPS=0: torch's elementwise ops), pagellm only"
PAGELLM_TRITON_OPS=0 timeout 60 $BENCH --shapes 135m --no-hf 2>&1 | grep -v Warning | tail -3
if [ "${1:-}" != --quick ] && [ "$SECONDS" -lt 300 ]; then
    echo "== 1.7B and 8B shapes"
    timeout $((480 - SECONDS)) $BENCH --shapes 1.7b 8b 2>&1 | grep -v Warning | tail -8
fi
if [ -d .gpu/baseline ] && [ "$SECONDS" -lt 430 ]; then  # (another GPU kind: the acceptance's ratio needs it)
    echo "== baseline commit $(cat .gpu/baseline/COMMIT 2>/dev/null): W64 at 1.7B, pagellm only"
    (cd .gpu/baseline && PYTHONPATH=$PWD timeout $((530 - SECONDS)) $PY -c "
import sys, time; sys.path.insert(0, 'benchmarks')
from gpu_bench import random_checkpoint, pagellm_w64
from workload import load_workload
print(pagellm_w64(random_checkpoint('1.7b', '../tokenizer'), load_workload('../workload_n64_seed0.json', None)))
" 2>&1 | grep -v Warning | tail -3)
fi
echo "== done in ${SECONDS} s"
