#!/usr/bin/env bash
# One GPU run of the conv1d checks and timings (lm_kernels.conv1d vs the PyTorch path), results in $OUT:
#   1. scripts/bench_conv1d.py (autotuned; do_bench medians; the torch.compile'd reference on the first shape;
#      ours' accuracy against the float32 reference with the tuned configs); BENCH_SHAPES picks shapes
#   2. tests/test_conv1d_gpu.py (real shapes vs float64, packed, odd shapes, determinism, tiny Mamba2)
#      with LM_CONV1D_AUTOTUNE=0 (one config per kernel: saves compile time)
# The repo need not be installed: lm_kernels is linked from lm_kernels/. CONV1D_DRY=1: CPU smoke run
# (interpreter, tiny bench shapes, no compile). Usage: OUT=/tmp/out bash scripts/gpu_conv1d.sh
set -uo pipefail
OUT=${OUT:-/tmp/conv1d_out}
PP=${PP_DIR:-/tmp/pp}; mkdir -p "$OUT" "$PP"
ln -sfn "$PWD/kernels" "$PP/lm_kernels"
export PYTHONPATH=$PP:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PY=${PY:-python3}
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 || true
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"

BENCH_ARGS=()
if [ "${CONV1D_DRY:-0}" = 1 ]; then
  export TRITON_INTERPRET=1
  BENCH_ARGS=(--tiny --no-compile --warmup 1 --rep 1)
fi

echo "== bench ($(($(date +%s) - T0)) s)"
# BENCH_EXTRA: more bench_conv1d.py arguments, e.g. "--no-compile --profile --variants rows64=LM_CONV1D_BWD_ROWS=64"
timeout "${BENCH_TIMEOUT:-150}" $PY scripts/bench_conv1d.py "${BENCH_ARGS[@]}" ${BENCH_SHAPES:+--shapes "$BENCH_SHAPES"} ${BENCH_EXTRA:-} --json "$OUT/bench_conv1d.json" \
  2>&1 | tee "$OUT/bench.log"
echo "== gpu tests ($(($(date +%s) - T0)) s)"
LM_CONV1D_AUTOTUNE=0 timeout "${TEST_TIMEOUT:-130}" $PY -m pytest tests/test_conv1d_gpu.py -q -rA -p no:cacheprovider \
  2>&1 | tail -40 | tee "$OUT/gpu_tests.log"

echo "== done ($(($(date +%s) - T0)) s)"
