"""When a training run stops, and why: one object that every stop condition reports to.

    stop = Stop(at=stop_at, total_steps=..., budget=budget, signals=signals, dist=dist, max_bad_steps=5)
    while step < stop.at and not stop.now: ...
        stop.read(result)           # a step's values: signal, the ranks' clock, a skipped step
        stop.check_time(step)       # after queueing a step: the time budget, this slice's time

The conditions: the run's steps (`at`: train.steps / tokens, or train.stop_after_steps); the time budget
(train.max_minutes: the run is complete) and this process's slice (train.stop_after_minutes: checkpoint, resume
later); a synthetic task's target accuracy (complete); the NaN policy (train.max_bad_steps non-finite steps in a
row: the run fails with TrainingStopped, the last checkpoint intact); SIGTERM / SIGINT on any rank (checkpoint, then
Preempted). `reason` records the first of the time budget, the slice or the NaN policy (the target accuracy
replaces a time reason: the run is complete); `signal` records a stop signal, which ends the run whatever the
reason. With several ranks every decision falls at the same step: the signal flags and the clocks are all-reduced
with each step's values (lm.train.step).
"""
from __future__ import annotations

from pathlib import Path

from . import checkpoint as ckpt

COMPLETE = ("time budget", "target accuracy")  # reasons that end the run complete
NON_FINITE = "non-finite steps"


class TrainingStopped(RuntimeError):
    """Raised when training cannot go on (e.g. too many non-finite steps in a row)."""


class Stop:
    def __init__(self, *, at: int, budget, signals, dist, max_bad_steps: int, bad_in_row: int = 0):
        self.at, self.budget, self.signals, self.dist = at, budget, signals, dist
        self.max_bad_steps, self.bad_in_row = max_bad_steps, bad_in_row
        self.reason: str | None = "time budget" if budget.out_of_time() else None  # (a resumed run out of time)
        self.signal = False  # a stop signal was read with a step (on any rank)
        self.failed_at: int | None = None  # the step that reached train.max_bad_steps

    @property
    def now(self) -> bool:
        """The loop ends after the step just read."""
        return self.signal or self.reason is not None

    @property
    def failed(self) -> bool:
        return self.reason == NON_FINITE

    def read(self, res) -> None:
        """A step's values (lm.train.step.StepResult): a pending signal, the ranks' agreed clock, the NaN policy."""
        self.signal = self.signal or res.signalled
        if self.dist.world > 1:
            self.budget.agree(res.clock_s / self.dist.world)
        self.bad_in_row = self.bad_in_row + 1 if res.skipped else 0
        if self.bad_in_row >= self.max_bad_steps:
            self.reason, self.failed_at = NON_FINITE, res.step

    def check_time(self, step: int) -> None:
        """After a step is queued: the time budget, or this slice's time when steps are left."""
        if self.reason is None:
            self.reason = ("time budget" if self.budget.out_of_time()
                           else "slice" if self.budget.slice_done() and step < self.at else None)

    def target_reached(self) -> None:
        """A synthetic task's target accuracy (read at a log step): the run is complete."""
        if not self.failed:
            self.reason = "target accuracy"

    def signal_local(self) -> bool:
        """One process with a signal pending: the step just queued is read at once (it stops after it)."""
        return self.dist.world == 1 and self.signals.signal_name is not None

    def signal_name(self) -> str:
        return self.signals.signal_name or "a signal on another rank"

    def complete(self, step: int, total_steps: int) -> bool:
        return step >= total_steps or self.reason in COMPLETE

    def summary_reason(self) -> str | None:
        """`stopped` of the run's summary: why it ended before its last step (None: it did not, or a signal)."""
        return None if self.failed else self.reason

    def failure(self, run_dir: Path) -> TrainingStopped:
        """The NaN policy's error: what stopped the run and how to go on."""
        latest = ckpt.latest_tag(run_dir)
        if latest:
            kept = (f"the last checkpoint ({ckpt.checkpoints_root(run_dir) / latest}) is intact. Lower optim.lr or "
                    "optim.grad_clip, or check the data, then resume from it (--resume)")
        else:
            kept = ("no checkpoint was written, so there is nothing to resume. Lower optim.lr or optim.grad_clip, "
                    "or check the data, then start the run again (checkpoint.every_steps keeps checkpoints along "
                    "the way)")
        return TrainingStopped(f"stopped at step {self.failed_at}: {self.bad_in_row} steps in a row had a non-finite "
                               f"loss or gradient; {kept}.")
