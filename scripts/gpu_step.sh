#!/usr/bin/env bash
# One GPU measurement of the training step (about 8 min on one H100), results in $OUT:
#   1. lm bench train: Mamba2-350M explicit and implicit (4+1), Llama-350M, DeltaProduct-392M n_h=2; compiled
#      blocks, micro-batch 16 x 2048, bf16, plain engine, per-kernel profile of 2 steps   -> bench_train.json
#   2. the implicit map's no-grad vs grad forward (and forward+backward) of Mamba2-350M, with the
#      per-kernel breakdown of each, and the (4+1) / explicit ratio that implies             -> forward_ratio.json
#   3. the floor: bf16 matmul rate (at each GEMM shape of the cases) and copy bandwidth, per layer FLOPs and
#      bytes of every stage, beside each case's measured per-kernel profile                   -> floor.json, floor.txt
# Run from the repository root: OUT=/tmp/step bash scripts/gpu_step.sh. Env: CASES, MICRO (16), STEPS (4),
# WARMUP (2), BUDGET_S (480: whole script; the training cases get all but the last 140 s).
# STEP_DRY=1: CPU smoke run (tiny models, interpreter, fp32, no compile).
set -u
T0=$(date +%s)
BUDGET=${BUDGET_S:-480}
OUT=${OUT:-/tmp/gpu_step_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PY=${PY:-python3}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
CASES=${CASES:-mamba2-explicit,mamba2-implicit-4+1,llama-explicit,deltaproduct-392m-nh2}
if [ "${STEP_DRY:-0}" = 1 ]; then
  export TRITON_INTERPRET=1
  COMMON=(--size tiny --seq-len 64 --precision fp32 --compile off --steps 1 --warmup 1)
  MICRO=${MICRO:-2}; CASES=mamba2-explicit,mamba2-implicit-4+1,llama-explicit
else
  COMMON=(--size 350m --seq-len 2048 --precision bf16 --compile on --steps "${STEPS:-4}" --warmup "${WARMUP:-2}")
  MICRO=${MICRO:-16}
fi
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 || true
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; git log --oneline -1; } \
  | tee "$OUT/env.txt"

echo "== 1. training step ($(( $(date +%s) - T0 )) s)"
timeout $(( $(left) - 140 )) $PY -m lm.benchmarks.train --cases "$CASES" "${COMMON[@]}" --micro "$MICRO" --engine auto \
  --profile 2 --timeout 170 --out "$OUT/bench_train.json" 2>&1 | tee "$OUT/bench_train.log" | grep -v "^    " | tail -30

echo "== 2. no-grad vs grad forward ($(( $(date +%s) - T0 )) s)"
timeout $(( $(left) - 60 )) $PY -m lm.benchmarks.train --forward-ratio --case mamba2-explicit "${COMMON[@]}" \
  --micro "$MICRO" --out "$OUT/forward_ratio.json" 2>&1 | tee "$OUT/forward_ratio.log" | tail -60

echo "== 3. floor ($(( $(date +%s) - T0 )) s)"
if [ -s "$OUT/bench_train.json" ]; then
  FLOOR_ARGS=(--cases-json "$OUT/bench_train.json")
else  # the training cases failed: the floors of the presets alone
  FLOOR_ARGS=(--preset lm_mamba2-350m --micro "$MICRO")
fi
[ "${STEP_DRY:-0}" = 1 ] && FLOOR_ARGS+=(--rates 700,3000)
timeout $(( $(left) > 20 ? $(left) : 20 )) $PY scripts/dev/floor.py "${FLOOR_ARGS[@]}" --out "$OUT/floor.json" \
  2>&1 | tee "$OUT/floor.txt" | head -120
echo "== done ($(( $(date +%s) - T0 )) s)"
