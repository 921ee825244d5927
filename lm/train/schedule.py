"""Learning-rate schedules as pure functions of the optimizer step.

    lr = lr_at(step, total_steps, kind="constant_sqrt", peak_lr=3e-3, min_lr=1e-5,
               warmup_steps=100, decay_start_step=9000)

- warmup: linear from peak/warmup to peak over `warmup_steps` (every kind);
- cosine: cosine from peak to min_lr over the remaining steps;
- wsd: warmup-stable-decay, constant until `decay_start_step`, then linear to min_lr;
- constant_sqrt: constant, then the square-root cooldown of Hagele et al. 2024 (implicit-LM paper):
  lr = min + (peak - min) * (1 - sqrt(p)), p the fraction of the cooldown done;
- constant: peak after warmup.
The last step (total_steps - 1) of a decaying schedule is at min_lr.
"""
from __future__ import annotations

import math

KINDS = ("cosine", "wsd", "constant_sqrt", "constant")


def lr_at(step: int, total_steps: int, *, kind: str, peak_lr: float, min_lr: float = 0.0,
          warmup_steps: int = 0, decay_start_step: int | None = None) -> float:
    if kind not in KINDS:
        raise ValueError(f"schedule.kind: must be one of {KINDS} (got {kind!r})")
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if kind == "constant":
        return peak_lr
    if kind == "cosine":
        start = warmup_steps
    else:
        start = max(warmup_steps, decay_start_step if decay_start_step is not None else total_steps)
    span = total_steps - start
    if step < start or span <= 0:
        return peak_lr
    p = min(1.0, (step - start + 1) / span)
    if kind == "cosine":
        return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    if kind == "wsd":
        return peak_lr + (min_lr - peak_lr) * p
    return min_lr + (peak_lr - min_lr) * (1.0 - math.sqrt(p))


def warmup_steps_of(warmup: float, total_steps: int) -> int:
    """`warmup` < 1 is a fraction of the steps, >= 1 a number of steps."""
    return int(round(warmup * total_steps)) if warmup < 1 else int(warmup)


class RunSchedule:
    """The learning rate of each step of a run: cfg.schedule and optim.lr over its steps (a warm-up fraction of
    them, the cooldown from schedule.decay_start: a fraction, or the start of the curriculum's last phase), evaluated
    further on when the time budget runs out first (TimeBudget.schedule_step)."""

    def __init__(self, cfg, total_steps: int, phases, budget):
        from .curriculum import phase_start

        s = cfg.schedule
        self.total_steps, self.budget = total_steps, budget
        self.warmup = warmup_steps_of(s.warmup, total_steps)
        decay_frac = phase_start(phases, len(phases) - 1) if s.decay_start == "last_phase" else float(s.decay_start)
        self.kw = dict(kind=s.kind, peak_lr=cfg.optim.lr, min_lr=s.min_lr, warmup_steps=self.warmup,
                       decay_start_step=int(round(decay_frac * total_steps)))

    def lr(self, step: int) -> float:
        """The LR of step `step` + 1."""
        return lr_at(self.budget.schedule_step(step, self.total_steps, self.warmup), self.total_steps, **self.kw)
