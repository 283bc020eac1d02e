#!/usr/bin/env bash
# One short script for a lent GPU (at most 11.6 minutes: the sum of its steps' limits): kernel and graph
# correctness, resources, one layer's attention graph-replayed, end to end on an 8B shape and on SmolLM2's, eager
# and with plain decode steps replayed from CUDA graphs, a profile.
# Usage (on the GPU machine, from the repository root): bash bench/gpu_check.sh [OUT_DIR]
# Each step has its own time limit (GPU time is lent by the minute), so a slow step cannot starve the next; every
# benchmark writes its rows as it goes, so a step cut short keeps what it measured. Random weights only (built on
# the meta device): nothing is downloaded.
set -uo pipefail
out="${1:-${OUT:-bench/results/gpu_check}}"
py="${PYTHON:-$(command -v python || command -v python3)}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
step() { local name="$1" limit="$2"; shift 2; echo "== $name (at most ${limit}s)"; timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"; }
# 1. versions; the copy ceiling comes with step 3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/env.log"
"$py" -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$out/env.log"
# 2. correctness on CUDA (the compiled kernels, fast trigonometry included) and what the GPU's Triton builds
step tests "${TESTS_S:-60}" "$py" -m pytest -q tests/test_kernels.py tests/test_fp_kernel.py tests/test_window_quant.py \
  tests/test_graphs.py -p no:cacheprovider
step resources "${RESOURCES_S:-40}" "$py" -m bench.kernels resources --device cuda --out "$out/resources"
# 3. one layer's attention, graph-replayed: fused kernel, the old kernel, dequantise + SDPA, SDPA over bf16 tokens
step kernels "${KERNELS_S:-60}" "$py" -m bench.kernels attention --device cuda --keys 8192,32768 --batch 1,8 \
  --bits 4 --repeats 20 --out "$out/kernels"
# 4. end to end on an 8B shape: FullKV preallocated against QEvict (fused kernel, PyTorch path) and SnapKV, eager
step speed_8k "${SPEED_S:-90}" "$py" -m bench.speed --device cuda --model random:llama-8b \
  --methods fullkv_static,qevict@triton,qevict@torch,snapkv --baseline fullkv_static --budget 0.2 \
  --contexts 8192 --batch 8 --new-tokens 48 --repeats 2 --out "$out/speed"
# 4b. the same with decode steps replayed from CUDA graphs (FullKV static, QEvict's fused kernel and PyTorch path,
# SnapKV in fixed buffers)
step graphs_8k "${GRAPHS_S:-110}" "$py" -m bench.speed --device cuda --model random:llama-8b --graphs \
  --methods fullkv_static,qevict@triton,qevict@torch,snapkv --baseline fullkv_static --budget 0.2 --contexts 8192 \
  --batch 8 --new-tokens 48 --repeats 2 --out "$out/graphs"
step graphs_8k_b1 "${GRAPHS_S:-45}" "$py" -m bench.speed --device cuda --model random:llama-8b --graphs \
  --methods fullkv_static,qevict@triton --baseline fullkv_static --budget 0.2 --contexts 8192 --batch 1 \
  --new-tokens 48 --repeats 2 --out "$out/graphs"
step speed_32k "${SPEED_S:-80}" "$py" -m bench.speed --device cuda --model random:llama-8b \
  --methods fullkv_static,qevict@triton --baseline fullkv_static --budget 0.2 --contexts 32768 --batch 8 \
  --new-tokens 32 --repeats 1 --prefill-chunk 4096 --out "$out/speed_32k"
step peak_16k "${SPEED_S:-60}" "$py" -m bench.speed --device cuda --model random:llama-8b \
  --methods fullkv_static,qevict@triton --baseline fullkv_static --budget 0.2 --contexts 16384 --batch 8 \
  --new-tokens 16 --repeats 1 --prefill-chunk 2048 --out "$out/peak"
# 5. the studio's model shape (SmolLM2), eager, then graphed with steps interleaved (bench.tpot), the eviction
# baselines in their GPU layouts beside QEvict
step smollm2 "${SMOL_S:-50}" "$py" -m bench.speed --device cuda --model random:smollm2 \
  --methods fullkv_static,qevict@triton,qevict@torch --baseline fullkv_static --budget 0.2 --contexts 2048,4096 \
  --batch 1 --new-tokens 64 --repeats 2 --out "$out/smollm2"
step smollm2_graphs "${SMOL_GRAPHS_S:-60}" "$py" -m bench.tpot --device cuda --model random:smollm2 --graphs \
  --methods fullkv_static,qevict@triton,qevict@torch,snapkv,h2o,layer_defensivekv --baseline fullkv_static \
  --budget 0.2 --contexts 2048,4096 --new-tokens 64 --rounds 3 --out "$out/smollm2_graphs"
# 6. where a decode step of the fused path spends its time
step profile "${PROFILE_S:-40}" "$py" -m bench.profile_decode --device cuda --model random:llama-8b \
  --method qevict@triton --context 8192 --batch 8 --steps 16 --out "$out/profile"
echo "rows under $out"
