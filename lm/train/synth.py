"""`lm synth RECIPE.yaml [key=value ...]`: train a model on a synthetic task with `lm train` (data.source=task)
and evaluate its accuracy per length (RUN/results.json + accuracy_per_length.png), with the fixed-point
iterations per length of implicit models; `--compare RUN ...` overlays finished runs, `--list-tasks`.

A recipe (lm/configs/synth/*.yaml, found by name too) is a short form of a training config; this module
only translates it (`recipe_tree`), the training config validates it. Overrides use the recipe's dotted
keys (`train.steps=200`, `task.group=A5`, `model.implicit.max_iter=8`), values parsed as YAML:

    name: s5_mamba2              run name (results.json, plots); run_dir runs/synth/NAME unless output_dir
    seed: 0                      train.seed: model init and training data
    output_dir: null             run_dir
    device: auto                 auto | cpu | cuda (train.device)
    dtype: float32               float32 | bfloat16 (train.precision fp32 | bf16)
    task: {name: word_problem, group: S5, ...}   task.name and task.params (lm synth --list-tasks)
    model: {model_type: lm_mamba2, hidden_size: ..., implicit: null | {...}}  model.preset (the type's
                                  defaults), model.overrides, model.implicit; vocab_size and head are the task's
    train: steps, batch_size (train.micro_batch_size), lengths [min, max] (task.lengths; null = the task's),
           lr, weight_decay, betas, eps, grad_clip (optim.*), schedule cosine | linear | constant,
           warmup_steps | warmup_fraction, min_lr (schedule.*), examples (task.examples), target_accuracy
           (task.target_accuracy), max_minutes, stop_after_minutes (train.*), save_checkpoint
           (checkpoint.at_end), log_every (log.every_steps), eval_every (eval.every_steps)
    eval:  lengths, examples, batch_size, seed, task (task.eval_lengths, eval_examples, eval_batch_size,
           eval_seed, eval_params: task parameters changed for evaluation, e.g. {p: 0.5})
    save_model: false            checkpoint.export: the HF model in RUN/hf
    resume: null                 checkpoint.resume: a run folder / checkpoint, or auto (its checkpoint if any)

The loss is the cross-entropy over every position with a target, on the model's output at that position
(no next-token shift: the task's targets are aligned with its inputs).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import yaml

from .config import TrainConfig, apply_override, config_from_dict, read_tree

_SCHEDULES = {"cosine": {"kind": "cosine"}, "linear": {"kind": "wsd", "decay_start": 0.0},
              "constant": {"kind": "constant"}}
_PRECISION = {"float32": "fp32", "bfloat16": "bf16"}


def read_recipe(recipe: str | Path | dict, overrides=()) -> dict:
    """The recipe (a dict, a YAML path or the name of a packaged recipe) with `key=value` overrides applied."""
    tree = copy.deepcopy(recipe) if isinstance(recipe, dict) else read_tree(recipe, "synth", "recipe")
    for item in overrides:
        apply_override(tree, item)
    return tree


def recipe_tree(recipe: dict) -> dict:
    """A recipe -> the training-config tree it stands for (every recipe key is used; an unknown one is an error)."""
    from ..data.synthetic.registry import build_task

    r = copy.deepcopy(recipe)
    sections = {}
    for key in ("task", "model", "train", "eval"):
        v = r.pop(key, None)
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"recipe key {key!r} must be a mapping, got {v!r}")
        sections[key] = dict(v or {})
    task, model, tr, ev = sections["task"], sections["model"], sections["train"], sections["eval"]
    name = r.pop("name", "synth")
    if not task.get("name"):
        raise ValueError("recipe task.name: missing; one of the registered tasks (lm synth --list-tasks)")
    task_name = task.pop("name")
    try:
        t = build_task(task_name, **task)
    except ValueError as err:
        raise ValueError(f"recipe task: {err}") from None
    model_type = model.pop("model_type", None)
    if not model_type:
        raise ValueError("recipe model.model_type: missing (e.g. lm_mamba2, lm_llama)")
    if model.get("vocab_size", t.vocab_size) != t.vocab_size:
        raise ValueError(f"recipe model.vocab_size {model['vocab_size']} differs from the task's {t.vocab_size}; "
                         f"leave it out, it is set from the task")
    implicit = model.pop("implicit", None)
    lengths = tr.pop("lengths", None)
    seq_len = max(lengths if isinstance(lengths, list) and lengths else t.train_lengths)
    batch = tr.pop("batch_size", 64)
    device = r.pop("device", "auto")
    if isinstance(device, str) and device.startswith("cuda:"):
        raise ValueError(f"recipe device {device!r}: use device=cuda and choose the GPU with CUDA_VISIBLE_DEVICES")
    dtype = r.pop("dtype", "float32")
    if dtype not in _PRECISION:
        raise ValueError(f"recipe dtype: must be float32 or bfloat16, got {dtype!r}")
    schedule = tr.pop("schedule", "cosine")
    if schedule not in _SCHEDULES:
        raise ValueError(f"recipe train.schedule: must be cosine, linear or constant, got {schedule!r}")
    warmup_steps, warmup_fraction = tr.pop("warmup_steps", None), tr.pop("warmup_fraction", None)
    if warmup_steps is not None and warmup_fraction is not None:
        raise ValueError("recipe train.warmup_steps: set warmup_steps or warmup_fraction, not both")
    stop_after = tr.pop("stop_after_minutes", None)
    save_model = r.pop("save_model", False)
    resume = r.pop("resume", None)
    tree = {
        "run_dir": str(r.pop("output_dir", None) or Path("runs/synth") / str(name)),
        "model": {"preset": model_type, "overrides": {**model, "vocab_size": t.vocab_size, "head": t.head},
                  "implicit": implicit},
        "data": {"source": "task", "seq_len": seq_len},
        "task": {"name": task_name, "params": task, "lengths": lengths, "examples": tr.pop("examples", None),
                 "prefetch": 0 if device == "cpu" else 4, "target_accuracy": tr.pop("target_accuracy", None),
                 "eval_lengths": ev.pop("lengths", None), "eval_examples": ev.pop("examples", 512),
                 "eval_batch_size": ev.pop("batch_size", 256), "eval_seed": ev.pop("seed", 12345),
                 "eval_params": ev.pop("task", None) or {}, "run_name": str(name)},
        "optim": {"lr": tr.pop("lr", 1e-3), "betas": tr.pop("betas", [0.9, 0.999]), "eps": tr.pop("eps", 1e-8),
                  "weight_decay": tr.pop("weight_decay", 0.0), "grad_clip": tr.pop("grad_clip", None) or 0.0},
        "schedule": {**_SCHEDULES[schedule], "min_lr": tr.pop("min_lr", 0.0),
                     "warmup": warmup_fraction if warmup_fraction is not None else warmup_steps or 0},
        "train": {"steps": tr.pop("steps", 1000), "micro_batch_size": batch,
                  "global_batch_tokens": batch * seq_len if isinstance(batch, int) else batch,
                  "precision": _PRECISION[dtype], "engine": "torch", "device": device, "seed": r.pop("seed", 0),
                  "fused_loss": False, "max_minutes": tr.pop("max_minutes", None),
                  "stop_after_minutes": stop_after},
        "checkpoint": {"every_steps": 0, "keep_last": 1, "resume": False if resume is None else resume,
                       "export": bool(save_model),
                       "at_end": bool(tr.pop("save_checkpoint", False) or stop_after is not None or save_model)},
        "log": {"every_steps": tr.pop("log_every", 50)},
        "eval": {"every_steps": tr.pop("eval_every", 0), "sample_tokens": 0},
    }
    left = sorted(r) + [f"train.{k}" for k in sorted(tr)] + [f"eval.{k}" for k in sorted(ev)]
    if left:
        raise ValueError(f"unknown recipe key(s) {left}; see `lm synth --help` for the recipe keys")
    return tree


def load_recipe(recipe: str | Path | dict, overrides=()) -> TrainConfig:
    """The validated training config of a recipe with `key=value` overrides (recipe keys)."""
    tree = recipe_tree(read_recipe(recipe, overrides))
    try:
        return config_from_dict(tree)
    except ValueError as err:
        raise ValueError(f"recipe (as training config): {err}") from None


def run(cfg: TrainConfig, progress: bool = True) -> dict:
    """Train and evaluate; returns the results dict (also RUN/results.json)."""
    from .trainer import train

    cfg = copy.deepcopy(cfg)
    cfg.log.progress = progress
    summary = train(cfg)
    if "results" in summary:
        return summary["results"]
    # resuming a finished run trains and changes nothing (as `lm train --resume`): its results are those it wrote
    done = Path(cfg.run_dir) / "results.json"
    if summary.get("finished") and done.is_file():
        return json.loads(done.read_text())
    raise ValueError(f"{cfg.run_dir}: the checkpoint it resumes from ({summary.get('checkpoint')}) is already at its last "
                     f"step ({summary.get('steps')}): nothing to train; raise train.steps to train on")


def model_parameters(cfg: TrainConfig) -> int:
    from ..models.presets import build_model, load_config

    try:
        config = load_config(cfg.model.preset, **{**cfg.model.overrides, "implicit": cfg.model.implicit})
    except ValueError as err:
        raise ValueError(f"model: {err}") from None
    return sum(p.numel() for p in build_model(config).parameters())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="lm synth", description=__doc__.split("\n\n", 1)[1],  # (the usage line is argparse's)
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", nargs="?", help="recipe YAML (lm/configs/synth/*.yaml, or its name)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides with dotted keys, e.g. model.implicit.max_iter=8")
    ap.add_argument("--dry-run", action="store_true", help="print the training config and model size; do not train")
    ap.add_argument("--list-tasks", action="store_true", help="list the registered tasks and their parameters")
    ap.add_argument("--compare", nargs="+", metavar="RUN", help="overlay finished runs (folders or results.json) "
                    "in one PNG (--out) instead of training")
    ap.add_argument("--output", "--out", dest="out", default="synth_compare.png", help="PNG path for --compare")
    ap.add_argument("--metric", default=None, help="metric for --compare (default: the task's)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (a plain line per logged step instead)")
    args = ap.parse_intermixed_args(argv)
    if args.list_tasks:
        from ..data.synthetic.registry import TASKS, task_parameters

        for name in TASKS:
            print(f"{name:24s} {task_parameters(name)}")
        return 0
    if args.compare:
        from ..eval.synthetic import compare_runs

        paths = ([args.recipe] if args.recipe else []) + list(args.overrides) + list(args.compare)
        try:
            table = compare_runs(paths, args.out, args.metric)
        except ValueError as e:
            print(f"lm synth: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"png": str(args.out), **table}))
        return 0
    if args.recipe is None:
        ap.error("a recipe is required (lm/configs/synth/*.yaml)")
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        if args.dry_run:
            n = model_parameters(cfg)
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            print(f"task {cfg.task.name} {cfg.task.params}: model parameters {n:,}")
            return 0
        res = run(cfg, progress=not args.quiet)
    except ValueError as e:
        print(f"lm synth: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"name": res["name"], "steps": res["steps_run"], "complete": res["complete"], **res["summary"]}))
    if not res["complete"]:
        print(f"lm synth: stopped after train.stop_after_minutes at step {res['steps_run']}; go on with the same "
              f"command plus resume=auto", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
