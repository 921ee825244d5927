#!/usr/bin/env bash
# One device call for several checks, results under $OUT (the device tool returns it):
#   bash scripts/gpu_session.sh PHASE [PHASE ...]
# Phases:
#   tests     every GPU test file, in parallel processes (a CUDA fault kills only its process), and
#             scripts/gpu_check_models.py (every family through the kernels vs the CPU reference)
#   kernels   lm bench ssd (vs mamba_ssm's Triton SSD) and lm bench deltaproduct (vs fla; + --decode), one after
#             another (KERNEL_BENCHES="ssd dp decode" picks)
#   step      scripts/gpu_step.sh (training step throughput, memory, profile, no-grad / grad forward)
#   generate  scripts/gpu_generate.sh (generation tests and lm bench generate)
#   fla       scripts/gpu_fla.sh (fla backend and conversion tests, triton vs fla speed)
#   ds        DeepSpeed's own cost on 1 GPU: lm bench train, Mamba2-350M under DeepSpeed ZeRO-2 and under the
#             hook-free ZeRO-1 (configs/deepspeed/zero1.json), with a profile (the plain engine: phase step)
#   scaling   scripts/gpu_scaling.sh --parallel --plain-ref over every GPU visible (1, 2, 4, 8)
#   ssdtests  tests/test_ssd_gpu.py alone (its long cases need the machine to themselves)
# PACK=DIR: at the end, $OUT packed into DIR/all.tgz (the device tool returns at most 8 files), e.g. in a device call:
#   R=$OUT; OUT=/tmp/o PACK=$R bash scripts/gpu_session.sh step > $R/session.log 2>&1
# On a machine of several GPUs, groups of phases run side by side, one GPU each (outputs in $OUT/gpuI):
#   bash scripts/gpu_session.sh --split "tests kernels" step generate "ds fla"
# Carry .gpu (scripts ../shared/tools/gpu-carry.sh .gpu): deepspeed, fla wheels and mamba_ssm's Triton SSD.
# Timings of phases that share a machine with `tests` (compiling on every core) are not clean: run timed phases alone.
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
T0=$(date +%s)
pack() { [ -z "${PACK:-}" ] || { mkdir -p "$PACK" && tar czf "$PACK/all.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }; }
if [ "${1:-}" = "--split" ]; then
  shift
  bash scripts/gpu_wheels.sh
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a ids <<< "$CUDA_VISIBLE_DEVICES"
  else mapfile -t ids < <(nvidia-smi -L | awk '{print NR-1}'); fi
  [ "$#" -le "${#ids[@]}" ] || { echo "gpu_session.sh: $# groups for ${#ids[@]} GPUs" >&2; exit 2; }
  i=0
  for g in "$@"; do
    # shellcheck disable=SC2086
    PACK= CUDA_VISIBLE_DEVICES=${ids[$i]} OUT=$OUT/gpu$i bash scripts/gpu_session.sh $g > "$OUT/gpu$i.log" 2>&1 &
    i=$((i + 1))
  done
  wait
  for ((j = 0; j < i; j++)); do echo "######## GPU $j"; grep -v "^\s*$" "$OUT/gpu$j.log" | tail -n 60; done
  echo "total $(( $(date +%s) - T0 )) s"
  pack
  exit 0
fi
if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
  bash scripts/gpu_wheels.sh
fi
export PYTHONPATH=$PWD/.gpu/site:$PWD/.gpu/peers:$PWD:${PYTHONPATH:-} PATH=$PWD/.gpu/site/bin:$PATH
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.total --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
el() { echo "$(( $(date +%s) - T0 )) s"; }

phase_tests() {
  local pids=() f
  for f in tests/test_ssd_gpu.py tests/test_conv1d_gpu.py tests/test_lru_scan_gpu.py tests/test_models_lru_gpu.py \
           tests/test_models_loss_triton.py tests/test_models_deltaproduct_gpu.py; do
    ( timeout ${TEST_TIMEOUT:-400} python3 -m pytest -m gpu "$f" -q -p no:cacheprovider > "$OUT/t_$(basename "$f" .py).log" 2>&1
      echo "exit $?" >> "$OUT/t_$(basename "$f" .py).log" ) &
  done
  ( timeout ${TEST_TIMEOUT:-400} python3 -m pytest -m gpu tests/test_deltaproduct_op_gpu.py -k "small_heads or wide_key" -q \
      -p no:cacheprovider > "$OUT/t_dp_small.log" 2>&1; echo "exit $?" >> "$OUT/t_dp_small.log" ) &
  ( timeout ${TEST_TIMEOUT:-400} python3 -m pytest -m gpu tests/test_deltaproduct_op_gpu.py -k "not small_heads and not wide_key" \
      -q -p no:cacheprovider > "$OUT/t_dp_main.log" 2>&1; echo "exit $?" >> "$OUT/t_dp_main.log" ) &
  for f in $(ls tests/test_*gpu*.py 2>/dev/null | grep -v -E "ssd_gpu|conv1d_gpu|lru_scan_gpu|models_lru_gpu|deltaproduct_gpu|deltaproduct_op_gpu"); do
    ( timeout ${TEST_TIMEOUT:-400} python3 -m pytest -m gpu "$f" -q -p no:cacheprovider > "$OUT/t_$(basename "$f" .py).log" 2>&1
      echo "exit $?" >> "$OUT/t_$(basename "$f" .py).log" ) &
  done
  ( timeout ${TEST_TIMEOUT:-400} python3 scripts/gpu_check_models.py --json "$OUT/models.json" > "$OUT/models.log" 2>&1
    echo "exit $?" >> "$OUT/models.log" ) &
  wait
  cat "$OUT"/t_*.log > "$OUT/tests.log"; rm -f "$OUT"/t_*.log
  echo "== tests ($(el))"; grep -E "passed|failed|error|^exit|Error" "$OUT/tests.log" | tail -40
  echo "== models"; tail -n 14 "$OUT/models.log"
}

phase_kernels() {  # KERNEL_BENCHES: a subset of "ssd dp decode"
  local b
  for b in ${KERNEL_BENCHES:-ssd dp decode}; do
    case $b in
      ssd) timeout ${BENCH_TIMEOUT:-240} python3 -m lm.benchmarks.ssd --json "$OUT/bench_ssd.json" > "$OUT/bench_ssd.log" 2>&1
           echo "== ssd bench exit $? ($(el))"; grep -v "^\s*$" "$OUT/bench_ssd.log" | grep -vi warn | tail -n 30 ;;
      dp) timeout ${BENCH_TIMEOUT:-240} python3 -m lm.benchmarks.deltaproduct --profile --json "$OUT/bench_dp.json" \
            > "$OUT/bench_dp.log" 2>&1
          echo "== deltaproduct bench exit $? ($(el))"; tail -n 24 "$OUT/bench_dp.log" ;;
      decode) timeout ${BENCH_TIMEOUT:-240} python3 -m lm.benchmarks.deltaproduct --decode \
                --json "$OUT/bench_dp_decode.json" > "$OUT/bench_dp_decode.log" 2>&1
              echo "== decode bench exit $? ($(el))"; tail -n 8 "$OUT/bench_dp_decode.log" ;;
    esac
  done
}

