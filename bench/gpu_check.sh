#!/usr/bin/env bash
# One short script for a lent GPU (see bench/README.md): kernel correctness, microbenchmarks, end-to-end speed.
# Usage (on the GPU machine, from the repository root): bash bench/gpu_check.sh [OUT_DIR]
# Each step has its own time limit (GPU time is lent by the minute), so a slow step cannot starve the next; the
# speed benchmark writes its rows after each context, so a step cut short keeps what it measured.
set -uo pipefail
out="${1:-${OUT:-bench/results}}"
py="${PYTHON:-$(command -v python || command -v python3)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/gpu-tests.log"
"$py" -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$out/gpu-tests.log"
timeout "${TESTS_S:-150}" "$py" -m pytest -q tests/test_kernels.py -p no:cacheprovider 2>&1 \
  | tee -a "$out/gpu-tests.log"
timeout "${KERNELS_S:-150}" "$py" -m bench.kernels --device cuda --keys 4096,16384,65536,131072 --batch 1,8,32 \
  --bits 2 --repeats 20 --out "$out/kernels" 2>&1 | tee "$out/gpu-kernels.log"
timeout "${SPEED_S:-300}" "$py" -m bench.speed --device cuda --model random:llama-8b --methods fullkv,qevict,snapkv \
  --budget 0.2 --contexts 8192,16384 --batch 8 --new-tokens 64 --repeats 2 --out "$out/speed" 2>&1 \
  | tee "$out/gpu-speed.log"
