#!/usr/bin/env bash
# One device run for end-to-end training speed: the GPU tests of the pieces on the training path
# (LM-head loss kernel, conv1d kernel), their micro-benchmarks, then scripts/bench_train.py with
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
  python3 -m pip install -q --no-index --no-deps --upgrade --target .gpu/site .gpu/wheels/*.whl >/dev/null 2>&1
fi
mkdir -p /tmp/pp && ln -sfn "$PWD/kernels" /tmp/pp/lm_kernels
export PYTHONPATH=/tmp/pp:$PWD/.gpu/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
TESTS=(tests/test_models_loss_triton.py)
ls tests/test_conv1d_*.py >/dev/null 2>&1 && TESTS+=(tests/test_conv1d_*.py)
timeout 120 python3 -m pytest "${TESTS[@]}" -m gpu -q -rA -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
timeout 60 python3 scripts/bench_loss.py --json "$OUT/bench_loss.json" 2>&1 | tail -6
[ -f scripts/bench_conv1d.py ] && timeout 60 python3 scripts/bench_conv1d.py --json "$OUT/bench_conv1d.json" 2>&1 | tail -12
echo "pieces done after $(( $(date +%s) - T0 )) s"
L=$(( $(left) - 10 ))
if [ "$L" -gt 60 ]; then
  timeout "$L" python3 scripts/bench_train.py --cases "${CASES:-llama-explicit,mamba2-explicit,mamba2-implicit-4+1,llama-implicit-4+1,deltaproduct-392m-nh2,fp_mamba-200m}" \
    --compile "${COMPILE:-on}" --engine "${ENGINE:-auto}" --micro "${MICRO:-16}" --steps 8 --warmup 3 --profile 2 \
    --timeout 150 --out "$OUT/bench_train.json" 2>&1 | grep -v "^    " | tail -30
fi
echo "done after $(( $(date +%s) - T0 )) s"
