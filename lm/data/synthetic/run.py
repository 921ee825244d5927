"""`lm synth RECIPE.yaml [key=value ...]`: train a model on a synthetic task, then evaluate accuracy per
length (JSON + PNG), with the fixed-point iterations per length for implicit models.

A recipe (configs/synth/*.yaml) has these sections; overrides use dotted keys (`train.steps=200`,
`task.group=A5`, `model.implicit.max_iter=8`), values parsed as YAML:

    name: s5_mamba2              run name (output folder name)
    seed: 0                      model init, training data and length sampling
    output_dir: runs/synth/NAME  where results.json, accuracy_per_length.png (and model/) go
    device: auto                 auto | cpu | cuda | cuda:N
    dtype: float32               float32 | bfloat16 (autocast on CUDA)
    task: {name: word_problem, group: S5, ...}      see lm.data.synthetic.registry.TASKS
    model: {model_type: lm_mamba2, hidden_size: ..., implicit: null | {...}}   any lm_* config keys;
                                  vocab_size is the task's
    train: steps, batch_size, lengths [min, max] (null = the task's), lr, weight_decay, betas, eps,
           schedule (cosine | linear | constant), warmup_steps | warmup_fraction, min_lr, grad_clip,
           examples (null = a fresh batch every step; N = a fixed training set of N sequences, MAD style),
           target_accuracy (stop early, checked at log steps, once the running train accuracy reaches it),
           max_minutes (null = none; a wall-clock budget for training: the LR schedule then runs on
           max(step / steps, elapsed / budget), so it finishes its decay when the first budget runs out),
           stop_after_minutes (null = none; stop this process after that much training and save
           output_dir/checkpoint.pt, so a job longer than one allocation runs in slices: resume with
           `resume=...` and the same max_minutes; the schedule counts the training time of every slice),
           save_checkpoint (also save checkpoint.pt when training ends), log_every, eval_every
    eval:  lengths (null = the task's), examples (sequences per length), batch_size, seed,
           task (task parameters changed for evaluation, e.g. {p: 0.5} for the D_p mixture's harder
           out-of-distribution test; the training distribution is then evaluated too)
    save_model: false            save_pretrained the trained model into output_dir/model
    resume: null                 a checkpoint.pt (or the run folder holding it) to continue from: model,
                                 optimizer, step, training time and logs; task, model, seed, dtype,
                                 train.steps / batch_size / lengths / examples must match the run
                                 that wrote it (a ValueError names what differs)

The loss is the mean cross-entropy over every position with a target (IGNORE elsewhere), on the
model's logits at that position (no next-token shift: the targets are already aligned).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from .batch import IGNORE
from .metrics import all_metrics, per_position_accuracy
from .registry import Task, build_task

DEFAULTS: dict = {
    "name": "synth",
    "seed": 0,
    "output_dir": None,
    "device": "auto",
    "dtype": "float32",
    "save_model": False,
    "resume": None,
    "task": {"name": None},
    "model": {"model_type": None},
    "train": {
        "steps": 1000,
        "batch_size": 64,
        "lengths": None,
        "lr": 1e-3,
        "weight_decay": 0.0,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "schedule": "cosine",
        "warmup_steps": None,
        "warmup_fraction": None,
        "min_lr": 0.0,
        "grad_clip": None,
        "examples": None,
        "target_accuracy": None,
        "max_minutes": None,
        "stop_after_minutes": None,
        "save_checkpoint": False,
        "log_every": 50,
        "eval_every": 0,
    },
    "eval": {"lengths": None, "examples": 512, "batch_size": 256, "seed": 12345, "task": {}},
}
ITERATION_KEYS = ("mean_sample_iterations", "layer_mean_sample_iterations")  # implicit stack, FP-Mamba layers
_OPEN_SECTIONS = ("task", "model")  # keys checked by the task registry / the model config instead


# --- configuration -----------------------------------------------------------------------------------
def _merge(base: dict, new: dict, path: str = "") -> dict:
    """Recursive update of `base` by `new`; keys must exist in `base` except inside task/model."""
    out = copy.deepcopy(base)
    for k, v in new.items():
        where = f"{path}{k}"
        if path and _open_path(path.rstrip(".").split(".")):  # checked later by the registry / model config
            out[k] = copy.deepcopy(v)
            continue
        if k not in base:
            raise ValueError(f"unknown recipe key {where!r}; valid keys here: {sorted(base)}")
        if isinstance(base[k], dict):
            if not isinstance(v, dict):
                raise ValueError(f"recipe key {where!r} must be a mapping, got {type(v).__name__}")
            out[k] = _merge(base[k], v, where + ".")
        else:
            out[k] = v
    return out


def _open_path(parts: list[str]) -> bool:
    """Inside task / model / eval.task any key may be set (the registry or model config checks it)."""
    return parts[0] in _OPEN_SECTIONS or parts[:2] == ["eval", "task"]


def apply_override(cfg: dict, item: str) -> dict:
    """Apply one `a.b.c=value` override (value parsed as YAML) to a nested recipe dict."""
    if "=" not in item:
        raise ValueError(f"override {item!r} must look like key=value (e.g. train.steps=200)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) == 1 and parts[0] in _OPEN_SECTIONS:
        raise ValueError(f"override {key!r}: set single keys, e.g. {parts[0]}.<key>=value")
    out = copy.deepcopy(cfg)
    node = out
    for i, p in enumerate(parts[:-1]):
        where = ".".join(parts[: i + 1])
        if p not in node or node[p] is None:
            if not (_open_path(parts[: i + 1]) and i > 0):
                raise ValueError(f"override {key!r}: unknown recipe key {where!r}")
            node[p] = {}
        if not isinstance(node[p], dict):
            raise ValueError(f"override {key!r}: {where!r} is not a mapping")
        node = node[p]
    if parts[-1] not in node and not (_open_path(parts) and len(parts) > 1):
        raise ValueError(f"override {key!r}: unknown recipe key; valid keys here: {sorted(node)}")
    node[parts[-1]] = yaml.safe_load(raw)
    return out


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")


def _numbers(value):
    """PyYAML reads `1e-3` (no dot) as a string: turn such strings into floats, recursively."""
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, str) and _FLOAT.match(value.strip()):
        return float(value)
    return value


def load_recipe(recipe: str | Path | dict | None, overrides: list[str] | tuple = ()) -> dict:
    """Defaults <- the recipe (a YAML path or a dict) <- `key=value` overrides; validated."""
    cfg = copy.deepcopy(DEFAULTS)
    if isinstance(recipe, dict):
        cfg = _merge(cfg, recipe)
    elif recipe is not None:
        from ...resources import config_path

        try:
            p = config_path(recipe, "synth")
        except FileNotFoundError as err:
            raise ValueError(f"recipe: {err}") from None
        data = yaml.safe_load(p.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"recipe {str(p)!r} must be a YAML mapping")
        cfg = _merge(cfg, data)
    for item in overrides:
        cfg = apply_override(cfg, item)
    cfg = _numbers(cfg)
    validate_recipe(cfg)
    return cfg


def validate_recipe(cfg: dict) -> None:
    def bad(key, why):
        raise ValueError(f"recipe {key}: {why}")

    if not cfg["task"].get("name"):
        bad("task.name", "missing; one of the registered tasks (e.g. word_problem)")
    if not cfg["model"].get("model_type"):
        bad("model.model_type", "missing (e.g. lm_mamba2, lm_llama)")
    tr, ev = cfg["train"], cfg["eval"]
    for k in ("steps", "batch_size", "log_every"):
        if not isinstance(tr[k], int) or tr[k] < 1:
            bad(f"train.{k}", f"must be a positive integer, got {tr[k]!r}")
    if tr["schedule"] not in ("cosine", "linear", "constant"):
        bad("train.schedule", f"must be cosine, linear or constant, got {tr['schedule']!r}")
    if tr["warmup_steps"] is not None and tr["warmup_fraction"] is not None:
        bad("train.warmup_steps", "set warmup_steps or warmup_fraction, not both")
    if tr["lengths"] is not None and (not isinstance(tr["lengths"], (list, tuple)) or len(tr["lengths"]) != 2
                                      or not 1 <= tr["lengths"][0] <= tr["lengths"][1]):
        bad("train.lengths", f"must be [min, max] with 1 <= min <= max, got {tr['lengths']!r}")
    if tr["examples"] is not None and (not isinstance(tr["examples"], int) or tr["examples"] < 1):
        bad("train.examples", f"must be null or a positive integer, got {tr['examples']!r}")
    for k in ("lr", "weight_decay", "eps", "min_lr"):
        if isinstance(tr[k], bool) or not isinstance(tr[k], (int, float)) or tr[k] < 0:
            bad(f"train.{k}", f"must be a number >= 0, got {tr[k]!r}")
    for k in ("max_minutes", "stop_after_minutes"):
        if tr[k] is not None and (isinstance(tr[k], bool) or not isinstance(tr[k], (int, float)) or tr[k] <= 0):
            bad(f"train.{k}", f"must be null or a number of minutes > 0, got {tr[k]!r}")
    if not isinstance(tr["save_checkpoint"], bool):
        bad("train.save_checkpoint", f"must be true or false, got {tr['save_checkpoint']!r}")
    if cfg["resume"] is not None and not isinstance(cfg["resume"], (str, Path)):
        bad("resume", f"must be null or the path of a checkpoint.pt / run folder, got {cfg['resume']!r}")
    for k in ("grad_clip", "target_accuracy", "warmup_fraction", "warmup_steps"):
        if tr[k] is not None and (isinstance(tr[k], bool) or not isinstance(tr[k], (int, float)) or tr[k] < 0):
            bad(f"train.{k}", f"must be null or a number >= 0, got {tr[k]!r}")
    if cfg["dtype"] not in ("float32", "bfloat16"):
        bad("dtype", f"must be float32 or bfloat16, got {cfg['dtype']!r}")
    if ev["lengths"] is not None and (not isinstance(ev["lengths"], (list, tuple)) or not ev["lengths"]):
        bad("eval.lengths", f"must be a non-empty list of lengths, got {ev['lengths']!r}")
    if not isinstance(ev["task"], dict) or "name" in ev["task"]:
        bad("eval.task", f"must be a mapping of task parameters (not the name), got {ev['task']!r}")
    for k in ("examples", "batch_size"):
        if not isinstance(ev[k], int) or ev[k] < 1:
            bad(f"eval.{k}", f"must be a positive integer, got {ev[k]!r}")


# --- model ---------------------------------------------------------------------------------------------
def sincos_positions(n: int, dim: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    pe = torch.zeros(n, dim)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return pe


class CompressionHead(nn.Module):
    """MAD compression decoder: the last position's state plus a sin/cos position code goes through a
    two-layer MLP and an unembedding to predict the token at every position."""

    def __init__(self, dim: int, vocab_size: int, eps: float = 1e-5):
        super().__init__()
        self.mlp = nn.Sequential(nn.RMSNorm(dim, eps=eps), nn.Linear(dim, dim), nn.GELU(),
                                 nn.RMSNorm(dim, eps=eps), nn.Linear(dim, dim), nn.GELU())
        self.unembed = nn.Sequential(nn.RMSNorm(dim, eps=eps), nn.Linear(dim, vocab_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # h: (B, T, D) -> logits (B, T, V)
        b, t, d = h.shape
        x = h[:, -1:, :] + sincos_positions(t, d).to(h.device, h.dtype)[None]
        return self.unembed(self.mlp(x))


class SynthModel(nn.Module):
    """The causal LM from lm.models, with the compression head for tasks that need it."""

    def __init__(self, lm_model: nn.Module, task: Task):
        super().__init__()
        self.lm = lm_model
        self.head = (CompressionHead(lm_model.config.hidden_size, task.vocab_size,
                                     lm_model.config.rms_norm_eps) if task.head == "compression" else None)

    def forward(self, input_ids: torch.Tensor):
        """Returns (logits (B, T, V), fixed-point stats dict or None)."""
        if self.head is None:
            out = self.lm(input_ids)
            return out.logits, out.fixed_point_stats
        h, stats = self.lm.model(input_ids)  # backbone hidden states after the final norm
        return self.head(h), stats


def build_model(cfg: dict, task: Task) -> SynthModel:
    import transformers

    import lm  # noqa: F401  registers the lm_* model types

    mcfg = dict(cfg["model"])
    model_type = mcfg.pop("model_type")
    if "vocab_size" in mcfg and mcfg["vocab_size"] != task.vocab_size:
        raise ValueError(f"model.vocab_size {mcfg['vocab_size']} differs from the task's {task.vocab_size}; "
                         f"leave it out, the runner sets it")
    mcfg["vocab_size"] = task.vocab_size
    from lm.models import MODEL_TYPES

    if model_type not in MODEL_TYPES:
        raise ValueError(f"model.model_type {model_type!r} is not registered; known: {sorted(MODEL_TYPES)}")
    try:
        config = transformers.AutoConfig.for_model(model_type, **mcfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model ({model_type}): {e}") from e
    return SynthModel(transformers.AutoModelForCausalLM.from_config(config), task)


# --- training ------------------------------------------------------------------------------------------
def lr_at(step: int, total: int, base: float, schedule: str, warmup: int, min_lr: float,
          time_frac: float = 0.0) -> float:
    """LR at `step` of `total`; `time_frac` (elapsed / wall-clock budget) moves the decay on when the
    time budget runs out before the step budget (warm-up stays counted in steps)."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant":
        return base
    frac = min(1.0, max((step - warmup) / max(1, total - warmup), time_frac))
    if schedule == "linear":
        return min_lr + (base - min_lr) * (1.0 - frac)
    return min_lr + (base - min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))


