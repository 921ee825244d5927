#!/usr/bin/env bash
# Issue #25 item 4, DeepSpeed's cost, on a machine of two GPUs (about 7 min), results under $OUT:
#   1. lm bench train, Mamba2-350M compiled, micro-batch 16 x 2048, bf16, one GPU: the plain engine, then DeepSpeed
#      ZeRO-2, each with a 2-step profile (device busy / idle time and the host events during the idle gaps)
#                                                                          -> plain.json/.log, zero2.json/.log
#   2. scripts/gpu_scaling.sh: the same model through `lm train` at 1 and 2 GPUs under ZeRO-2 and on 1 GPU with the
#      plain engine (--plain-ref), equal global batch (micro 16 x 2048 x 2)           -> scaling/scaling.json
# Run from the repository root with .gpu carried: OUT=/tmp/ds bash scripts/gpu_ds.sh. Env: MICRO (16), STEPS (10).
set -u
OUT=${OUT:-/tmp/gpu_ds_out}
mkdir -p "$OUT"
bash scripts/gpu_wheels.sh
export PYTHONPATH=$PWD/.gpu/site:$PWD/.gpu/peers:$PWD:${PYTHONPATH:-} PATH=$PWD/.gpu/site/bin:$PATH PYTHONUNBUFFERED=1
# NVLink SHARP / multicast objects are not available to these machines' containers (the device tool's KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
MICRO=${MICRO:-16}
COMMON=(--cases mamba2-explicit --size 350m --seq-len 2048 --precision bf16 --compile on --micro "$MICRO"
        --steps 4 --warmup 2 --profile 2 --timeout 200)
git log --oneline -1 > "$OUT/env.txt"; nvidia-smi -L >> "$OUT/env.txt" 2>&1
echo "== 1. one GPU: plain engine, then ZeRO-2"
python3 -m lm.benchmarks.train "${COMMON[@]}" --engine torch --out "$OUT/plain.json" > "$OUT/plain.log" 2>&1
grep -v "^    " "$OUT/plain.log" | head -8
python3 -m lm.benchmarks.train "${COMMON[@]}" --engine deepspeed --zero-stage 2 --out "$OUT/zero2.json" \
  > "$OUT/zero2.log" 2>&1
sed -n '/device idle/,$p' "$OUT/zero2.log" | head -18; grep -v "^    " "$OUT/zero2.log" | head -8
echo "== 2. lm train at 1 and 2 GPUs (ZeRO-2) and 1 GPU plain"
CASES=mamba2-350m-explicit GPUS=1,2 MICRO=$MICRO STEPS=${STEPS:-10} WARMUP=4 OUT=$OUT/scaling \
  bash scripts/gpu_scaling.sh --plain-ref --max-world 2 2>&1 | tail -12
