#!/usr/bin/env bash
# Nsight Compute profile of the SSD kernels on the GPU machine (scripts/dev/ncu_ssd.py drives one forward +
# backward per case; carry .gpu for mamba_ssm's sources). Writes $OUT/ncu_<tag>.txt (ncu's details page)
# and prints one line per kernel: duration, SM / memory throughput, L2 hit rate, occupancy, registers.
#   NCU_CASES="ours= ours_noautotune=LM_SSD_AUTOTUNE=0 mamba="  NCU_SET=detailed  NCU_TIMEOUT_S=240  NCU_ARGS="--nograd"
#   DeltaProduct: NCU_ARGS="--op deltaproduct --nh 2" NCU_CASES="ours= fla=" (about 143 s; fla from .gpu/wheels)
# NCU_SOURCE=1 (scripts/dev/gpu_ssd_ncu_src.sh): source level instead, set "full" (warp stall reasons, per-SASS-
# instruction samples) for the kernels of NCU_KERNELS (default "regex:dx_bwd"): writes $OUT/ncu_src_<tag>.txt
# (details) and $OUT/sass_<tag>.csv (source page).
set -u
OUT=${OUT:-/tmp/ssd_out}
mkdir -p "$OUT"
if ls .gpu/wheels/*.whl >/dev/null 2>&1; then  # fla (the DeltaProduct peer) and the other wheels the image lacks
  bash scripts/gpu_wheels.sh
fi
export PYTHONPATH=$PWD/.gpu/site:$PWD/.gpu/peers:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
T=$(date +%s)
if [ "${NCU_SOURCE:-0}" = "1" ]; then
  TAG=${NCU_TAG:-dx}
  read -r -a CASES <<<"${NCU_CASES:-ours=}"
  REP=/tmp/ncu_$TAG
  timeout "${NCU_TIMEOUT_S:-240}" "$NCU" --profile-from-start off --clock-control none --set full \
    --import-source yes --kernel-name "${NCU_KERNELS:-regex:dx_bwd}" -f -o "$REP" \
    python3 scripts/dev/ncu_ssd.py --cases "${CASES[@]}" ${NCU_ARGS:-} >"$OUT/ncu_run_$TAG.log" 2>&1
  echo "ncu rc=$? in $(( $(date +%s) - T )) s"
  "$NCU" --import "$REP.ncu-rep" --page details >"$OUT/ncu_src_$TAG.txt" 2>&1
  "$NCU" --import "$REP.ncu-rep" --page source --csv --print-source sass >"$OUT/sass_$TAG.csv" 2>"$OUT/sass_$TAG.err" \
    || "$NCU" --import "$REP.ncu-rep" --page source --csv >"$OUT/sass_$TAG.csv" 2>>"$OUT/sass_$TAG.err"
  ls -la "$OUT"; head -c 600 "$OUT/sass_$TAG.err"
  grep -E "Warp Cycles Per Issued|Stall|Duration|Achieved Occupancy" "$OUT/ncu_src_$TAG.txt" | head -40
  exit 0
fi
TAG=${NCU_TAG:-fb}
read -r -a CASES <<<"${NCU_CASES:-ours= mamba=}"
timeout "${NCU_TIMEOUT_S:-240}" "$NCU" --profile-from-start off --clock-control none --set "${NCU_SET:-detailed}" \
  ${NCU_EXTRA:-} python3 scripts/dev/ncu_ssd.py --cases "${CASES[@]}" ${NCU_ARGS:-} >"$OUT/ncu_$TAG.txt" 2>&1
echo "ncu rc=$? in $(( $(date +%s) - T )) s"
python3 - "$OUT/ncu_$TAG.txt" <<'PY'
import re, sys
cur = None
want = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "L2 Hit Rate", "Achieved Occupancy",
        "Registers Per Thread", "DRAM Throughput", "L1/TEX Hit Rate", "Executed Ipc Active")
rows = []
for line in open(sys.argv[1], errors="replace"):
    if line.startswith("== case"):
        print(line.strip()); continue
    m = re.match(r"\s\s(\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line)
    if m:
        if cur: print(cur)
        cur = m.group(1)[:40] + ":"; continue
    for w in want:
        if cur and line.strip().startswith(w):
            parts = line.split()
            cur += f" {w.split()[0]}={parts[-1]}{parts[-2] if parts[-2] in ('ms','us','%','GB/s') else ''}"
if cur: print(cur)
PY
