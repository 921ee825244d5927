"""Synthetic tasks, evaluated per length: accuracy per length (JSON + PNG) and the fixed-point iterations
per length of implicit models, as the evaluation hook of `lm train` with data.source=task.

    hook = TaskEvalHook(cfg, reader, run_dir, is_main=True)   # built by the trainer
    per_length = evaluate(model, task, [8, 16, 32], examples=512, batch_size=256, seed=12345, device=dev)

The hook measures the training accuracy (a running mean over steps, on the device; read at log steps,
where `task.target_accuracy` may stop the run), evaluates every length of `task.eval_lengths` on a fixed
set (seeded by (eval_seed, length)) at `eval.every_steps` and at the end, and writes RUN/results.json and
RUN/accuracy_per_length.png when the run ends. `compare_runs` overlays finished runs in one PNG.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from ..data.synthetic.metrics import all_metrics, per_position_accuracy
from ..data.synthetic.registry import Task, build_task

ITERATION_KEYS = ("mean_sample_iterations", "layer_mean_sample_iterations")  # implicit stack, FP-Mamba layers
RESULTS, PLOT = "results.json", "accuracy_per_length.png"


def _autocast(device: torch.device, precision: str):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def _iteration_stats(stats: dict | None) -> dict:
    if not stats:
        return {}
    return {k: float(v) for k, v in stats.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}


@torch.no_grad()
def evaluate(model, task: Task, lengths, examples: int, batch_size: int, seed: int, device: torch.device,
             precision: str = "fp32") -> dict:
    """Accuracy per length on a fixed evaluation set (seeded by (seed, length)), iterations per length.
    `model(input_ids=...)` returns `.logits` (B, T, V) and `.fixed_point_stats` (a mapping or None)."""
    was_training = model.training
    model.eval()
    results = {}
    for length in lengths:
        rng = np.random.default_rng([seed, int(length)])
        preds, tgts, masks, stat_sums = [], [], [], {}
        done = 0
        while done < examples:
            b = task.generate(rng, min(batch_size, examples - done), int(length))
            x = torch.as_tensor(b.inputs, device=device)
            with _autocast(device, precision):
                out = model(input_ids=x)
            stats = out.fixed_point_stats
            preds.append(out.logits.argmax(-1).cpu().numpy())
            tgts.append(b.targets)
            masks.append(b.mask)
            for k, v in _iteration_stats(stats).items():
                stat_sums[k] = stat_sums.get(k, 0.0) + v * len(b.inputs)
            done += len(b.inputs)
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


# --- the trainer's hook ----------------------------------------------------------------------------------
class TaskEvalHook:
    """What `lm train` does for data.source=task beyond language-model training (see the module doc).

    The trainer calls: after_forward(step, micro, out) for every micro-batch; log_fields() at log steps;
    reached_target(step) after them; evaluate(model, step, logger) at eval.every_steps; finish(...) at the end.
    """

    def __init__(self, cfg, reader, run_dir: Path, *, device: torch.device, is_main: bool):
        k = cfg.task
        self.cfg, self.reader, self.run_dir, self.device, self.is_main = cfg, reader, Path(run_dir), device, is_main
        self.task = build_task(k.name, **k.params)
        self.eval_task = build_task(k.name, **{**k.params, **k.eval_params}) if k.eval_params else self.task
        self.eval_lengths = [int(n) for n in (k.eval_lengths or self.task.eval_lengths)]
        self.train_lengths = list(k.lengths or self.task.train_lengths)
        self.target = k.target_accuracy
        self.acc = self.running = None  # device tensors: no host sync except at log steps

    def after_forward(self, step: int, micro: int, out):
        """The training accuracy of the micro-batch just run (needs logits: train.fused_loss=false)."""
        batch = self.reader.last
        if out.logits is None or batch is None:
            return out
        with torch.no_grad():
            y = batch["targets"].to(out.logits.device, non_blocking=True)
            m = batch["mask"].to(out.logits.device, non_blocking=True)
            self.acc = ((out.logits.argmax(-1) == y) & m).sum() / m.sum().clamp_min(1)
            self.running = self.acc if self.running is None else 0.9 * self.running + 0.1 * self.acc
        return out

    def log_fields(self) -> dict:
        if self.acc is None:
            return {}
        return {"train_accuracy": float(self.acc), "running_accuracy": float(self.running),
                "length": int(self.reader.last["input_ids"].shape[1])}

    def reached_target(self, step: int) -> bool:
        """task.target_accuracy: the running accuracy (read at the last log step) reached it (after 20 steps)."""
        return (self.target is not None and self.running is not None and step >= 20
                and float(self.running) >= self.target)

    def _evaluate(self, model, task: Task) -> dict:
        k = self.cfg.task
        return evaluate(model, task, self.eval_lengths, k.eval_examples, k.eval_batch_size, k.eval_seed, self.device,
                        self.cfg.train.precision)

    def evaluate(self, model, step: int, logger) -> dict:
        """A periodic evaluation: its summary goes to metrics.jsonl as a task_eval event."""
        summary = summarize(self.eval_task, self._evaluate(model, self.eval_task))
        logger.log({"event": "task_eval", "step": step, **summary})
        return summary

    def finish(self, model, step: int, summary: dict, logger, *, complete: bool, train_s: float) -> dict:
        """The final evaluation; on rank 0 RUN/results.json and RUN/accuracy_per_length.png. Returns the
        headline numbers (and `results`: the whole results dict)."""
        self.reader.close()
        per_length = self._evaluate(model, self.eval_task)
        head = summarize(self.eval_task, per_length)
        train_dist = None
        if self.eval_task is not self.task:
            train_dist = self._evaluate(model, self.task)
            head["train_distribution"] = summarize(self.task, train_dist)
        logger.log({"event": "task_eval", "step": step, "final": True, **head})
        if not self.is_main:
            return head
        from ..train.metrics import read_metrics

        recs = read_metrics(self.run_dir)
        start = next((r for r in reversed(recs) if r.get("event") == "start" and r.get("resumed_from")), None)
        name = self.cfg.task.run_name or self.run_dir.name
        results = {
            "name": name,
            "task": {"name": self.task.name, "registry_name": self.cfg.task.name, "vocab_size": self.task.vocab_size,
                     "metric": self.task.metric, "chance": self.task.chance, **self.task.params},
            "parameters": sum(p.numel() for p in model.parameters()),
            "steps_run": step,
            "train_time_s": train_s,
            "complete": complete,
            "resumed_from": None if start is None else {"path": start["resumed_from"], "step": start["step"]},
            "checkpoint": summary.get("checkpoint"),
            "train_lengths": self.train_lengths,
            "summary": head,
            "eval_task": {"name": self.eval_task.name, **self.eval_task.params},
            "eval": {str(n): r for n, r in per_length.items()},
            "eval_train_distribution": None if train_dist is None else {str(n): r for n, r in train_dist.items()},
            "eval_history": [r for r in recs if r.get("event") == "task_eval" and not r.get("final")],
            "train_log": [r for r in recs if "event" not in r],
            "config": self.cfg.to_dict(),
        }
        (self.run_dir / RESULTS).write_text(json.dumps(results, indent=1))
        plot(per_length, self.eval_task, self.run_dir / PLOT, name)
        return {**head, "results": results}
