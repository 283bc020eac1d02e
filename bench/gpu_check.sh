#!/usr/bin/env bash
# One short script for a lent GPU (see bench/README.md): kernel correctness, microbenchmarks, end-to-end speed.
# Usage (on the GPU machine, from the repository root): bash bench/gpu_check.sh [OUT_DIR]
set -uo pipefail
out="${1:-${OUT:-bench/results}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m pytest -q tests/test_kernels.py -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log"
python -m bench.kernels --device cuda --keys 4096,16384,65536,131072 --batch 1,8,32 --bits 2 --repeats 20 \
  --out "$out/kernels" 2>&1 | tee "$out/gpu-kernels.log"
python -m bench.speed --device cuda --model random:llama-8b --methods fullkv,qevict,snapkv --budget 0.2 \
  --contexts 8192,16384 --batch 8 --new-tokens 128 --repeats 3 --out "$out/speed" 2>&1 | tee "$out/gpu-speed.log"
