#!/bin/bash
# One GPU run of the DeltaProduct op on its default path, results in $OUT:
#   1. the GPU tests, in three processes side by side (an illegal address kills a CUDA context): the small-head /
#      16-token-chunk / wide-key-head shapes (SMALL=0 skips them: they compile for ~5 min), the other op tests, the
#      model tests; MODELS=1 also runs scripts/gpu_check_models.py beside them
#   2. `lm bench deltaproduct` (ours vs fla 0.6.0 when importable, per-kernel profile, float64 check), then --decode
# Run from the repo root:  OUT=/tmp/dp_out bash scripts/gpu_deltaproduct.sh   (BENCH_ARGS: more bench arguments,
# e.g. "--nh 2"; "--quick --B 1 --T 40 --H 1 --K 32 --V 32" with SMALL=0 TESTS=0 is a CPU dry run; TEST_TIMEOUT: s per
# test process, default 420)
set -u
OUT=${OUT:-/tmp/dp_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FLA_CACHE_RESULTS=0
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 || true
  $PY -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/env.txt" 2>&1
t0=$(date +%s)
if [ "${TESTS:-1}" = 1 ]; then
  [ "${SMALL:-1}" = 1 ] && ( timeout ${TEST_TIMEOUT:-420} $PY -m pytest -m gpu tests/test_deltaproduct_op_gpu.py \
      -k "small_heads or wide_key" -q -s -p no:cacheprovider > "$OUT/test_small.log" 2>&1; echo "exit $?" >> "$OUT/test_small.log" ) &
  ( timeout ${TEST_TIMEOUT:-420} $PY -m pytest -m gpu tests/test_deltaproduct_op_gpu.py -k "not small_heads and not wide_key" \
      -q -s -p no:cacheprovider > "$OUT/test_main.log" 2>&1; echo "exit $?" >> "$OUT/test_main.log" ) &
  ( timeout ${TEST_TIMEOUT:-240} $PY -m pytest -m gpu tests/test_models_deltaproduct_gpu.py -q -s -p no:cacheprovider \
      > "$OUT/test_models.log" 2>&1; echo "exit $?" >> "$OUT/test_models.log" ) &
  [ "${MODELS:-0}" = 1 ] && ( timeout ${MODELS_TIMEOUT:-300} $PY scripts/gpu_check_models.py --json "$OUT/models.json" \
      > "$OUT/models.log" 2>&1; echo "exit $?" >> "$OUT/models.log" ) &
  wait
  cat "$OUT"/test_small.log "$OUT/test_main.log" "$OUT/test_models.log" > "$OUT/tests.log" 2>/dev/null
  rm -f "$OUT/test_small.log" "$OUT/test_main.log" "$OUT/test_models.log"
  echo "tests: $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
fi
timeout ${BENCH_TIMEOUT:-300} $PY -m lm.cli bench deltaproduct --profile ${BENCH_ARGS:-} --json "$OUT/bench.json" \
    > "$OUT/bench.log" 2>&1
echo "bench exit $?" >> "$OUT/env.txt"
timeout ${BENCH_TIMEOUT:-300} $PY -m lm.cli bench deltaproduct --decode ${BENCH_ARGS:-} --json "$OUT/decode.json" \
    > "$OUT/decode.log" 2>&1
echo "decode bench exit $?, total $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
[ -f "$OUT/tests.log" ] && grep -E "passed|failed|error|exit|Error" "$OUT/tests.log" | tail -20
[ -f "$OUT/models.log" ] && tail -n 15 "$OUT/models.log"
tail -n 20 "$OUT/bench.log"
tail -n 8 "$OUT/decode.log"
cat "$OUT/env.txt"
