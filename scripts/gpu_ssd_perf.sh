#!/usr/bin/env bash
# One device run for the SSD kernels (lm_kernels.ssd): the benchmark of kernel variants against mamba_ssm
# in one process (scripts/bench_ssd.py), then the GPU tests (tests/test_ssd_gpu.py), inside a time budget.
# Run from the repository root on the GPU machine (carry .gpu: mamba_ssm's Triton sources in .gpu/peers).
#   SSD_VARIANTS="name=SCAN/STATE/NOGRAD ..."   variants to time (bench_ssd.py --variants; default: its own)
#   SSD_TEST_ENV="LM_SSD_...=... ..."           environment of the GPU tests (e.g. candidate kernels)
#   SSD_BUDGET_S=280                            whole script's budget; tests get what the bench leaves
set -u
T0=$(date +%s)
BUDGET=${SSD_BUDGET_S:-280}
OUT=${OUT:-/tmp/ssd_out}
mkdir -p "$OUT"
if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target .gpu/site .gpu/wheels/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=$PWD/.gpu/site:$PWD/.gpu/peers:$PWD:${PYTHONPATH:-}
mkdir -p /tmp/pp && ln -sfn "$PWD/kernels" /tmp/pp/lm_kernels && export PYTHONPATH=/tmp/pp:$PYTHONPATH
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

# (1) benchmark (writes its JSON after every shape)
VARGS=()
if [ -n "${SSD_VARIANTS:-}" ]; then read -r -a VARGS <<<"$SSD_VARIANTS"; VARGS=(--variants "${VARGS[@]}"); fi
timeout $(( $(left) - ${SSD_TEST_RESERVE_S:-70} )) python3 scripts/bench_ssd.py --json "$OUT/bench_ssd.json" "${VARGS[@]}" \
  >"$OUT/bench.log" 2>&1
echo "bench rc=$? after $(( $(date +%s) - T0 )) s"

# (2) GPU tests
TL=$(left)
if [ "$TL" -gt 20 ]; then
  env ${SSD_TEST_ENV:-} timeout $(( TL - 5 )) python3 -m pytest tests/test_ssd_gpu.py -m gpu -q -rA -s \
    >"$OUT/test_gpu.log" 2>&1
  echo "gpu tests rc=$? after $(( $(date +%s) - T0 )) s"
  grep -E "passed|failed|PASSED|FAILED|Error|vs float64|errors above" "$OUT/test_gpu.log" | tail -25
else
  echo "no time left for the GPU tests"
fi
echo "===== bench"
grep -v "^\s*$" "$OUT/bench.log" | grep -v Warning | tail -c 7000
