#!/usr/bin/env bash
# Source-level Nsight Compute profile (set "full": warp stall reasons, per-SASS-instruction samples) of
# selected SSD kernels: writes $OUT/ncu_src_<tag>.txt (details) and $OUT/sass_<tag>.csv (source page).
#   NCU_KERNELS="regex:dx_bwd"  NCU_CASES="ours="  NCU_ARGS=""  NCU_TAG=dx
set -u
OUT=${OUT:-/tmp/ssd_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/.gpu/site:$PWD/.gpu/peers:$PWD:${PYTHONPATH:-}
PP=$(mktemp -d) && ln -s "$PWD/kernels" "$PP/lm_kernels" && export PYTHONPATH=$PP:$PYTHONPATH
export PYTHONUNBUFFERED=1
TAG=${NCU_TAG:-dx}
read -r -a CASES <<<"${NCU_CASES:-ours=}"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
T=$(date +%s)
REP=/tmp/ncu_$TAG
timeout "${NCU_TIMEOUT_S:-240}" "$NCU" --profile-from-start off --clock-control none --set full \
  --import-source yes --kernel-name "${NCU_KERNELS:-regex:dx_bwd}" -f -o "$REP" \
  python3 scripts/ncu_ssd.py --cases "${CASES[@]}" ${NCU_ARGS:-} >"$OUT/ncu_run_$TAG.log" 2>&1
echo "ncu rc=$? in $(( $(date +%s) - T )) s"
"$NCU" --import "$REP.ncu-rep" --page details >"$OUT/ncu_src_$TAG.txt" 2>&1
"$NCU" --import "$REP.ncu-rep" --page source --csv --print-source sass >"$OUT/sass_$TAG.csv" 2>"$OUT/sass_$TAG.err" \
  || "$NCU" --import "$REP.ncu-rep" --page source --csv >"$OUT/sass_$TAG.csv" 2>>"$OUT/sass_$TAG.err"
ls -la "$OUT"; head -c 600 "$OUT/sass_$TAG.err"
grep -E "Warp Cycles Per Issued|Stall|Duration|Achieved Occupancy" "$OUT/ncu_src_$TAG.txt" | head -40
