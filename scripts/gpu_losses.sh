#!/usr/bin/env bash
# Per-step losses of this tree against an older one on a GPU: 200 optimizer steps on the default corpus (the
# Shakespeare shards, prepared on the CPU machine and carried: CORPUS) with this tree and with an older one (BEFORE:
# `git archive <commit>` unpacked), bf16, plain engine, same seed and data order; per-step losses side by side in
# $OUT/losses.json and a table.
#   Mamba2-130M explicit: now compiled, now eager, before eager (a compiled path of an older tree may carry its own
#   bugs: torch 2.11's compiled RMSNorm once dropped its gradient); implicit (4+1) Mamba2-130M and DeltaProduct-213M
#   n_h=2: now compiled, before eager. "now eager vs now compiled" is the size of compile / reduction-order noise.
# Run from the repository root: OUT=/tmp/l CORPUS=.corpus/shakespeare BEFORE=.before bash scripts/gpu_losses.sh
# Env: STEPS (200), SEQ (1024), MICRO (8), SEED (0), CASES (all: m2, m2i, dp; dpe: DeltaProduct now eager and before eager).
set -u
OUT=${OUT:-/tmp/gpu_losses_out}; mkdir -p "$OUT"
CORPUS=$(cd "${CORPUS:-.corpus/shakespeare}" && pwd)
BEFORE=${BEFORE:+$(cd "$BEFORE" && pwd)}
NOW=$PWD
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
STEPS=${STEPS:-200} SEQ=${SEQ:-1024} MICRO=${MICRO:-8}
run() {  # name tree preset implicit(json|null) compile(true|false)
  local name=$1 tree=$2 preset=$3 implicit=$4 compile=$5
  cat > "$OUT/$name.json" <<JSON
{"run_dir": "$OUT/runs/$name",
 "model": {"preset": "$preset", "implicit": $implicit, "compile": $compile},
 "data": {"source": "shards", "path": "$CORPUS", "seq_len": $SEQ},
 "optim": {"lr": 1.0e-3},
 "schedule": {"kind": "cosine", "warmup": 20, "min_lr": 1.0e-4},
 "train": {"steps": $STEPS, "micro_batch_size": $MICRO, "global_batch_tokens": $((MICRO * SEQ)),
           "precision": "bf16", "engine": "torch", "seed": ${SEED:-0}},
 "checkpoint": {"every_steps": 0, "at_end": false, "export": false},
 "log": {"progress": false, "every_steps": 1},
 "eval": {"at_end": false, "sample_tokens": 0}}
JSON
  local t0=$(date +%s)
  (cd "$tree" && PYTHONPATH="$tree" timeout ${RUN_TIMEOUT:-300} python3 -m lm.train "$OUT/$name.json" > "$OUT/$name.log" 2>&1)
  echo "$name: exit $? in $(( $(date +%s) - t0 )) s"
}
IMP='{"max_iter": 4, "phantom_steps": 1}'
for c in $(echo "${CASES:-m2,m2i,dp}" | tr ',' ' '); do
  case $c in
    m2) run m2-now-compiled "$NOW" lm_mamba2-130m null true
        run m2-now-eager "$NOW" lm_mamba2-130m null false
        [ -n "$BEFORE" ] && run m2-before-eager "$BEFORE" lm_mamba2-130m null false ;;
    m2i) run m2i-now-compiled "$NOW" lm_mamba2-130m "$IMP" true
         [ -n "$BEFORE" ] && run m2i-before-eager "$BEFORE" lm_mamba2-130m "$IMP" false ;;
    dp) run dp-now-compiled "$NOW" lm_deltaproduct-213m-nh2 null true
        [ -n "$BEFORE" ] && run dp-before-eager "$BEFORE" lm_deltaproduct-213m-nh2 null false ;;
    dpe) run dp-now-eager "$NOW" lm_deltaproduct-213m-nh2 null false
         [ -n "$BEFORE" ] && run dp-before-eager "$BEFORE" lm_deltaproduct-213m-nh2 null false ;;
  esac
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
for d in sorted((out / "runs").glob("*")):
    f = d / "metrics.jsonl"
    if f.is_file():
        recs = [json.loads(x) for x in open(f)]
        runs[d.name] = [r["loss"] for r in sorted((r for r in recs if "event" not in r), key=lambda r: r["step"])]
res = {"losses": runs, "pairs": {}}
for a, b in [("m2-now-compiled", "m2-now-eager"), ("m2-now-eager", "m2-before-eager"),
             ("m2-now-compiled", "m2-before-eager"), ("m2i-now-compiled", "m2i-before-eager"),
             ("dp-now-compiled", "dp-before-eager"), ("dp-now-eager", "dp-before-eager"),
             ("dp-now-compiled", "dp-now-eager")]:
    if a in runs and b in runs and runs[a] and len(runs[a]) == len(runs[b]):
        x, y = runs[a], runs[b]
        rel = [abs(p - q) / abs(q) for p, q in zip(x, y)]
        tail = lambda v: sum(v[-20:]) / len(v[-20:])  # noqa: E731
        res["pairs"][f"{a} vs {b}"] = {"max_rel_first20": max(rel[:20]), "max_rel": max(rel),
                                       "last20_mean": [tail(x), tail(y)], "first_last": [x[0], x[-1], y[0], y[-1]]}
        print(f"{a:18s} vs {b:18s}: first 20 steps max rel {max(rel[:20]):.2e}, all {max(rel):.2e}; "
              f"mean loss of the last 20 steps {tail(x):.4f} vs {tail(y):.4f} (first {x[0]:.3f} / {y[0]:.3f})")
(out / "losses.json").write_text(json.dumps(res, indent=1))
PY
