#!/usr/bin/env python
"""What each of lm's DeepSpeed overrides (lm.train.engine.OVERRIDES) gains on this machine: the DeepSpeed engine's
median step time with every override installed, with none, and with each one left out in turn (DeepSpeed's own method
instead), and the time of a checkpoint save with and without the hashing writer. An override is kept where it gains
5% or more of the step (or of the save, for the writer).

    python scripts/dev/deepspeed_overrides_ab.py --out ds_overrides.json                     # one GPU, ZeRO-2
    torchrun --nproc_per_node 2 scripts/dev/deepspeed_overrides_ab.py --out ds_overrides.json  # two ranks
    python scripts/dev/deepspeed_overrides_ab.py --preset lm_mamba2-tiny --seq-len 64 --micro 2 --steps 3 --warmup 1 \\
        --rounds 1 --precision fp32 --device cpu                                          # CPU smoke (no figures)

The variants run in one process, one after the other and in `--rounds` rounds (the order alternating), each a fresh
run of `--warmup` + `--steps` steps on synthetic tokens with the fused AdamW under bf16 (where skip_on_device
applies); the step time is the median of metrics.jsonl's step_time after the warm-up. Rank 0 prints the table and
writes --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def run_variant(args, off: set, tag: str) -> dict:
    """One training run with the overrides in `off` left to DeepSpeed: (median step time, checkpoint save time)."""
    import lm.train.checkpoint as ckpt
    import lm.train.engine as E
    from lm.resources import configs_dir
    from lm.train.config import config_from_dict
    from lm.train.metrics import read_metrics
    from lm.train.trainer import train

    tested = E.use_override
    E.use_override = lambda name: name not in off and tested(name)
    saves = []
    save = ckpt.save

    def timed_save(*a, **k):
        t0 = time.perf_counter()
        out = save(*a, **k)
        saves.append(time.perf_counter() - t0)
        return out

    ckpt.save = timed_save
    vocab = json.loads(configs_dir("models").joinpath(f"{args.preset}.json").read_text())["vocab_size"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = Path(args.run_root) / tag
    cfg = config_from_dict({
        "run_dir": str(run_dir),
        "model": {"preset": args.preset, "compile": args.compile},
        "data": {"source": "synthetic", "seq_len": args.seq_len, "synthetic_vocab": vocab},
        "optim": {"lr": 1e-4},
        "schedule": {"kind": "constant", "warmup": 0},
        "train": {"steps": args.warmup + args.steps, "micro_batch_size": args.micro, "engine": "deepspeed",
                  "global_batch_tokens": args.micro * args.seq_len * world, "precision": args.precision,
                  "zero_stage": args.zero_stage, "device": args.device},
        "checkpoint": {"at_end": True, "export": False, "keep_last": 1},
        "log": {"progress": False},
        "eval": {"at_end": False, "sample_tokens": 0},
    })
    try:
        train(cfg)
    finally:
        E.use_override, ckpt.save = tested, save
    times = [r["step_time"] for r in read_metrics(run_dir) if "event" not in r and r["step"] > args.warmup]
    return {"step_s": statistics.median(times) if times else float("nan"), "save_s": saves[-1] if saves else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="lm_mamba2-350m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="steps dropped (compilation, autotuning)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--zero-stage", type=int, default=2, choices=[1, 2])
    ap.add_argument("--compile", action="store_true", help="model.compile (compiled blocks)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--run-root", default=None, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--out", default=None, help="JSON of the table (rank 0)")
    args = ap.parse_args(argv)
    args.run_root = args.run_root or tempfile.mkdtemp(prefix="ds-overrides-")
    import lm.train.engine as E
    from lm.train.trainer import shutdown

    names = list(E.OVERRIDES)
    variants = [("all", set()), ("none", set(names))] + [(f"without {n}", {n}) for n in names]
    results: dict = {label: [] for label, _ in variants}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for label, off in order:
            results[label].append(run_variant(args, off, f"r{r}-{label.replace(' ', '-')}"))
    shutdown()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    med = {label: {k: statistics.median(v[k] for v in runs if v[k] is not None) if any(v[k] is not None for v in runs)
                   else None for k in ("step_s", "save_s")} for label, runs in results.items()}
    base = med["all"]
    table = {"preset": args.preset, "seq_len": args.seq_len, "micro": args.micro, "precision": args.precision,
             "zero_stage": args.zero_stage, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
             "deepspeed": ".".join(map(str, E.deepspeed_version())), "variants": med, "gain": {}}
    for n in names:
        key = "save_s" if n == "hashing_writer" else "step_s"
        without = med[f"without {n}"][key]
        table["gain"][n] = (without / base[key] - 1.0) if without and base[key] else None
    print(json.dumps(table, indent=1))
    for n, g in table["gain"].items():
        print(f"{n:20s} {'?' if g is None else f'{100 * g:+.1f}%'} ({'keep' if g is not None and g >= 0.05 else 'drop'}"
              f" at the 5% bar)")
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
