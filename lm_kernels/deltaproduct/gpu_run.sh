#!/bin/bash
# One device run for the DeltaProduct kernels (see BENCH.md): the GPU tests (the 16-token-chunk case in its own
# process, since an illegal address kills the CUDA context; the model tests in a third), triton-cache warm-up processes beside them, then
# scripts/bench_deltaproduct.py with the variants given in $VARS (ours vs fla 0.6.0, per-kernel profile).
# Run from the repo root with .gpu carried:  VARS="new s3 ..." bash lm_kernels/deltaproduct/gpu_run.sh
# (TEST_TIMEOUT: seconds per test process, default 420; MODELS=1 also runs scripts/gpu_check_models.py; SMALL=0 skips the process of the 16-token-chunk, small-head and
# wide-key-head tests, whose many shapes compile for ~5 min)
set -u
OUT=${OUT:-/tmp/dp_out}; mkdir -p "$OUT"
VARS=${VARS:-new}
NHS=${NHS:-1 2 3}
python3 -m pip install -q --no-index --no-deps --upgrade --target .gpu/site .gpu/wheels/*.whl >/dev/null 2>&1
mkdir -p /tmp/pp_dp && ln -sfn "$PWD/kernels" /tmp/pp_dp/lm_kernels
export PYTHONPATH=/tmp/pp_dp:$PWD/.gpu/site:$PWD/.gpu/peers:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 FLA_CACHE_RESULTS=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$OUT/env.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt" 2>&1
t0=$(date +%s)
[ "${SMALL:-1}" = 1 ] && ( timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m gpu tests/test_deltaproduct_op_gpu.py -k "small_heads or wide_key" -q -s -p no:cacheprovider \
    > "$OUT/test_small.log" 2>&1; echo "exit $?" >> "$OUT/test_small.log" ) &
( timeout ${TEST_TIMEOUT:-420} python3 -m pytest -m gpu tests/test_deltaproduct_op_gpu.py -k "not small_heads and not wide_key" -q -s -p no:cacheprovider \
    > "$OUT/test_main.log" 2>&1; echo "exit $?" >> "$OUT/test_main.log" ) &
( timeout ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu tests/test_models_deltaproduct_gpu.py -q -s -p no:cacheprovider \
    > "$OUT/test_models.log" 2>&1; echo "exit $?" >> "$OUT/test_models.log" ) &
# MODELS=1: scripts/gpu_check_models.py (every family trains through its kernels vs the CPU loss) beside the tests
[ "${MODELS:-0}" = 1 ] && ( timeout ${MODELS_TIMEOUT:-300} python3 scripts/gpu_check_models.py --json "$OUT/models.json" \
    > "$OUT/models.log" 2>&1; echo "exit $?" >> "$OUT/models.log" ) &
# compile in parallel: per nh, the variants split in two halves
set -- $VARS; half=$(( ($# + 1) / 2 )); G1="${*:1:$half}"; G2="${*:$((half + 1))}"
for nh in $NHS; do
  i=0
  for grp in "$G1" "$G2"; do
    i=$((i + 1)); [ -n "$grp" ] || continue
    ( timeout ${WARM_TIMEOUT:-180} python3 scripts/bench_deltaproduct.py --warm ours --nh $nh --variants $grp ${BENCH_ARGS:-} \
        > "$OUT/warm_${nh}_$i.tmp" 2>&1 ) &
  done
done
( timeout ${WARM_TIMEOUT:-180} python3 scripts/bench_deltaproduct.py --warm fla --nh $NHS ${BENCH_ARGS:-} > "$OUT/warm_fla.tmp" 2>&1 ) &
wait
cat "$OUT"/warm_*.tmp > "$OUT/warm.log"; rm -f "$OUT"/warm_*.tmp
echo "tests + warm: $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
cat "$OUT"/test_small.log "$OUT/test_main.log" "$OUT/test_models.log" > "$OUT/tests.log" 2>/dev/null
rm -f "$OUT/test_small.log" "$OUT/test_main.log" "$OUT/test_models.log"
timeout ${BENCH_TIMEOUT:-300} python3 scripts/bench_deltaproduct.py --nh $NHS --variants $VARS --profile --profile-variants ${PVARS:-new} ${BENCH_ARGS:-} \
    --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench exit $?, total $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
grep -E "passed|failed|error|exit|Error" "$OUT/tests.log" | tail -20
[ -f "$OUT/models.log" ] && tail -n 15 "$OUT/models.log"
tail -n 60 "$OUT/bench.log"
cat "$OUT/env.txt"
