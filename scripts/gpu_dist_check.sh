#!/usr/bin/env bash
# Issue #7's multi-GPU check: the same training (implicit (4+1) Mamba2-130M on the default corpus, bf16,
# DeepSpeed ZeRO-2, equal global batch) on 1 GPU with gradient accumulation 2, on 2 GPUs under torchrun,
# and on 2 GPUs under the deepspeed launcher; the per-step losses must agree (bf16 reductions differ in
# order, so they agree to bf16 noise, not bit for bit). Writes OUT_DIR/dist_check.json.
#
#   scripts/gpu_dist_check.sh OUT_DIR [STEPS]     (needs 2 GPUs, deepspeed, data/shakespeare prepared)
#   CPU smoke test: DS_ACCELERATOR=cpu PRESET=lm_mamba2-tiny SEQ=64 PRECISION=fp32 scripts/gpu_dist_check.sh /tmp/d 3
set -euo pipefail
OUT=${1:?output folder}
STEPS=${2:-40}
mkdir -p "$OUT"
cfg="$OUT/dist_check.yaml"
cat >"$cfg" <<EOF
model: {preset: ${PRESET:-lm_mamba2-130m}, implicit: {max_iter: 4, phantom_steps: 1}}
data: {path: data/shakespeare, seq_len: ${SEQ:-512}}
optim: {lr: 1.0e-3}
schedule: {kind: cosine, warmup: 5, min_lr: 1.0e-4}
train: {steps: $STEPS, global_batch_tokens: $((16 * ${SEQ:-512})), micro_batch_size: 8, precision: ${PRECISION:-bf16}, engine: deepspeed,
        zero_stage: 2, seed: 0}
checkpoint: {every_steps: 20, keep_last: 2, export: false}
log: {progress: false}
eval: {batches: 2, sample_tokens: 0}
EOF
port=$((29500 + RANDOM % 1000))
echo "== 1 GPU, accumulation 2"
CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node 1 --master_port $port -m lm.train "$cfg" run_dir="$OUT/gpu1" \
  >"$OUT/gpu1.log" 2>&1 || { tail -40 "$OUT/gpu1.log"; exit 1; }
echo "== 2 GPUs (torchrun), accumulation 1"
torchrun --nproc_per_node 2 --master_port $((port + 1)) -m lm.train "$cfg" run_dir="$OUT/gpu2" \
  >"$OUT/gpu2.log" 2>&1 || { tail -40 "$OUT/gpu2.log"; exit 1; }
echo "== 2 GPUs (deepspeed launcher), micro-batch 4, accumulation 2"
deepspeed --num_gpus 2 --master_port $((port + 2)) --module lm.train "$cfg" run_dir="$OUT/gpu2_ds" \
  train.micro_batch_size=4 >"$OUT/gpu2_ds.log" 2>&1 || { tail -40 "$OUT/gpu2_ds.log"; exit 1; }
python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def run(name):
    recs = [json.loads(l) for l in open(out / name / "metrics.jsonl")]
    steps = {r["step"]: r for r in recs if "event" not in r}
    start = next(r for r in recs if r.get("event") == "start")
    return steps, start
runs = {n: run(n) for n in ("gpu1", "gpu2", "gpu2_ds")}
base, s1 = runs["gpu1"]
res = {"gpu1": {"world_size": s1.get("world_size"), "accumulation": s1.get("accumulation")}}
print(f"gpu1: world {s1.get('world_size')} accumulation {s1.get('accumulation')}")
for name in ("gpu2", "gpu2_ds"):
    other, st = runs[name]
    rel = [abs(other[k]["loss"] - base[k]["loss"]) / abs(base[k]["loss"]) for k in base]
    res[name] = {"world_size": st.get("world_size"), "accumulation": st.get("accumulation"),
                 "max_rel_loss_diff": max(rel), "mean_rel_loss_diff": sum(rel) / len(rel),
                 "final_loss": other[max(other)]["loss"], "tokens_per_s": other[max(other)].get("tokens_per_s")}
    print(f"{name}: world {st.get('world_size')} accumulation {st.get('accumulation')}  per-step loss vs 1 GPU: "
          f"max rel diff {max(rel):.2e}, mean {sum(rel) / len(rel):.2e}")
res["losses"] = {n: [steps[k]["loss"] for k in sorted(base)] for n, (steps, _) in runs.items()}
res["gpu1_final_loss"] = base[max(base)]["loss"]
print("loss step 1 -> last:", {n: (v[0], v[-1]) for n, v in res["losses"].items()})
(out / "dist_check.json").write_text(json.dumps(res, indent=1))
EOF