def _optimizer(model: nn.Module, tr: dict) -> torch.optim.Optimizer:
    from lm.train.optim import param_groups

    return torch.optim.AdamW(param_groups(model, tr["weight_decay"]), lr=tr["lr"], betas=tuple(tr["betas"]),
                             eps=tr["eps"])


def masked_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: CUDA is not available here; use device=cpu or auto")
    return dev


def _autocast(device: torch.device, dtype: str):
    if dtype == "bfloat16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


class TrainingData:
    """Fresh batches from the generator, or batches drawn from a fixed set of `examples` sequences.

    With `prefetch` > 0 a background thread makes the next batches while the device computes (one
    producer, so the batch sequence is the same as without it)."""

    def __init__(self, task: Task, lengths: tuple[int, int], batch_size: int, examples: int | None, seed: int,
                 prefetch: int = 0, stream: int = 0):
        self.task, self.lengths, self.batch_size = task, lengths, batch_size
        # `stream` > 0 (a resumed run: the step it resumes at) draws a new batch sequence; the fixed
        # training set of `examples` depends on the seed alone, so a resumed run trains on the same set
        self.rng = np.random.default_rng([seed, 1] + ([stream] if stream else []))
        self.pool = None
        if examples is not None:
            if lengths[0] != lengths[1]:
                raise ValueError(f"train.examples (a fixed training set) needs one training length; "
                                 f"got train.lengths {list(lengths)}")
            self.pool = task.generate(np.random.default_rng([seed, 2]), examples, lengths[0])
            self.order, self.pos = self.rng.permutation(examples), 0
        self._queue = self._thread = None
        if prefetch:
            import queue
            import threading

            self._queue = queue.Queue(maxsize=prefetch)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._produce, daemon=True, name="synth-data")
            self._thread.start()

    def _produce(self):
        while not self._stop.is_set():
            try:
                item = self._make()
            except Exception as e:  # handed to the consumer
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except Exception:  # queue.Full
                    continue
            if isinstance(item, Exception):
                return

    def next(self):
        if self._queue is None:
            return self._make()
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    def close(self):
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)

    def _make(self):
        if self.pool is None:
            length = int(self.rng.integers(self.lengths[0], self.lengths[1] + 1))
            return self.task.generate(self.rng, self.batch_size, length)
        n = len(self.order)
        idx = []
        while len(idx) < self.batch_size:  # epochs over a reshuffled pool
            take = min(self.batch_size - len(idx), n - self.pos)
            idx.extend(self.order[self.pos: self.pos + take])
            self.pos += take
            if self.pos == n:
                self.order, self.pos = self.rng.permutation(n), 0
        idx = np.asarray(idx)
        return type(self.pool)(*(a[idx] for a in self.pool))


