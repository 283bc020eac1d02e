#!/usr/bin/env bash
# One script for a lent GPU, in about 8 minutes (BUDGET_S, default 480 s, the preflight included): kernel and graph
# correctness, resources, one layer's attention graph-replayed, end to end on an 8B shape and on SmolLM2's, eager and
# with decode steps replayed from CUDA graphs, a profile.
# Usage, from the repository root: bash bench/gpu_check.sh [OUT_DIR]; on a lent machine, as bench/gpu.md says
# (make gpu-prepare prints the whole command), with no OUT_DIR: the rows go to /tmp/gpu_check (GPU_CHECK_DIR) and are
# packed after every step into $OUT/gpu_check.tar.gz, one file (the machine hands back at most 8).
# Steps run in the order of what issue 44's targets need most, each under its own limit and within what is left of
# the budget; one that would start with under MIN_STEP_S (20 s) left is skipped, so a slow step costs the last ones,
# never the call. Every benchmark writes its rows as it goes: a step cut short keeps what it measured. STEPS="a b"
# runs only those steps (after the preflight), to redo what a first run missed. steps.tsv says what each step did,
# and the same table ends the output. Random weights only (built on the meta device): nothing is downloaded.
set -uo pipefail
pack=""
if [ $# -ge 1 ]; then
  out="$1"
elif [ -n "${OUT:-}" ]; then
  out="${GPU_CHECK_DIR:-/tmp/gpu_check}" pack="$OUT/gpu_check.tar.gz"
  rm -rf "$out"
else
  out=bench/results/gpu_check
fi
py="${PYTHON:-$(command -v python3 || command -v python)}"
budget="${BUDGET_S:-480}" least="${MIN_STEP_S:-20}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
printf 'step\tstatus\tseconds\tlimit\n' > "$out/steps.tsv"

pack_rows() {
  if [ -n "$pack" ]; then tar -czf "$pack.part" -C "$out" . && mv "$pack.part" "$pack"; fi
}

# step NAME CAP COMMAND...: run COMMAND under min(CAP, budget left), its output in NAME.log, a row in steps.tsv
step() {
  local name="$1" cap="$2" left limit started rc status
  shift 2
  if [ -n "${STEPS:-}" ] && [ "$name" != preflight ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  left=$((budget - SECONDS))
  if [ "$left" -lt "$least" ]; then
    echo "== $name skipped: ${left}s of the budget left"
    printf '%s\tskipped (budget)\t0\t%s\n' "$name" "$cap" >> "$out/steps.tsv"
    return 0
  fi
  limit=$((cap < left ? cap : left))
  echo "== $name (at most ${limit}s)"
  started=$SECONDS
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  case "$rc" in
    0) status=ok ;;
    124 | 137) status="timed out" ;;
    *) status="failed (exit $rc)" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - started))" "$limit" >> "$out/steps.tsv"
  pack_rows
  return "$rc"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"; } > "$out/env.log" 2>&1
# 0. versions, the declared package ranges, a tiny decode on CUDA: a host that cannot run the steps stops here
if ! step preflight "${PREFLIGHT_S:-45}" "$py" -m bench.gpu_preflight; then
  echo "preflight failed: no step run (see preflight.log)"
  column -t -s $'\t' "$out/steps.tsv" 2>/dev/null || cat "$out/steps.tsv"
  exit 2
fi
# 1. end to end on an 8B shape (random bf16 weights), decode steps replayed from CUDA graphs: FullKV preallocated,
# QEvict on the fused kernel and on the PyTorch path (what kernels="auto" takes on CUDA), SnapKV in fixed buffers
step graphs_8k "${GRAPHS_S:-110}" "$py" -m bench.speed --device cuda --model random:llama-8b --graphs \
  --methods fullkv_static,qevict@triton,qevict@torch,snapkv --baseline fullkv_static --budget 0.2 --contexts 8192 \
  --batch 8 --new-tokens 48 --repeats 2 --out "$out/graphs"
