#!/usr/bin/env bash
# One device run for the SSD kernels (lm_kernels.ssd): the GPU tests (tests/test_ssd_gpu.py) and the
# benchmark against mamba_ssm (lm.benchmarks.ssd) in one process each, inside one time budget.
# Run from the repository root on the GPU machine (carry .gpu: mamba_ssm's Triton sources in .gpu/peers).
#   SSD_TEST_ENV="LM_...=... ..."               environment of the GPU tests
#   SSD_TESTS_FIRST=1 (default)                 tests first (they fill Triton's disk cache for the bench),
#                                               at most SSD_TEST_TIMEOUT_S (200) seconds; 0: bench first,
#                                               SSD_TEST_RESERVE_S (70) seconds kept for the tests
#   SSD_BUDGET_S=390                            whole script's budget (timings of these phases: lm_kernels/ssd/PERF.md)
#   SSD_TESTS="tests/...::test_a ..."           the GPU tests to run, in order (default: the list below)
#   SSD_BENCH_ARGS="..."                        extra benchmark arguments (CPU dry run: "--tiny --no-peer
#                                               --warmup 1 --rep 1")
# The GPU tests run with LM_SSD_AUTOTUNE=0 (one config per kernel: compile time) unless SSD_TEST_ENV sets it.
set -u
T0=$(date +%s)
BUDGET=${SSD_BUDGET_S:-390}
OUT=${OUT:-/tmp/ssd_out}
mkdir -p "$OUT"
if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
  bash scripts/gpu_wheels.sh
fi
export PYTHONPATH=$PWD/.gpu/site:$PWD/.gpu/peers:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
TESTS=(tests/test_ssd_gpu.py::test_gpu_real_shape_vs_float64_reference
       tests/test_ssd_gpu.py::test_gpu_varlen_vs_reference
       tests/test_ssd_gpu.py::test_gpu_nograd_equals_grad_path_and_headdim_128
       tests/test_ssd_gpu.py::test_gpu_accuracy_parity_with_mamba_ssm_if_available
       tests/test_ssd_gpu.py::test_gpu_float32_highest_precision
       tests/test_ssd_gpu.py::test_gpu_repeat_calls_and_strided_inputs)
if [ -n "${SSD_TESTS:-}" ]; then read -r -a TESTS <<<"$SSD_TESTS"; fi  # e.g. "tests/test_ssd_gpu.py::test_x ..."

run_tests() {
  local tl=$1
  if [ "$tl" -gt 20 ]; then
    env LM_SSD_AUTOTUNE=0 ${SSD_TEST_ENV:-} timeout "$tl" python3 -m pytest "${TESTS[@]}" -m gpu -q -rA -s -p no:cacheprovider \
      >"$OUT/test_gpu.log" 2>&1
    echo "gpu tests rc=$? after $(( $(date +%s) - T0 )) s"
  else
    echo "no time left for the GPU tests"
  fi
}

run_bench() {
  timeout "$1" python3 -m lm.benchmarks.ssd --json "$OUT/bench_ssd.json" ${SSD_BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  echo "bench rc=$? after $(( $(date +%s) - T0 )) s"
}

if [ "${SSD_TESTS_FIRST:-1}" = "1" ]; then
  run_tests "${SSD_TEST_TIMEOUT_S:-200}"
  run_bench $(( $(left) - 3 ))
else
  run_bench $(( $(left) - ${SSD_TEST_RESERVE_S:-70} ))
  run_tests $(( $(left) - 5 ))
fi
echo "===== tests"
grep -E "passed|failed|skipped|PASSED|FAILED|Error|vs float64|errors above" "$OUT/test_gpu.log" | tail -25
echo "===== bench"
grep -v "^\s*$" "$OUT/bench.log" | grep -v -i warn | tail -c 7500
