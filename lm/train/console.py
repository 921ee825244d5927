"""What a run prints on rank 0: a progress bar on a terminal, one plain line per logged step in a log file.

On a terminal (stderr is a TTY and log.progress is on) a tqdm bar over the optimizer steps shows the loss, lr,
tokens/s and solver iterations (tqdm gives the ETA). When stdout is not a terminal (a cluster job's log file, a
pipe), or the bar is off, every step record (log.every_steps) is one line on stdout:

    step 120/500 | loss 3.2141 | lr 2.91e-03 | grad 0.412 | 1,234 tok/s | MFU 0.0012% | it 4.0 | ETA 4m05s

(`it`: the solver's mean iterations where the model is implicit; `skipped` marks a skipped step). Messages
(curriculum switches, evaluations, warnings) are lines of their own, printed once: through the bar on a terminal,
else on stdout beside the step lines, flushed as written so that a log file reads in order.
"""
from __future__ import annotations

import math
import sys
import time


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def eta(seconds: float) -> str:
    """A duration as 45s, 4m05s or 3h07m."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def step_line(step: int, total: int, rec: dict, remaining_s: float | None = None) -> str:
    """One step record as a line: step / total, loss, lr, grad norm, tokens/s, MFU, solver iterations, ETA."""
    parts = [f"step {step}/{total}", f"loss {rec['loss']:.4f}", f"lr {rec['lr']:.2e}"]
    gn = rec.get("grad_norm")
    if gn is not None:
        parts.append(f"grad {float(gn):.3g}")
    tps = rec.get("tokens_per_s")
    if tps is not None and math.isfinite(tps):
        parts.append(f"{tps:,.0f} tok/s")
    m = rec.get("mfu")
    if m is not None and math.isfinite(m):
        parts.append(f"MFU {100 * m:.3g}%")
    it = rec.get("fp/iterations", rec.get("fp/layer_iterations"))
    if it is not None:
        parts.append(f"it {it:.1f}")
    if remaining_s is not None:
        parts.append(f"ETA {eta(remaining_s)}")
    if rec.get("skipped"):
        parts.append("skipped")
    return " | ".join(parts)


class Console:
    """Rank 0's output of a run (other ranks: silent). `progress`: log.progress (the bar, where stderr is a
    terminal); step lines go to stdout when it is not a terminal or there is no bar."""

    def __init__(self, total: int, initial: int, *, enabled: bool, progress: bool):
        self.total, self.initial = total, initial
        self.enabled = enabled
        self.bar = None
        if enabled and progress and _isatty(sys.stderr):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)
        self.lines = enabled and (self.bar is None or not _isatty(sys.stdout))
        self._t0 = time.perf_counter()

    def remaining_s(self, step: int) -> float | None:
        """The time left at this process's mean pace so far (None before its first step)."""
        done = step - self.initial
        if done <= 0:
            return None
        return (time.perf_counter() - self._t0) / done * (self.total - step)

    def step(self, step: int, rec: dict) -> None:
        """A step record: the bar's position and postfix, and / or its line."""
        if not self.enabled:
            return
        if self.bar is not None:
            postfix = {"loss": f"{rec['loss']:.3f}", "lr": f"{rec['lr']:.2e}",
                       "tok/s": f"{rec.get('tokens_per_s', float('nan')):,.0f}"}
            it = rec.get("fp/iterations", rec.get("fp/layer_iterations"))
            if it is not None:
                postfix["it"] = f"{it:.1f}"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(step - self.bar.n)
        if self.lines:
            print(step_line(step, self.total, rec, self.remaining_s(step)), file=sys.stdout, flush=True)

    def write(self, msg: str) -> None:
        """A message on its own line(s)."""
        if not self.enabled:
            return
        if self.lines:
            print(msg, file=sys.stdout, flush=True)
        elif self.bar is not None:
            self.bar.write(msg, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