# 2. correctness on CUDA: the compiled kernels (fast trigonometry included) and the real graphs. The tests launch
# ~55 kernel specializations, each a JIT compile on first use (CPU-bound): 8 workers compile side by side
workers=""
if "$py" -c "import xdist" > /dev/null 2>&1; then workers="-n 8"; fi
step tests "${TESTS_S:-90}" "$py" -m pytest -q $workers tests/test_kernels.py tests/test_fp_kernel.py \
  tests/test_window_quant.py tests/test_graphs.py -p no:cacheprovider
# 3. one layer's attention graph-replayed, beside a device-to-device copy (the bandwidth ceiling): fused kernel, the
# old kernel, dequantise + SDPA, SDPA over bf16 tokens
step kernels "${KERNELS_S:-60}" "$py" -m bench.kernels attention --device cuda --keys 8192,32768 --batch 1,8 \
  --bits 4 --repeats 20 --out "$out/kernels"
step graphs_8k_b1 "${GRAPHS_B1_S:-45}" "$py" -m bench.speed --device cuda --model random:llama-8b --graphs \
  --methods fullkv_static,qevict@triton --baseline fullkv_static --budget 0.2 --contexts 8192 --batch 1 \
  --new-tokens 48 --repeats 2 --out "$out/graphs"
# 4. long contexts, the prompt read in chunks on both sides: time at 32K, peak memory at 16K
step speed_32k "${SPEED_32K_S:-80}" "$py" -m bench.speed --device cuda --model random:llama-8b \
  --methods fullkv_static,qevict@triton --baseline fullkv_static --budget 0.2 --contexts 32768 --batch 8 \
  --new-tokens 32 --repeats 1 --prefill-chunk 4096 --out "$out/speed_32k"
step peak_16k "${PEAK_S:-60}" "$py" -m bench.speed --device cuda --model random:llama-8b \
  --methods fullkv_static,qevict@triton --baseline fullkv_static --budget 0.2 --contexts 16384 --batch 8 \
  --new-tokens 16 --repeats 1 --prefill-chunk 2048 --out "$out/peak"
# 5. the studio's model shape (SmolLM2) graphed, steps interleaved (bench.tpot), the eviction baselines in their GPU
# layouts beside QEvict
step smollm2_graphs "${SMOL_GRAPHS_S:-60}" "$py" -m bench.tpot --device cuda --model random:smollm2 --graphs \
  --methods fullkv_static,qevict@triton,qevict@torch,snapkv,h2o,layer_defensivekv --baseline fullkv_static \
  --budget 0.2 --contexts 2048,4096 --new-tokens 64 --rounds 3 --out "$out/smollm2_graphs"
# 6. the same eager, what a caller without graphs gets
step speed_8k "${SPEED_S:-90}" "$py" -m bench.speed --device cuda --model random:llama-8b \
  --methods fullkv_static,qevict@triton,qevict@torch,snapkv --baseline fullkv_static --budget 0.2 \
  --contexts 8192 --batch 8 --new-tokens 48 --repeats 2 --out "$out/speed"
step smollm2 "${SMOL_S:-50}" "$py" -m bench.speed --device cuda --model random:smollm2 \
  --methods fullkv_static,qevict@triton,qevict@torch --baseline fullkv_static --budget 0.2 --contexts 2048,4096 \
  --batch 1 --new-tokens 64 --repeats 2 --out "$out/smollm2"
# 7. what this GPU's Triton builds, and where a decode step of the fused path spends its time
step resources "${RESOURCES_S:-40}" "$py" -m bench.kernels resources --device cuda --out "$out/resources"
step profile "${PROFILE_S:-40}" "$py" -m bench.profile_decode --device cuda --model random:llama-8b \
  --method qevict@triton --context 8192 --batch 8 --steps 16 --out "$out/profile"
pack_rows  # steps.tsv with the steps the budget skipped
echo "rows under $out${pack:+, packed into $pack}"
column -t -s $'\t' "$out/steps.tsv" 2>/dev/null || cat "$out/steps.tsv"
