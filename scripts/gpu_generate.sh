#!/usr/bin/env bash
# One GPU run of the generation checks and timings, results in $OUT:
#   1. tests/test_generate_gpu.py (CUDA-graph decode = eager tokens, graph = static logits, reuse / K/V growth /
#      beams, implicit fixed-iteration step, graph faster than eager, the decode kernels = their PyTorch forms) and
#      the SSD decode step kernel at Mamba2-350M shapes (tests/test_ssd_gpu.py); about 40 s
#   2. lm bench generate at the reference shapes (B 1/16/64, prompt 512/2048, 256 new tokens; lm_llama-350m,
#      lm_mamba2-350m, lm_deltaproduct-392m-nh2, implicit lm_mamba2-350m, transformers' eager Llama-350M) ->
#      $OUT/bench_generate.json. GEN_BENCH_ARGS overrides the bench's arguments (e.g. "--batch 1 --prompt 512").
# Usage: OUT=/tmp/out bash scripts/gpu_generate.sh      (about 5 minutes on an H100: a B 1/16 x prompt 512 run with
# 64 tokens took 115 s of bench; the full set is estimated at 3-4 minutes)
set -uo pipefail
OUT=${OUT:-/tmp/generate_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 || true
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } | tee "$OUT/env.txt"
rc=0
echo "== gpu tests ($(($(date +%s) - T0)) s)"
timeout "${TEST_TIMEOUT:-150}" $PY -m pytest tests/test_generate_gpu.py \
  tests/test_ssd_gpu.py::test_gpu_decode_step_vs_reference -q -rA -p no:cacheprovider 2>&1 \
  | tee "$OUT/tests.log" || rc=1
echo "== lm bench generate ($(($(date +%s) - T0)) s)"
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-330}" $PY -m lm.benchmarks.generate ${GEN_BENCH_ARGS:-} --out "$OUT/bench_generate.json" \
  2>&1 | tee "$OUT/bench.log" || rc=1
echo "== done in $(($(date +%s) - T0)) s (rc $rc)"
exit $rc
