#!/usr/bin/env bash
# Long-context training throughput on one GPU: tokens/s, MFU and peak memory of Mamba2-350M, Llama-350M and
# DeltaProduct-392M (n_h=2) at 8k, 32k and 64k tokens per sequence (lm bench train: compiled blocks, bf16, plain
# engine, synthetic tokens), 32k tokens per micro-step at 8k (micro-batch 4), one sequence per micro-step above; a
# case that runs out of memory at micro-batch 1 is run again with activation checkpointing per block. Then each
# length's tokens/s ratio Mamba2 / Llama and DeltaProduct / Llama (issue 60's bar: Mamba2 >= 2x Llama at 32k).
# Run from the repository root: OUT=/tmp/long bash scripts/gpu_long_context.sh
# Env: LENGTHS ("8192 32768 65536"), CASES (mamba2-explicit,llama-explicit,deltaproduct-392m-nh2), STEPS (4),
# WARMUP (2), CASE_TIMEOUT (240 s per case). About 3 min per length on one H100 (compilation included).
# LONG_DRY=1: CPU smoke run (tiny models, interpreter, fp32, no compile, lengths 64 and 128).
set -u
OUT=${OUT:-/tmp/gpu_long_context}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
PY=${PY:-python3}
CASES=${CASES:-mamba2-explicit,llama-explicit,deltaproduct-392m-nh2}
if [ "${LONG_DRY:-0}" = 1 ]; then
  export TRITON_INTERPRET=1
  LENGTHS=${LENGTHS:-64 128}; CASES=mamba2-explicit,llama-explicit
  COMMON=(--size tiny --precision fp32 --compile off --steps 1 --warmup 1 --device cpu)
  TOKENS=128
else
  LENGTHS=${LENGTHS:-8192 32768 65536}
  COMMON=(--size 350m --precision bf16 --compile on --steps "${STEPS:-4}" --warmup "${WARMUP:-2}")
  TOKENS=32768
fi
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 || true
  $PY -c "import torch; print('torch', torch.__version__)"; git log --oneline -1; } | tee "$OUT/env.txt"

for T in $LENGTHS; do
  MICRO=$(( TOKENS / T )); [ "$MICRO" -lt 1 ] && MICRO=1
  echo "== seq_len $T, micro-batch $MICRO"
  $PY -m lm.benchmarks.train --cases "$CASES" "${COMMON[@]}" --seq-len "$T" --micro "$MICRO" --engine torch \
    --timeout "${CASE_TIMEOUT:-240}" --out "$OUT/long_$T.json" 2>&1 | tee "$OUT/long_$T.log" | grep -v "^    "
  # the cases that failed for memory at micro-batch 1: again with activation checkpointing
  RETRY=$($PY - "$OUT/long_$T.json" <<'EOF'
import json, sys
rs = json.load(open(sys.argv[1]))["results"]
print(",".join(r["case"].removesuffix("+compile") for r in rs if "error" in r and "out of memory" in r["error"].lower()))
EOF
)
  if [ -n "$RETRY" ]; then
    echo "== seq_len $T with activation checkpointing: $RETRY"
    $PY -m lm.benchmarks.train --cases "$RETRY" "${COMMON[@]}" --seq-len "$T" --micro 1 --engine torch --act-ckpt \
      --timeout "${CASE_TIMEOUT:-240}" --out "$OUT/long_${T}_ckpt.json" 2>&1 | tee "$OUT/long_${T}_ckpt.log" \
      | grep -v "^    "
  fi
done

echo "== summary"
$PY - "$OUT" $LENGTHS <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

out, lengths = Path(sys.argv[1]), sys.argv[2:]
for t in lengths:
    rows = {}
    for name in (f"long_{t}.json", f"long_{t}_ckpt.json"):
        if (out / name).is_file():
            for r in json.loads((out / name).read_text())["results"]:
                if "error" not in r:
                    rows[r["preset"]] = (r["tokens_per_s"], r["mem_gb"], name.endswith("_ckpt.json"))
    line = "  ".join(f"{p} {v[0]:,.0f} tok/s {v[1]:.1f} GB{' (ckpt)' if v[2] else ''}" for p, v in rows.items())
    llama = next((v[0] for p, v in rows.items() if p.startswith("lm_llama")), None)
    ratios = "  ".join(f"{p.split('-')[0]}/llama {v[0] / llama:.2f}x" for p, v in rows.items()
                       if llama and not p.startswith("lm_llama"))
    print(f"seq_len {t}: {line}  {ratios}")
EOF
