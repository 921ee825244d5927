#!/usr/bin/env bash
# One device run for end-to-end training speed: the GPU tests of the pieces on the training path
# (LM-head loss kernel; conv1d kernel through scripts/gpu_conv1d.sh), their micro-benchmarks, then scripts/bench_train.py with
# per-kernel profiles. Run from the repository root on the GPU machine (carry .gpu for DeepSpeed).
#   CASES=...    bench_train cases (default: every family) COMPILE=on|off|both (default on)
#   MICRO=16     micro-batch                              ENGINE=auto|torch|deepspeed (default auto)
#   BUDGET_S=540 whole script
set -u
T0=$(date +%s)
BUDGET=${BUDGET_S:-540}
OUT=${OUT:-/tmp/train_perf_out}
mkdir -p "$OUT"
if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
  bash scripts/gpu_wheels.sh
fi
mkdir -p /tmp/pp && ln -sfn "$PWD/kernels" /tmp/pp/lm_kernels
export PYTHONPATH=/tmp/pp:$PWD/.gpu/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
timeout 150 python3 -m pytest tests/test_models_loss_triton.py -m gpu -q -rA -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/loss_tests.log"
OUT=$OUT/conv1d BENCH_SHAPES=${CONV_SHAPES:-mamba2_350m_B8,deltaproduct_392m_B8} bash scripts/gpu_conv1d.sh > "$OUT/conv1d.log" 2>&1
grep -v "^  " "$OUT/conv1d.log" | tail -30
timeout 60 python3 scripts/bench_loss.py --json "$OUT/bench_loss.json" 2>&1 | tail -5
echo "pieces done after $(( $(date +%s) - T0 )) s"
L=$(( $(left) - 10 ))
if [ "$L" -gt 60 ]; then
  timeout "$L" python3 scripts/bench_train.py --cases "${CASES:-llama-explicit,mamba2-explicit,mamba2-implicit-4+1,deltaproduct-392m-nh2,fp_mamba-200m,llama-implicit-4+1}" \
    --compile "${COMPILE:-on}" --engine "${ENGINE:-auto}" --micro "${MICRO:-16}" --steps 8 --warmup 3 --profile 2 \
    --timeout 150 --out "$OUT/bench_train.json" 2>&1 | grep -v "^    " | tail -30
fi
echo "done after $(( $(date +%s) - T0 )) s"
