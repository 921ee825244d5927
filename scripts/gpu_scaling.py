"""Scaling over GPUs (run by scripts/gpu_scaling.sh): the same `lm train` run (DeepSpeed ZeRO-2, synthetic data,
the same global batch by gradient accumulation) at each world size, for each case; one JSON and a table.

Per case and world size N: tokens/s per GPU (median over the steps after the warmup), scaling efficiency
(tokens/s per GPU at N over that at 1), rank 0's peak memory, every step's loss, and the largest relative
difference of the per-step losses from the 1-GPU run (bf16 reductions in another order: bf16 noise, not 0).

    python scripts/gpu_scaling.py --out DIR [--gpus 1,2,4,8] [--cases ...] [--steps 16] [--warmup 4]
    python scripts/gpu_scaling.py --out DIR --dry-run      # CPU (gloo): tiny presets at 1 and 2 ranks, fp32

--context-parallel: at N GPUs each sequence is N x --seq-len tokens, split over the N ranks (train.context_parallel=N,
one context group): the same tokens per GPU and step as the 1-GPU run at --seq-len, so the efficiency is the per-GPU
tokens/s of an N-times longer sequence over N GPUs against one GPU's at --seq-len (e.g. --seq-len 32768 --gpus 1,4
--max-world 4 --micro 1: 128k tokens on 4 GPUs against 32k on one). The runs' data differ: no loss comparison.
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

from lm.train.distributed import free_port

# name -> (preset, model overrides, implicit settings or None, micro-batch on an H100)
CASES = {
    "mamba2-350m-explicit": ("lm_mamba2-350m", {}, None, 8),
    "mamba2-350m-implicit-4+1": ("lm_mamba2-350m", {}, {"max_iter": 4, "phantom_steps": 1}, 8),
    "llama-1.3b-explicit": ("lm_llama-1.3b", {}, None, 4),
    "llama-1.3b-implicit-4+1": ("lm_llama-1.3b", {}, {"max_iter": 4, "phantom_steps": 1}, 4),
    # the Mamba2 + attention hybrid, implicit: its losses on N GPUs against 1 GPU (issue 59)
    "hybrid-350m-implicit-4+1": ("lm_hybrid-mamba2-350m", {}, {"max_iter": 4, "phantom_steps": 1}, 8),
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
    "hybrid-tiny-implicit-4+1": ("lm_hybrid-tiny", {"hidden_size": 32, "layer_pattern": "M*D",
                                                    "attention": {"num_attention_heads": 2},
                                                    "mamba2": {"d_state": 8, "headdim": 16, "chunk_size": 16},
                                                    "deltaproduct": {"num_heads": 2, "chunk_size": 16,
                                                                     "use_forget_gate": True},
                                                    "intermediate_size": 64},
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
    """In place, per run: scaling efficiency and per-step loss differences against the 1-GPU DeepSpeed run, and
    tokens/s per GPU against the 1-GPU plain-engine run ('plain', if made)."""
    base, plain = runs.get("1"), runs.get("plain")
    for key, r in runs.items():
        if "losses" not in r:
            continue
        if plain and "losses" in plain:
            r["per_gpu_vs_plain_1"] = r["tokens_per_s_per_gpu"] / plain["tokens_per_s_per_gpu"]
        if not base or "losses" not in base:
            continue
        r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
        pairs = [(a, b) for a, b in zip(r["losses"], base["losses"]) if isinstance(a, float) and isinstance(b, float)]
        rel = [abs(a - b) / abs(b) for a, b in pairs if b != 0]
        r["max_rel_loss_diff_vs_1"] = max(rel) if rel else None
        r["mean_rel_loss_diff_vs_1"] = sum(rel) / len(rel) if rel else None
        r["losses_compared"] = len(rel)


def _order(key: str):
    return (0, 0) if key == "plain" else (1, int(key))


def table(results: dict) -> str:
    head = (f"{'case':<26} {'GPUs':>5} {'accum':>5} {'tok/s/GPU':>10} {'eff':>6} {'vs plain':>8} {'mem GB':>7} "
            f"{'max rel dloss':>13} {'loss first->last':>18}")
    lines = [head, "-" * len(head)]
    for case, runs in results.items():
        for key in sorted(runs, key=_order):
            r = runs[key]
            if "error" in r:
                lines.append(f"{case:<26} {key:>5} {'':>5} {'failed: ' + r['error']}")
                continue
            eff, vp = r.get("scaling_efficiency"), r.get("per_gpu_vs_plain_1")
            drel = r.get("max_rel_loss_diff_vs_1")
            losses = r["losses"]
            lines.append(f"{case:<26} {key:>5} {r['accumulation']:>5} {r['tokens_per_s_per_gpu']:>10.0f} "
                         f"{'' if eff is None else f'{eff:.3f}':>6} {'' if vp is None else f'{vp:.3f}':>8} "
                         f"{r['peak_mem_gb'] or 0:>7.2f} {'' if drel is None else f'{drel:.2e}':>13} "
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
    ap.add_argument("--micro", type=int, default=None,
                    help="micro-batch per GPU for every case (default: each case's own, the CASES table)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4, help="first steps left out of tokens/s (compile, allocator)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--compile", default="on", choices=["on", "off"])
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--plain-ref", nargs="?", const="all", default=None, metavar="CASES",
                    help="also these cases (comma-separated; all if none named) on 1 GPU with the plain torch "
                         "engine (key 'plain'): the reference of DeepSpeed's own cost")
    ap.add_argument("--parallel", action="store_true",
                    help="run jobs side by side on free GPUs of the machine (the 1-GPU runs of all cases at once, "
                         "then two 2-GPU runs, ...); without it one run at a time")
    ap.add_argument("--context-parallel", action="store_true",
                    help="at N GPUs, sequences of N x --seq-len tokens over N context ranks (see the docstring)")
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

    # jobs: (case, key, world, engine); key "1", "2", ... (DeepSpeed) and "plain" (the torch engine on 1 GPU)
    jobs = [(case, str(n), n, "deepspeed") for case in names for n in worlds]
    if args.plain_ref:
        plain = names if args.plain_ref == "all" else [c for c in args.plain_ref.split(",") if c in names]
        jobs += [(case, "plain", 1, "torch") for case in plain]
    jobs.sort(key=lambda j: (j[2], j[3] == "deepspeed"))  # 1-GPU references first
    n_gpus = 64 if args.dry_run else len(_visible())
    if max(worlds) > n_gpus:
        print(f"gpu_scaling: --gpus {args.gpus} needs {max(worlds)} GPUs, {n_gpus} visible", file=sys.stderr)
        return 2
    results: dict = {case: {} for case in names}

    def write_doc():
        for runs in results.values():
            compare(runs)
            if args.context_parallel:  # other sequences at each world size: their losses do not compare
                for r in runs.values():
                    for k in ("max_rel_loss_diff_vs_1", "mean_rel_loss_diff_vs_1", "losses_compared"):
                        r.pop(k, None)
        doc = {"settings": {"gpus": worlds, "max_world": args.max_world, "seq_len": args.seq_len,
                            "steps": args.steps, "warmup": args.warmup, "precision": args.precision,
                            "compile": args.compile, "engine": "deepspeed",
                            "zero_stage": 2, "data": "synthetic", "dry_run": args.dry_run,
                            "parallel": args.parallel, "context_parallel": args.context_parallel},
               "device": _device(args.dry_run),
               "cases": {c: {k: runs[k] for k in sorted(runs, key=_order)} for c, runs in results.items()}}
        (out / "scaling.json").write_text(json.dumps(doc, indent=1))

    def launch(job, gpu_ids):
        case, key, n, engine = job
        preset, overrides, implicit, micro = cases[case]
        micro = args.micro or micro
        global_tokens = micro * args.seq_len * args.max_world
        name = f"{case}-{'plain' if engine == 'torch' else 'gpu'}{n}"
        run_dir, cfg_path = out / "runs" / name, out / "runs" / f"{name}.json"
        cfg_path.parent.mkdir(parents=True, exist_ok=True)
        if run_dir.exists():  # a re-run of the script: fresh runs
            shutil.rmtree(run_dir)
        cp = n if args.context_parallel and engine == "deepspeed" else 1
        cfg = run_config(run_dir, preset, overrides, implicit, seq_len=args.seq_len * cp, micro=micro,
                         global_tokens=global_tokens, steps=args.steps, precision=args.precision,
                         compile_=args.compile == "on")
        cfg["train"]["engine"] = engine
        cfg["train"]["context_parallel"] = cp
        cfg_path.write_text(json.dumps(cfg))
        # one launcher for every N (also 1): the same process setup at each world size
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
               "-m", "lm.train", str(cfg_path)]
        run_env = dict(env)
        if args.dry_run:  # runs side by side on one host need their own rendezvous ports
            cmd[3:4] = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}"]
        else:
            run_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        log = out / "runs" / f"{name}.log"
        print(f"== {case} [{key}] on {'ranks' if args.dry_run else 'GPUs ' + ','.join(gpu_ids)}: "
              f"{' '.join(cmd[2:])}", flush=True)
        f = open(log, "w")
        proc = subprocess.Popen(cmd, env=run_env, stdout=f, stderr=subprocess.STDOUT)
        return {"job": job, "proc": proc, "file": f, "log": log, "run_dir": run_dir, "t0": time.time(),
                "gpus": gpu_ids, "global_tokens": global_tokens, "micro": micro}

    def finish(r, rc):
        r["file"].close()
        case, key, n, engine = r["job"]
        wall = time.time() - r["t0"]
        if rc != 0:
            tail = r["log"].read_text()[-3000:]
            oom = "out of memory" in tail.lower()
            results[case][key] = {"error": "out of memory" if oom else f"exit {rc}", "wall_s": wall,
                                  "log": str(r["log"]), "log_tail": tail, "engine": engine}
            print(f"   {case} [{key}] failed ({results[case][key]['error']}), log {r['log']}:\n{tail[-1500:]}",
                  flush=True)
        else:
            res = read_run(r["run_dir"], n, args.warmup)
            res.update(wall_s=wall, global_batch_tokens=r["global_tokens"], micro_batch_size=r["micro"],
                       log=str(r["log"]), engine=engine, gpus=r["gpus"])
            results[case][key] = res
            print(f"   {case} [{key}]: {res['tokens_per_s_per_gpu']:.0f} tok/s per GPU, accumulation "
                  f"{res['accumulation']}, peak {res['peak_mem_gb']:.2f} GB, {wall:.0f} s", flush=True)
        write_doc()

    free = (_visible() if not args.dry_run else [str(i) for i in range(64)])[:n_gpus]
    pending, running = list(jobs), []
    while pending or running:
        for job in list(pending):  # first fit, in order; side by side only with --parallel
            if job[2] <= len(free) and (args.parallel or not running):
                ids, free = free[:job[2]], free[job[2]:]
                running.append(launch(job, ids))
                pending.remove(job)
        time.sleep(0.5)
        for r in list(running):
            rc = r["proc"].poll()
            if rc is None and time.time() - r["t0"] > args.timeout:
                r["proc"].kill()
                r["proc"].wait()
                rc = "timeout"
            if rc is not None:
                running.remove(r)
                free = sorted(free + r["gpus"], key=int)
                finish(r, rc)
    write_doc()

    print()
    print(table(results))
    print(f"\nwrote {out / 'scaling.json'}")
    failed = [f"{c}@{n}" for c, runs in results.items() for n, r in runs.items() if "error" in r]
    if failed:
        print(f"failed runs: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _visible() -> list[str]:
    """The GPU ids this script may hand out: CUDA_VISIBLE_DEVICES if set, else every GPU nvidia-smi lists."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return [x.strip() for x in env.split(",") if x.strip()]
    try:
        n = len(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout.splitlines())
    except (OSError, subprocess.SubprocessError):
        n = 0
    return [str(i) for i in range(max(n, 1))]


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