def _iteration_stats(stats: dict | None) -> dict:
    if not stats:
        return {}
    return {k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}


@torch.no_grad()
def evaluate(model: SynthModel, task: Task, lengths, examples: int, batch_size: int, seed: int,
             device: torch.device, dtype: str = "float32") -> dict:
    """Accuracy per length on a fixed evaluation set (seeded by (seed, length)), iterations per length."""
    was_training = model.training
    model.eval()
    results = {}
    for length in lengths:
        rng = np.random.default_rng([seed, int(length)])
        preds, tgts, masks, stat_sums, n_b = [], [], [], {}, 0
        done = 0
        while done < examples:
            b = task.generate(rng, min(batch_size, examples - done), int(length))
            x, _, _ = b.to_torch(device)
            with _autocast(device, dtype):
                logits, stats = model(x)
            preds.append(logits.argmax(-1).cpu().numpy())
            tgts.append(b.targets)
            masks.append(b.mask)
            for k, v in _iteration_stats(stats).items():
                stat_sums[k] = stat_sums.get(k, 0.0) + v * len(b.inputs)
            done += len(b.inputs)
            n_b += 1
        pred, tgt, mask = (np.concatenate(a) for a in (preds, tgts, masks))
        r = all_metrics(pred, tgt, mask, task.chance)
        r["examples"] = int(len(pred))
        r["sequence_length"] = int(pred.shape[1])
        r["fixed_point"] = {k: v / done for k, v in stat_sums.items()}
        r["per_position_accuracy"] = [None if np.isnan(a) else float(a)
                                      for a in per_position_accuracy(pred, tgt, mask)]
        results[int(length)] = r
    model.train(was_training)
    return results


