"""Wall-clock limits of a training run: `train.max_minutes` (the budget the LR schedule follows) and
`train.stop_after_minutes` (one slice of a run longer than an allocation). Training time excludes
evaluation and is carried over a resume, so the schedule counts the training time of every slice.

    budget = TimeBudget(max_minutes=30, stop_after_minutes=8, done_s=client.get("train_s", 0.0))
    lr = lr_at(budget.schedule_step(step, total_steps, warmup), total_steps, ...)
    if budget.out_of_time(): ...     # the whole budget is spent: the run is complete
    if budget.slice_done(): ...      # this process's slice is spent: checkpoint and stop, resume later

With several ranks every decision must fall at the same step on all of them, so the trainer hands the budget the
ranks' mean clock read with each step's results (`agree`); the budget then answers from that value, not from the
rank's own clock.
"""
from __future__ import annotations

import contextlib
import time


class TimeBudget:
    def __init__(self, max_minutes: float | None = None, stop_after_minutes: float | None = None,
                 done_s: float = 0.0):
        self.budget_s = None if max_minutes is None else 60.0 * max_minutes
        self.slice_s = None if stop_after_minutes is None else 60.0 * stop_after_minutes
        self.done_s = float(done_s)  # training time of the earlier slices
        self.t0 = time.perf_counter()
        self.excluded = 0.0
        self.agreed: float | None = None  # the ranks' mean training time of this slice, as of the last step read

    def resume(self, done_s: float) -> None:
        self.done_s = float(done_s)

    def exclude(self, seconds: float) -> None:
        """Time that is not training (evaluation, checkpoints)."""
        self.excluded += seconds

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside is not training (evaluation)."""
        t0 = time.perf_counter()
        yield
        self.exclude(time.perf_counter() - t0)

    def clock_s(self) -> float:
        """This process's own training time of this slice."""
        return time.perf_counter() - self.t0 - self.excluded

    def agree(self, slice_s: float) -> None:
        """Several ranks: from now on answer from `slice_s`, a value every rank holds (the mean of their clocks)."""
        self.agreed = float(slice_s)

    def this_slice_s(self) -> float:
        return self.clock_s() if self.agreed is None else self.agreed

    def elapsed_s(self) -> float:
        """Training time of the whole run, every slice."""
        return self.done_s + self.this_slice_s()

    def schedule_step(self, step: int, total_steps: int, warmup_steps: int) -> int:
        """The step the LR schedule is evaluated at: the step, or further on when the time budget runs out
        first (elapsed / budget of the steps); the warm-up stays counted in steps."""
        if self.budget_s is None or step < warmup_steps:
            return step
        return max(step, min(total_steps - 1, int(total_steps * self.elapsed_s() / self.budget_s)))

    def out_of_time(self) -> bool:
        return self.budget_s is not None and self.elapsed_s() >= self.budget_s

    def slice_done(self) -> bool:
        return self.slice_s is not None and self.this_slice_s() >= self.slice_s
