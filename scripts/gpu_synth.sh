#!/usr/bin/env bash
# The state-tracking experiments (a)-(e) of issue #9 on one GPU, side by side: each line of a suite
# file is "NAME RECIPE [key=value ...]"; every run is its own `lm synth` process with a wall-clock
# budget (train.max_minutes, the LR schedule follows it), sharing the GPU. Results (results.json +
# accuracy_per_length.png per run, logs, a summary table) go to OUT_DIR and into one tarball.
#
#   scripts/gpu_synth.sh lm/configs/synth/gpu_suite.txt 7.5 runs/synth_gpu
#
# The small synthetic models leave an H100 mostly idle; 8 concurrent runs fit in memory and CPU.
#
# Longer than one allocation: MINUTES is then the whole budget and SLICE=m stops every run after m
# minutes with a checkpoint in OUT_DIR/NAME/checkpoints; the same command again resumes each run from it
# (the LR schedule counts the training time of every slice):
#   SLICE=8 scripts/gpu_synth.sh SUITE 16 runs/synth_gpu   # twice
set -uo pipefail
SUITE=${1:?suite file}
MINUTES=${2:-7.5}
OUT_DIR=${3:-runs/synth_gpu}
mkdir -p "$OUT_DIR"
pids=()
while read -r name recipe rest || [[ -n "${name:-}" ]]; do
  [[ -z "${name:-}" || "$name" == \#* ]] && continue
  envs=(); overrides=()
  for tok in $rest; do  # LM_*=value tokens set the environment of that run (e.g. a kernel backend)
    if [[ "$tok" =~ ^LM_[A-Z_]+= ]]; then envs+=("$tok"); else overrides+=("$tok"); fi
  done
  if [[ -n "${SLICE:-}" ]]; then overrides+=("train.stop_after_minutes=$SLICE"); fi
  how="started"
  if [[ -f "$OUT_DIR/$name/checkpoints/latest" ]]; then  # an earlier slice of this run
    if grep -q '"complete": true' "$OUT_DIR/$name/results.json" 2>/dev/null; then echo "done: $name"; continue; fi
    overrides+=("resume=auto"); how="resumed"
  fi
  env "${envs[@]}" python -m lm.cli synth "$recipe" name="$name" output_dir="$OUT_DIR/$name" \
    device="${DEVICE:-cuda}" --quiet train.max_minutes="$MINUTES" train.eval_every=0 "${overrides[@]}" \
    >>"$OUT_DIR/$name.log" 2>&1 &
  pids+=($!)
  echo "$how $name ($recipe $rest)"
done <"$SUITE"
for p in "${pids[@]}"; do wait "$p"; done
python - "$OUT_DIR" <<'EOF'
import json, sys
from pathlib import Path
from lm.eval.synthetic import iterations_of
out = Path(sys.argv[1])
rows = []
for f in sorted(out.glob("*/results.json")):
    r = json.loads(f.read_text())
    m = r["task"]["metric"]
    acc = {k: round(v[m], 3) for k, v in r["eval"].items()}
    last = {k: round(v["last_accuracy"], 3) for k, v in r["eval"].items()}
    it = {k: round(iterations_of(v), 1) for k, v in r["eval"].items() if iterations_of(v) is not None}
    tl = r["train_log"][-1] if r["train_log"] else {}
    rows.append({"name": r["name"], "steps": r["steps_run"], "complete": r.get("complete", True), "train_s": round(r["train_time_s"]),
                 "params": r["parameters"], "final_loss": tl.get("loss"), "train_acc": tl.get("running_accuracy"),
                 "metric": m, "per_length": acc, "last_accuracy": last, "iterations": it, "summary": r["summary"]})
    print(f"{r['name']:34s} steps {r['steps_run']:6d}{'' if r.get('complete', True) else ' (sliced)'} loss {tl.get('loss', float('nan')):.3f} "
          f"train_acc {tl.get('running_accuracy', float('nan')):.3f}\n    {m}: {acc}"
          + (f"\n    last: {last}" if m != "last_accuracy" else "")
          + (f"\n    iters: {it}" if it else ""))
(out / "summary.json").write_text(json.dumps(rows, indent=1))
EOF
for f in "$OUT_DIR"/*.log; do
  if ! grep -q '"steps"' "$f"; then echo "== $f (failed?)"; tail -20 "$f"; fi
done
