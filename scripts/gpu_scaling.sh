#!/usr/bin/env bash
# Scaling over GPUs: the same training at 1, 2, 4 and 8 GPUs (as many as `nvidia-smi -L` lists, up
# to 8) for Mamba2-350M and Llama-1.3B, explicit and implicit (4+1): bf16, DeepSpeed ZeRO-2, synthetic data
# (data.source: synthetic, no corpus), the same global batch at every world size (micro x 2048 x 8 tokens:
# gradient accumulation 8/N), torch.compile on. Writes $OUT/scaling.json (per case and world size: tokens/s per
# GPU, scaling efficiency = tokens/s per GPU at N / at 1, peak memory, per-step losses, the largest relative
# per-step loss difference from the 1-GPU run) and prints a table. Logs and configs under $OUT/runs/.
#
#   bash scripts/gpu_scaling.sh                     # on the GPU machine, from the repository root
#   CASES=mamba2-350m-explicit,llama-1.3b-explicit STEPS=12 bash scripts/gpu_scaling.sh
#   bash scripts/gpu_scaling.sh --parallel --plain-ref   # runs side by side on free GPUs; + 1-GPU plain-engine runs
#   bash scripts/gpu_scaling.sh --dry-run           # CPU: tiny presets at 1 and 2 ranks (gloo), fp32
#   CASES=mamba2-350m-explicit GPUS=1,2,4 MICRO=1 bash scripts/gpu_scaling.sh --context-parallel --seq-len 32768 \
#     --max-world 4                                 # 32k on 1 GPU against 64k on 2 and 128k on 4 (context parallel)
#
# Environment: OUT [/tmp/gpu_scaling_out]  GPUS [1,2,4,8 up to the visible count]  CASES [all]
#   STEPS [16]  WARMUP [4] (steps left out of tokens/s)  COMPILE [on]  RUN_TIMEOUT [900] (seconds per run)
#   MICRO [each case's own] (micro-batch per GPU)
# Carry .gpu (scripts ../shared/tools/gpu-carry.sh .gpu): its wheels (deepspeed, ...) are installed into
# .gpu/site as scripts/gpu_session.sh does.
set -u
OUT=${OUT:-/tmp/gpu_scaling_out}
mkdir -p "$OUT"
dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done
if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
  bash scripts/gpu_wheels.sh
fi
export PYTHONPATH=$PWD/.gpu/site:$PWD/.gpu/peers:$PWD:${PYTHONPATH:-} PATH=$PWD/.gpu/site/bin:$PATH
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline

if [ "$dry" = 1 ]; then
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=1
  gpus=1,2
else
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then n=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
  else n=$(nvidia-smi -L 2>/dev/null | wc -l); fi
  [ "$n" -ge 1 ] || { echo "gpu_scaling.sh: no GPU listed by nvidia-smi -L (use --dry-run on CPU)" >&2; exit 2; }
  gpus=${GPUS:-$(for g in 1 2 4 8; do [ "$g" -le "$n" ] && printf '%s,' "$g"; done | sed 's/,$//')}
  { nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv
    python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  # CPU threads per rank: the cores shared by the largest run's ranks
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / ${gpus##*,} > 0 ? $(nproc) / ${gpus##*,} : 1 ))}
fi
echo "world sizes: $gpus"
exec python3 scripts/gpu_scaling.py --out "$OUT" --gpus "$gpus" ${CASES:+--cases "$CASES"} --steps "${STEPS:-16}" ${MICRO:+--micro "$MICRO"} \
  --warmup "${WARMUP:-4}" --compile "${COMPILE:-on}" --timeout "${RUN_TIMEOUT:-900}" "$@"
