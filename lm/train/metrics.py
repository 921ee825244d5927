"""Run logging on rank 0: a JSONL metrics file, an optional wandb run, MFU and memory (what is printed:
console.py).

Every line of RUN/metrics.jsonl is one JSON object: a step record ({"step", "tokens", "loss", "lr",
"grad_norm", "tokens_per_s", "mfu", "flops_per_token", "step_time", "mem_gb", "phase", "fp/<stat>",
"skipped"}) or an event ({"event": "phase_switch" | "eval" | "checkpoint" | "skip" | "start" | "preempted" |
"end", "step", ...}). A resumed run first drops the records past its checkpoint (rundir.truncate_metrics).
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float, world_size: int = 1) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the devices' peak."""
    return tokens_per_s * flops_per_token / (peak_flops * world_size)


class StepWindow:
    """Throughput, MFU and the solver's statistics over the steps since the last step record.

    MFU counts the FLOPs of the solver iterations actually run (the window's mean fp/iterations of an
    implicit model, fp/layer_iterations of FP-Mamba's layers), not the caps: a tolerance stops the solves early.
    """

    def __init__(self, seq_len: int, tokens_per_step: int, peak_flops: float, world_size: int):
        self.seq_len, self.tokens_per_step = seq_len, tokens_per_step
        self.peak_flops, self.world_size = peak_flops, world_size
        self._flops: dict = {}
        self.reset()

    def reset(self) -> None:
        self.steps, self.time, self.fp = 0, 0.0, []

    def add(self, seconds: float, fp_stats: list[dict]) -> None:
        self.steps += 1
        self.time += seconds
        self.fp.extend(fp_stats)

    def _flops_per_token(self, model, iterations: float | None, layer_iterations: float | None) -> float:
        """Training FLOPs per token: a + b * iterations (an implicit model's solve) + c * layer_iterations
        (FP-Mamba's per-layer solves); a, b, c cached per solver settings (those the model runs with)."""
        from lm.models.presets import flops_per_token

        key = model.solver
        if key not in self._flops:
            config = model.solver_config()

            def f(it, layer_it):
                return flops_per_token(config, self.seq_len, iterations=it, layer_iterations=layer_it)["train"]

            f0 = f(0 if key is not None else None, 0)
            self._flops[key] = (f0, f(1, 0) - f0 if key is not None else 0.0, f(0 if key is not None else None, 1) - f0)
        a, b, c = self._flops[key]
        if key is not None and iterations is None:
            iterations = key.max_iter
        return a + b * (iterations or 0.0) + c * (layer_iterations or 0.0)

    def record(self, model) -> dict:
        """The window's averages (then reset): tokens_per_s, step_time, mfu, flops_per_token, fp/<stat>."""
        tps = self.steps * self.tokens_per_step / self.time if self.time > 0 else float("nan")
        rec = {"tokens_per_s": tps, "step_time": self.time / max(1, self.steps)}
        for k in (self.fp[0] if self.fp else {}):
            vals = [s[k] for s in self.fp if k in s]
            rec[f"fp/{k}"] = sum(vals) / len(vals)
        fpt = self._flops_per_token(model, rec.get("fp/iterations"), rec.get("fp/layer_iterations"))
        rec["flops_per_token"] = fpt
        rec["mfu"] = mfu(tps, fpt, self.peak_flops, self.world_size)
        self.reset()
        return rec


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA max allocated, or the max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 2**20 if sys.platform != "darwin" else kb / 2**30


def _clean(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf
    return v


class MetricsLogger:
    """Writes records (rank 0 only; other ranks get a no-op logger)."""

    def __init__(self, run_dir: Path, *, enabled: bool, wandb_cfg: dict | None = None, config: dict | None = None):
        self.enabled = enabled
        self.file = None
        self.wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a")
        if wandb_cfg:
            try:
                import wandb
            except ImportError:
                print("warning: log.wandb is true but wandb is not installed (pip install wandb); "
                      "logging to metrics.jsonl only", file=sys.stderr)
            else:
                os.environ.setdefault("WANDB_MODE", "offline")
                self.wandb = wandb.init(project=wandb_cfg.get("project", "lm"), dir=str(run_dir),
                                        name=run_dir.name, config=config, resume="allow")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        rec = {"time": round(time.time(), 3), **{k: _clean(v) for k, v in record.items()}}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.wandb is not None:
            nums = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and k not in ("time",)}
            self.wandb.log(nums, step=rec.get("step"))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found: is {run_dir} a training run folder (lm train run_dir=...)?")
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:  # the last line of a killed run can be cut short
                continue
    return out


class StepLog:
    """What a step read writes on rank 0: a skipped step's warning (a line of its own) and "skip" event, and the
    step record (metrics.jsonl and the console's bar or line) at log.every_steps, the run's last step and wherever
    the loop stops. A synthetic task adds its fields to the record (its training accuracy: of the step's last
    micro-batch, so such a record is read before the next step is queued: `live`) and its target accuracy is
    checked there."""

    def __init__(self, *, every: int, window: StepWindow, model, logger, console, device, task,
                 tokens_per_step: int, max_bad_steps: int, live: bool):
        self.every, self.window, self.model, self.logger, self.console = every, window, model, logger, console
        self.device, self.task, self.tokens_per_step = device, task, tokens_per_step
        self.max_bad_steps, self.live = max_bad_steps, live
        self.last_loss = float("nan")  # of the last step applied

    def due(self, step: int) -> bool:
        """A record whose values must be read before the next step is queued."""
        return self.live and step % self.every == 0

    def step(self, res, stop, *, last: bool = False) -> None:
        """Step `res` (lm.train.step.StepResult) after `stop` has read it; `last`: the loop ends after it."""
        self.window.add(res.seconds, res.fp_stats)
        if res.skipped:
            why = "non-finite loss" if res.nonfinite else "non-finite gradient"
            self.console.write(f"warning: step {res.step} skipped ({why}; parameters unchanged), {stop.bad_in_row} "
                               f"in a row (limit train.max_bad_steps={self.max_bad_steps})")
            self.logger.log({"event": "skip", "step": res.step, "reason": why, "in_a_row": stop.bad_in_row})
            if stop.failed:
                return
        else:
            self.last_loss = res.loss
        if res.step % self.every == 0 or res.step == stop.at or res.signalled or last:
            rec = {"step": res.step, "tokens": res.step * self.tokens_per_step, "loss": res.loss, "lr": res.lr,
                   "grad_norm": res.grad_norm, **self.window.record(self.model),
                   "mem_gb": memory_gb(self.device), "skipped": res.skipped,
                   **({"phase": res.phase} if res.phase else {}), **self.task.log_fields()}
            if self.task.reached_target(res.step):
                stop.target_reached()
            self.logger.log(rec)
            self.console.step(res.step, rec)
