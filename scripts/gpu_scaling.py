"""Scaling over GPUs (run by scripts/gpu_scaling.sh): the same `lm train` run (DeepSpeed ZeRO-2, synthetic data,
the same global batch by gradient accumulation) at each world size, for each case; one JSON and a table.

Per case and world size N: tokens/s per GPU (median over the steps after the warmup), scaling efficiency
(tokens/s per GPU at N over that at 1), rank 0's peak memory, every step's loss, and the largest relative
difference of the per-step losses from the 1-GPU run (bf16 reductions in another order: bf16 noise, not 0).

    python scripts/gpu_scaling.py --out DIR [--gpus 1,2,4,8] [--cases ...] [--steps 16] [--warmup 4]
    python scripts/gpu_scaling.py --out DIR --dry-run      # CPU (gloo): tiny presets at 1 and 2 ranks, fp32
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# name -> (preset, model overrides, implicit settings or None, micro-batch on an H100)
CASES = {
    "mamba2-350m-explicit": ("lm_mamba2-350m", {}, None, 8),
    "mamba2-350m-implicit-4+1": ("lm_mamba2-350m", {}, {"max_iter": 4, "phantom_steps": 1}, 8),
    "llama-1.3b-explicit": ("lm_llama-1.3b", {}, None, 4),
    "llama-1.3b-implicit-4+1": ("lm_llama-1.3b", {}, {"max_iter": 4, "phantom_steps": 1}, 4),
}
# --dry-run: the same families, tiny
TINY = {
    "mamba2-tiny-explicit": ("lm_mamba2-tiny", {"hidden_size": 32, "num_hidden_layers": 2, "d_state": 8,
                                                "headdim": 16, "chunk_size": 16}, None, 2),
    "mamba2-tiny-implicit-4+1": ("lm_mamba2-tiny", {"hidden_size": 32, "num_hidden_layers": 2, "d_state": 8,
                                                    "headdim": 16, "chunk_size": 16},
                                 {"max_iter": 4, "phantom_steps": 1}, 2),
    "llama-tiny-explicit": ("lm_llama-tiny", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                              "intermediate_size": 64}, None, 2),
    "llama-tiny-implicit-4+1": ("lm_llama-tiny", {"hidden_size": 32, "num_hidden_layers": 2,
                                                  "num_attention_heads": 2, "intermediate_size": 64},
                                {"max_iter": 4, "phantom_steps": 1}, 2),
}


def run_config(run_dir: Path, preset: str, overrides: dict, implicit, *, seq_len: int, micro: int,
               global_tokens: int, steps: int, precision: str, compile_: bool) -> dict:
    return {
        "run_dir": str(run_dir),
        "model": {"preset": preset, "overrides": overrides, "implicit": implicit, "compile": compile_},
        "data": {"source": "synthetic", "seq_len": seq_len},
        "optim": {"lr": 1.0e-3},
        "schedule": {"kind": "cosine", "warmup": 5, "min_lr": 1.0e-4},
        "train": {"steps": steps, "global_batch_tokens": global_tokens, "micro_batch_size": micro,
                  "precision": precision, "engine": "deepspeed", "zero_stage": 2, "seed": 0},
        "checkpoint": {"every_steps": 0, "at_end": False, "export": False},
        "log": {"progress": False, "every_steps": 1},
        "eval": {"at_end": False, "sample_tokens": 0},
    }


def read_run(run_dir: Path, world: int, warmup: int) -> dict:
    recs = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    steps = sorted((r for r in recs if "event" not in r), key=lambda r: r["step"])
    start = next(r for r in recs if r.get("event") == "start")
    timed = [r["tokens_per_s"] for r in steps if r["step"] > warmup and isinstance(r.get("tokens_per_s"), float)]
    tps = statistics.median(timed) if timed else float("nan")
    return {"world_size": start["world_size"], "accumulation": start["accumulation"], "params": start["params"],
            "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world,
            "step_time_s": statistics.median(r["step_time"] for r in steps if r["step"] > warmup) if timed else None,
            "peak_mem_gb": max((r.get("mem_gb") or 0.0) for r in steps) if steps else None,
            "mfu": statistics.median(r["mfu"] for r in steps if r["step"] > warmup) if timed else None,
            "losses": [r["loss"] for r in steps]}


def compare(runs: dict) -> None:
    """Scaling efficiency and per-step loss differences against the 1-GPU run, in place."""
    base = runs.get(1)
    if not base or "losses" not in base:
        return
    for n, r in runs.items():
        if "losses" not in r:
            continue
        r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
        pairs = [(a, b) for a, b in zip(r["losses"], base["losses"]) if isinstance(a, float) and isinstance(b, float)]
        rel = [abs(a - b) / abs(b) for a, b in pairs if b != 0]
        r["max_rel_loss_diff_vs_1"] = max(rel) if rel else None
        r["mean_rel_loss_diff_vs_1"] = sum(rel) / len(rel) if rel else None
        r["losses_compared"] = len(rel)


def table(results: dict) -> str:
    head = (f"{'case':<26} {'GPUs':>4} {'accum':>5} {'tok/s/GPU':>10} {'eff':>6} {'mem GB':>7} "
            f"{'max rel dloss':>13} {'loss first->last':>18}")
    lines = [head, "-" * len(head)]
    for case, runs in results.items():
        for n, r in sorted(runs.items()):
            if "error" in r:
                lines.append(f"{case:<26} {n:>4} {'':>5} {'failed: ' + r['error']}")
                continue
            eff = r.get("scaling_efficiency")
            drel = r.get("max_rel_loss_diff_vs_1")
            losses = r["losses"]
            lines.append(f"{case:<26} {n:>4} {r['accumulation']:>5} {r['tokens_per_s_per_gpu']:>10.0f} "
                         f"{'' if eff is None else f'{eff:.3f}':>6} {r['peak_mem_gb'] or 0:>7.2f} "
                         f"{'' if drel is None else f'{drel:.2e}':>13} "
                         f"{losses[0]:>8.4f} -> {losses[-1]:<7.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (runs, logs, scaling.json)")
    ap.add_argument("--gpus", default="1,2,4,8", help="world sizes, comma-separated (1 first: the reference)")
    ap.add_argument("--cases", default=None, help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--max-world", type=int, default=8,
                    help="global batch = micro x seq_len x this, the same at every world size (8: 8-GPU runs "
                         "are comparable with runs made where fewer GPUs were lent)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of tokens/s (compile, allocator)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--compile", default="on", choices=["on", "off"])
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU (gloo, DS_ACCELERATOR=cpu): tiny presets, 1 and 2 ranks, seq 32, fp32, 4 steps")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    cases = TINY if args.dry_run else CASES
    if args.dry_run:
        args.gpus, args.max_world, args.seq_len, args.precision, args.compile = "1,2", 2, 32, "fp32", "off"
        args.steps, args.warmup = min(args.steps, 4), min(args.warmup, 1)
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    names = args.cases.split(",") if args.cases else list(cases)
    unknown = [n for n in names if n not in cases]
    if unknown:
        print(f"gpu_scaling: unknown case(s) {unknown}; choose from {list(cases)}", file=sys.stderr)
        return 2
    worlds = sorted({int(n) for n in args.gpus.split(",")})
    if worlds[0] != 1:
        print("gpu_scaling: --gpus must include 1 (the reference of the efficiency and loss comparison)",
              file=sys.stderr)
        return 2
    if max(worlds) > args.max_world:
        print(f"gpu_scaling: --gpus {args.gpus} exceeds --max-world {args.max_world}", file=sys.stderr)
        return 2

    results: dict = {}
    for case in names:
        preset, overrides, implicit, micro = cases[case]
        global_tokens = micro * args.seq_len * args.max_world
        results[case] = {}
        for n in worlds:
            run_dir = out / "runs" / f"{case}-gpu{n}"
            cfg_path = out / "runs" / f"{case}-gpu{n}.json"
            cfg_path.parent.mkdir(parents=True, exist_ok=True)
            if run_dir.exists():  # a re-run of the script: fresh runs
                shutil.rmtree(run_dir)
            cfg_path.write_text(json.dumps(run_config(run_dir, preset, overrides, implicit, seq_len=args.seq_len,
                                                      micro=micro, global_tokens=global_tokens, steps=args.steps,
                                                      precision=args.precision, compile_=args.compile == "on")))
            # one launcher for every N (also 1): the same engine and process setup at each world size
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                   "-m", "lm.train", str(cfg_path)]
            run_env = dict(env)
            if not args.dry_run:
                run_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(n))
            log = out / "runs" / f"{case}-gpu{n}.log"
            t0 = time.time()
            print(f"== {case} on {n} {'rank' if args.dry_run else 'GPU'}{'s' if n > 1 else ''}: "
                  f"{' '.join(cmd[2:])}", flush=True)
            try:
                with open(log, "w") as f:
                    rc = subprocess.run(cmd, env=run_env, stdout=f, stderr=subprocess.STDOUT,
                                        timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            wall = time.time() - t0
            if rc != 0:
                tail = log.read_text()[-3000:]
                oom = "out of memory" in tail.lower()
                results[case][n] = {"error": "out of memory" if oom else f"exit {rc}", "wall_s": wall,
                                    "log": str(log), "log_tail": tail}
                print(f"   failed ({results[case][n]['error']}), log {log}:\n{tail[-1500:]}", flush=True)
                continue
            r = read_run(run_dir, n, args.warmup)
            r.update(wall_s=wall, global_batch_tokens=global_tokens, micro_batch_size=micro, log=str(log))
            results[case][n] = r
            print(f"   {r['tokens_per_s_per_gpu']:.0f} tok/s per GPU, accumulation {r['accumulation']}, "
                  f"peak {r['peak_mem_gb']:.2f} GB, {wall:.0f} s", flush=True)
        compare(results[case])

    doc = {"settings": {"gpus": worlds, "max_world": args.max_world, "seq_len": args.seq_len, "steps": args.steps,
                        "warmup": args.warmup, "precision": args.precision, "compile": args.compile,
                        "engine": "deepspeed", "zero_stage": 2, "data": "synthetic", "dry_run": args.dry_run},
           "device": _device(args.dry_run),
           "cases": {c: {str(n): r for n, r in runs.items()} for c, runs in results.items()}}
    (out / "scaling.json").write_text(json.dumps(doc, indent=1))
    print()
    print(table(results))
    print(f"\nwrote {out / 'scaling.json'}")
    failed = [f"{c}@{n}" for c, runs in results.items() for n, r in runs.items() if "error" in r]
    if failed:
        print(f"failed runs: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _device(dry_run: bool) -> str:
    if dry_run:
        return "cpu"
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