phase_step() { OUT=$OUT bash scripts/gpu_step.sh; echo "== step ($(el))"; }
phase_generate() { OUT=$OUT bash scripts/gpu_generate.sh; echo "== generate ($(el))"; }
phase_fla() { OUT=$OUT bash scripts/gpu_fla.sh; echo "== fla ($(el))"; }
phase_ds() {  # DeepSpeed's own cost on 1 GPU: the step of Mamba2-350M (micro 16) under ZeRO-2 and hook-free ZeRO-1
  local name args
  for name in zero2 zero1; do
    args=(--zero-stage 2); [ $name = zero1 ] && args=(--zero-stage 1 --deepspeed-config zero1)
    timeout ${DS_TIMEOUT:-200} python3 -m lm.benchmarks.train --cases mamba2-explicit --size 350m --seq-len 2048 \
      --precision bf16 --compile on --micro "${MICRO:-16}" --steps 4 --warmup 2 --engine deepspeed "${args[@]}" \
      --profile 2 --timeout 190 --out "$OUT/ds_$name.json" > "$OUT/ds_$name.log" 2>&1
    echo "== ds $name exit $? ($(el))"; grep -v "^    " "$OUT/ds_$name.log" | grep -E "tok/s|busy" | tail -n 4
  done
}
phase_ssdtests() {
  timeout ${TEST_TIMEOUT:-400} python3 -m pytest -m gpu tests/test_ssd_gpu.py -q -p no:cacheprovider > "$OUT/ssd_tests.log" 2>&1
  echo "== ssd tests exit $? ($(el))"; tail -n 5 "$OUT/ssd_tests.log"
}
phase_scaling() { OUT=$OUT/scaling bash scripts/gpu_scaling.sh --parallel --plain-ref ${SCALING_ARGS:-}; echo "== scaling ($(el))"; }

for p in "$@"; do
  case $p in
    tests|kernels|step|generate|fla|ds|scaling|ssdtests) "phase_$p" ;;
    *) echo "unknown phase $p"; exit 2 ;;
  esac
done
echo "total $(el)"
pack
