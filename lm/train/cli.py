"""`lm train [CONFIG.yaml] [key=value ...] [--resume] [--print-config]` (also `python -m lm.train`).

CONFIG is a YAML file or the name of a packaged recipe (`default`, `dpile-mamba2-350m`, ...;
`configs/train/NAME.yaml` also names one). Without CONFIG the packaged default (a small implicit Mamba2 on the
Shakespeare corpus, a few minutes on CPU) is used. Overrides are dotted keys with YAML values:
    lm train configs/train/default.yaml train.tokens=2e6 optim.lr=1e-3 run_dir=runs/try
Several processes: `deepspeed --num_gpus 8 --module lm.train CFG ...` or `torchrun --nproc_per_node 8 -m
lm.train CFG ...` (scripts/launch.sh for several nodes, scripts/slurm/train.sbatch on SLURM).

SIGTERM or Ctrl-C: the current step finishes, a checkpoint is written and the command exits with code 75
(a second signal exits at once; the last complete checkpoint stays). `--resume` continues; on a finished run
it says so and changes nothing. One trainer per run_dir (RUN/lock names the holder).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_CONFIG = "default"  # the packaged lm/configs/train/default.yaml


def main(argv: list[str] | None = None) -> int:
    # the usage line is argparse's; the rest of this module's doc is the description
    ap = argparse.ArgumentParser(prog="lm train", description=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("items", nargs="*", metavar="CONFIG.yaml | key=value")
    ap.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    ap.add_argument("--allow-change", action="append", default=[], metavar="KEY[,KEY]",
                    help="with --resume: accept these keys differing from the checkpoint's config although they "
                         "define the run (model, data, ...; checkpoint.allow_change)")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    config_path, overrides = None, []
    for item in args.items:
        if "=" in item:
            overrides.append(item)
        elif config_path is None:
            config_path = item
        else:
            print(f"lm train: expected one CONFIG.yaml and key=value overrides, got a second file {item!r}",
                  file=sys.stderr)
            return 2
    if config_path is None:
        config_path = DEFAULT_CONFIG
    if args.resume:
        overrides.append("checkpoint.resume=true")
    keys = [k.strip() for item in args.allow_change for k in item.split(",") if k.strip()]
    if keys:
        overrides.append(f"checkpoint.allow_change={json.dumps(keys)}")

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed (if imported) then skips GPU probing
    from .config import load_train_config

    try:
        cfg = load_train_config(config_path, overrides)
    except ValueError as err:
        print(f"lm train: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=1))
        return 0

    from .preempt import EXIT_PREEMPTED, Preempted
    from .trainer import TrainingStopped, shutdown, train

    main_rank = int(os.environ.get("RANK", "0")) == 0
    try:
        summary = train(cfg)
    except ValueError as err:
        print(f"lm train: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:
        print(f"lm train: {err}", file=sys.stderr)
        return 1
    except Preempted as err:
        if main_rank:
            print(f"lm train: {err}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:  # Ctrl-C before the training loop (which handles it) started
        print("lm train: interrupted before training started; nothing to resume from this attempt", file=sys.stderr)
        return 130
    finally:
        shutdown()
    if summary.get("finished"):
        if main_rank:
            print(f"lm train: {cfg.run_dir} is finished: its checkpoint {summary['checkpoint']} is at step "
                  f"{summary['steps']} of {summary['total_steps']}; nothing was trained or changed. To train longer, "
                  "raise train.steps / train.tokens; to start over, use another run_dir (`lm export "
                  f"{cfg.run_dir}` writes its Hugging Face folder again).", file=sys.stderr)
        return 0
    if main_rank:
        print(f"\ntrained {summary['steps']} steps, {summary['tokens']:,} tokens; final training loss "
              f"{summary['final_loss']:.4f}")
        if "val_ppl" in summary:
            print(f"held-out perplexity: {summary['val_ppl']:.2f} (loss {summary['val_loss']:.4f} over "
                  f"{summary['val_tokens']:,} tokens)")
        if "checkpoint" in summary:
            print(f"checkpoint: {summary['checkpoint']}")
        if "export" in summary:
            print(f"Hugging Face export: {summary['export']}  (import lm; AutoModelForCausalLM.from_pretrained(...))")
        if summary.get("sample"):
            print(f"sample:\n{summary['sample']}")
    return 0