def summarize(task: Task, per_length: dict, threshold: float = 0.9) -> dict:
    """Headline numbers: the task metric averaged over lengths, and the longest length whose
    last-position accuracy stays above `threshold` at it and every shorter evaluated length."""
    metric = task.metric
    vals = [r[metric] for r in per_length.values()]
    longest = 0
    for length in sorted(per_length):
        if per_length[length]["last_accuracy"] > threshold:
            longest = length
        else:
            break
    out = {"metric": metric, f"mean_{metric}": float(np.mean(vals)),
           f"longest_length_last_accuracy_above_{threshold}": longest}
    iters = [iterations_of(r) for r in per_length.values()]
    if any(i is not None for i in iters):
        out["mean_iterations"] = float(np.mean([i for i in iters if i is not None]))
    return out


def iterations_of(result: dict) -> float | None:
    """Mean fixed-point iterations of one length's evaluation (None for explicit models)."""
    fp = result.get("fixed_point") or {}
    return next((fp[k] for k in ITERATION_KEYS if k in fp), None)


def _length_axis(ax, lengths):
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(lengths))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(n) for n in lengths])
    ax.set_xlabel("length")


def plot(per_length: dict, task: Task, path: Path, title: str) -> None:
    """Accuracy (and fixed-point iterations) per evaluated length, and per-position accuracy at the longest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(per_length)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    for key in dict.fromkeys([task.metric, "token_accuracy", "last_accuracy"]):
        ax.plot(lengths, [per_length[n][key] for n in lengths], marker="o", label=key)
    if task.chance is not None:
        ax.axhline(task.chance, color="k", lw=0.8, ls=":", label="chance")
    ax.set_ylabel("accuracy")
    ax.set_ylim(min(-0.02, *(per_length[n][task.metric] for n in lengths)), 1.02)
    _length_axis(ax, lengths)
    ax.grid(alpha=0.3)
    iters = [iterations_of(per_length[n]) for n in lengths]
    if any(i is not None for i in iters):
        ax2 = ax.twinx()
        ax2.plot(lengths, [np.nan if i is None else i for i in iters], color="gray", ls="--", marker="s",
                 label="fixed-point iterations")
        ax2.set_ylabel("mean fixed-point iterations")
        ax2.legend(loc="lower right")
    ax.legend(loc="lower left")
    ax.set_title(f"{title}: accuracy per length")
    longest = lengths[-1]
    ppa = np.array([np.nan if a is None else a for a in per_length[longest]["per_position_accuracy"]])
    axes[1].plot(np.arange(1, len(ppa) + 1), ppa)
    axes[1].set_ylim(-0.02, 1.02)
    axes[1].set_xlabel("position")
    axes[1].set_ylabel("accuracy")
    axes[1].set_title(f"per-position accuracy at length {longest}")
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare_runs(paths, out_png: str | Path, metric: str | None = None) -> dict:
    """Overlay several runs (folders holding results.json, or the files) in one PNG: the metric per
    length, and the fixed-point iterations per length where the runs have them. Returns {run: {length: value}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for p in paths:
        f = Path(p) / "results.json" if Path(p).is_dir() else Path(p)
        if not f.is_file():
            raise ValueError(f"{str(p)!r}: no results.json there (give a run folder or its results.json)")
        runs.append(json.loads(f.read_text()))
    metric = metric or runs[0]["task"]["metric"]
    table, all_lengths = {}, set()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        lengths = sorted(int(n) for n in r["eval"])
        if metric not in r["eval"][str(lengths[0])]:
            raise ValueError(f"run {r['name']!r} has no metric {metric!r}")
        vals = [r["eval"][str(n)][metric] for n in lengths]
        table[r["name"]] = dict(zip(lengths, vals))
        all_lengths.update(lengths)
        axes[0].plot(lengths, vals, marker="o", label=r["name"])
        its = [iterations_of(r["eval"][str(n)]) for n in lengths]
        if any(i is not None for i in its):
            axes[1].plot(lengths, [np.nan if i is None else i for i in its], marker="s", label=r["name"])
    for ax in axes:
        _length_axis(ax, sorted(all_lengths))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    train = sorted({tuple(r["train_lengths"]) for r in runs})
    for lo, hi in train:
        if lo == hi:
            axes[0].axvline(lo, color="tab:pink", lw=3, alpha=0.4)
        else:
            axes[0].axvspan(lo, hi, color="tab:pink", alpha=0.15)
    axes[0].set_ylabel(metric)
    axes[0].set_title(f"{metric} per length (shaded: training lengths)")
    axes[1].set_ylabel("mean fixed-point iterations")
    axes[1].set_title("fixed-point iterations per length")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return table


CHECKPOINT = "checkpoint.pt"
_RESUME_MUST_MATCH = (("task",), ("model",), ("seed",), ("dtype",), ("train", "steps"), ("train", "batch_size"),
                      ("train", "lengths"), ("train", "examples"))


def _at(cfg: dict, key: tuple):
    for k in key:
        cfg = cfg[k]
    return cfg


def load_checkpoint(path: str | Path, cfg: dict) -> dict:
    """Read a synth checkpoint (a file, or the run folder holding checkpoint.pt) and check that it was
    written by the same experiment (task, model, seed, dtype, step budget and data); ValueError if not."""
    p = Path(path)
    if p.is_dir():
        p = p / CHECKPOINT
    if not p.is_file():
        raise ValueError(f"resume: {str(p)!r} not found; give the checkpoint.pt that a run with "
                         f"train.stop_after_minutes or train.save_checkpoint=true wrote (or its folder)")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or foreign file
        raise ValueError(f"resume: {str(p)!r} is not a readable synth checkpoint ({type(e).__name__}: {e}); "
                         f"start the run again without resume=") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != "lm-synth-checkpoint-1":
        raise ValueError(f"resume: {str(p)!r} is not a checkpoint written by `lm synth`")
    diff = [".".join(k) for k in _RESUME_MUST_MATCH if _at(ckpt["config"], k) != _at(cfg, k)]
    if diff:
        raise ValueError(f"resume: {str(p)!r} was written by a different experiment ({', '.join(diff)} differ); "
                         f"resume with the recipe and overrides of that run, or drop resume= to start afresh")
    ckpt["path"] = str(p)
    return ckpt


def save_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, cfg: dict, step: int,
                    train_s: float, running_acc: float | None, log: list, history: list) -> None:
    """Write atomically (a temporary file renamed over the old one), so a kill mid-write loses nothing."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"format": "lm-synth-checkpoint-1", "config": cfg, "step": step, "train_s": train_s,
                "running_accuracy": running_acc, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "train_log": log, "eval_history": history}, tmp)
    tmp.replace(path)


def run(cfg: dict, progress: bool = True) -> dict:
    """Train and evaluate as the recipe says; returns the results dict (also written as JSON)."""
    validate_recipe(cfg)
    task_params = {k: v for k, v in cfg["task"].items() if k != "name"}
    task = build_task(cfg["task"]["name"], **task_params)
    tr, ev = cfg["train"], cfg["eval"]
    eval_task = build_task(cfg["task"]["name"], **{**task_params, **ev["task"]}) if ev["task"] else task
    lengths = tuple(tr["lengths"]) if tr["lengths"] is not None else task.train_lengths
    eval_lengths = [int(n) for n in (ev["lengths"] if ev["lengths"] is not None else task.eval_lengths)]
    device = _resolve_device(cfg["device"])
    out_dir = Path(cfg["output_dir"] or Path("runs/synth") / cfg["name"])
    out_dir.mkdir(parents=True, exist_ok=True)

    ckpt = load_checkpoint(cfg["resume"], cfg) if cfg["resume"] is not None else None
    torch.manual_seed(cfg["seed"])
    model = build_model(cfg, task).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = _optimizer(model, tr)
    start, done_s, log, history, running_t = 0, 0.0, [], [], None
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start, done_s, log, history = ckpt["step"], ckpt["train_s"], ckpt["train_log"], ckpt["eval_history"]
        if ckpt["running_accuracy"] is not None:
            running_t = torch.tensor(ckpt["running_accuracy"], device=device)
        torch.manual_seed(cfg["seed"] + start)
    steps = tr["steps"]
    warmup = tr["warmup_steps"] or (int(tr["warmup_fraction"] * steps) if tr["warmup_fraction"] else 0)
    budget_s = 60.0 * tr["max_minutes"] if tr["max_minutes"] else None
    slice_s = 60.0 * tr["stop_after_minutes"] if tr["stop_after_minutes"] else None
    finished = start >= steps or (budget_s is not None and done_s >= budget_s)
    data = TrainingData(task, lengths, tr["batch_size"], tr["examples"], cfg["seed"],
                        prefetch=4 if device.type == "cuda" and not finished else 0, stream=start)

    t0 = time.time() - done_s  # the training clock goes on from the checkpoint's
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=start, desc=cfg["name"], dynamic_ncols=True, file=sys.stderr)
    sliced = False  # stopped by train.stop_after_minutes: the run goes on in a later slice
    try:
        model.train()
        step = start
        eval_s = 0.0  # time spent in periodic evaluations: not charged to the training budget
        for step in range(start + 1, (start if finished else steps) + 1):
            time_frac = 0.0 if budget_s is None else (time.time() - t0 - eval_s) / budget_s
            lr = lr_at(step - 1, steps, tr["lr"], tr["schedule"], warmup, tr["min_lr"], time_frac)
            for g in opt.param_groups:
                g["lr"] = lr
            b = data.next()
            x, y, mask = b.to_torch(device)
            with _autocast(device, cfg["dtype"]):
                logits, stats = model(x)
            loss = masked_loss(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = None
            if tr["grad_clip"]:
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tr["grad_clip"])
            opt.step()
            with torch.no_grad():  # kept on the device: no host sync except at log steps
                acc_t = ((logits.argmax(-1) == y) & mask).sum() / mask.sum().clamp_min(1)
                running_t = acc_t if running_t is None else 0.9 * running_t + 0.1 * acc_t
            trained_s = time.time() - t0 - eval_s  # training time of the whole run, every slice
            out_of_time = budget_s is not None and trained_s >= budget_s
            sliced = not out_of_time and step < steps and slice_s is not None and trained_s - done_s >= slice_s
            if step % tr["log_every"] == 0 or step == steps or out_of_time or sliced:
                loss_v = float(loss.detach())
                if not math.isfinite(loss_v):
                    raise FloatingPointError(f"loss is {loss_v} at step {step}; lower train.lr or set train.grad_clip")
                running_acc = float(running_t)
                rec = {"step": step, "loss": loss_v, "train_accuracy": float(acc_t), "running_accuracy": running_acc,
                       "lr": lr, "length": int(x.shape[1]), "time_s": time.time() - t0}
                if gnorm is not None:
                    rec["grad_norm"] = float(gnorm)
                rec.update({f"fp_{k}": v for k, v in _iteration_stats(stats).items()})
                log.append(rec)
                if bar is not None:
                    bar.set_postfix(loss=f"{loss_v:.3f}", acc=f"{running_acc:.3f}")
                if tr["target_accuracy"] is not None and step >= 20 and running_acc >= tr["target_accuracy"]:
                    if bar is not None:
                        bar.update(1)
                    sliced = False
                    break
            if bar is not None:
                bar.update(1)
            if out_of_time or sliced:
                break
            if tr["eval_every"] and step % tr["eval_every"] == 0 and step != steps:
                t_eval = time.time()
                res = evaluate(model, eval_task, eval_lengths, ev["examples"], ev["batch_size"], ev["seed"], device,
                               cfg["dtype"])
                history.append({"step": step, "time_s": t_eval - t0, **summarize(eval_task, res)})
                eval_s += time.time() - t_eval
    finally:
        data.close()
    if bar is not None:
        bar.close()
    train_time = time.time() - t0
    checkpoint = None
    if sliced or (tr["save_checkpoint"] and step > start):
        checkpoint = out_dir / CHECKPOINT
        save_checkpoint(checkpoint, model, opt, cfg, step, train_time - eval_s,
                        None if running_t is None else float(running_t), log, history)

    per_length = evaluate(model, eval_task, eval_lengths, ev["examples"], ev["batch_size"], ev["seed"], device,
                          cfg["dtype"])
    summary = summarize(eval_task, per_length)
    train_dist = None
    if eval_task is not task:
        train_dist = evaluate(model, task, eval_lengths, ev["examples"], ev["batch_size"], ev["seed"], device,
                              cfg["dtype"])
        summary["train_distribution"] = summarize(task, train_dist)
    results = {
        "name": cfg["name"],
        "task": {"name": task.name, "registry_name": cfg["task"]["name"], "vocab_size": task.vocab_size,
                 "metric": task.metric, "chance": task.chance, **task.params},
        "parameters": n_params,
        "steps_run": step,
        "train_time_s": train_time,
        "complete": not sliced,
        "resumed_from": None if ckpt is None else {"path": ckpt["path"], "step": start},
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "train_lengths": list(lengths),
        "summary": summary,
        "eval_task": {"name": eval_task.name, **eval_task.params},
        "eval": {str(k): v for k, v in per_length.items()},
        "eval_train_distribution": None if train_dist is None else {str(k): v for k, v in train_dist.items()},
        "eval_history": history,
        "train_log": log,
        "config": cfg,
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plot(per_length, eval_task, out_dir / "accuracy_per_length.png", cfg["name"])
    if cfg["save_model"]:
        model.lm.save_pretrained(out_dir / "model")
        if model.head is not None:
            torch.save(model.head.state_dict(), out_dir / "model" / "compression_head.pt")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="lm synth", description="train and evaluate a model on a synthetic state-tracking task",
        epilog="example: lm synth configs/synth/s5_mamba2_implicit.yaml train.steps=2000 device=cuda")
    ap.add_argument("recipe", nargs="?", help="recipe YAML (configs/synth/*.yaml)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides with dotted keys, e.g. model.implicit.max_iter=8")
    ap.add_argument("--dry-run", action="store_true", help="print the resolved recipe, task and model size; do not train")
    ap.add_argument("--list-tasks", action="store_true", help="list the registered tasks and their parameters")
    ap.add_argument("--compare", nargs="+", metavar="RUN", help="overlay finished runs (folders or results.json) "
                    "in one PNG (--out) instead of training")
    ap.add_argument("--out", default="synth_compare.png", help="PNG path for --compare")
    ap.add_argument("--metric", default=None, help="metric for --compare (default: the task's)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_intermixed_args(argv)
    if args.list_tasks:
        from .registry import TASKS, task_parameters

        for name in TASKS:
            print(f"{name:24s} {task_parameters(name)}")
        return 0
    if args.compare:
        paths = ([args.recipe] if args.recipe else []) + list(args.overrides) + list(args.compare)
        try:
            table = compare_runs(paths, args.out, args.metric)
        except ValueError as e:
            print(f"lm synth: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"png": str(args.out), **table}))
        return 0
    if args.recipe is None:
        ap.error("a recipe is required (configs/synth/*.yaml)")
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        if args.dry_run:
            task = build_task(cfg["task"]["name"], **{k: v for k, v in cfg["task"].items() if k != "name"})
            model = build_model(cfg, task)
            print(yaml.safe_dump(cfg, sort_keys=False))
            print(f"task {task.name}: vocab {task.vocab_size}, metric {task.metric}; "
                  f"model parameters {sum(p.numel() for p in model.parameters()):,}")
            return 0
        res = run(cfg, progress=not args.quiet)
    except ValueError as e:
        print(f"lm synth: {e}", file=sys.stderr)
        return 2
    s = res["summary"]
    print(json.dumps({"name": res["name"], "steps": res["steps_run"], "complete": res["complete"], **s}))
    if not res["complete"]:
        print(f"lm synth: stopped after train.stop_after_minutes at step {res['steps_run']}; go on with the same "
              f"command plus resume={res['checkpoint']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
