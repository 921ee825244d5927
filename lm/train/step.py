"""The training step: `accumulation` micro-batches forward and backward through the engine, then the optimizer
step, with the step's results (loss, skipped or not, gradient norm, the stop inputs every rank must agree on)
queued to the host behind it.

    stepper = Stepper(engine, reader, dist, accumulation=4, fused_loss=True, signals=signals, budget=budget)
    queued = stepper.queue(step, lr, phase)     # step + 1 is queued on the device
    result = stepper.read(queued)               # its values on the host (waits for that step only)

On CUDA the loop reads each step's results after the next step is queued (`one_behind`), so the device never waits
for the host between steps; `stepper.behind` holds the step queued but not read yet.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..host_copy import queue_to_host, read_host
from .data import to_model_inputs


def one_behind(dist) -> bool:
    """Whether the loop reads each step's results one step late: step k's (loss, skipped or not, grad norm) after
    step k + 1 is queued, so that the device goes from one step into the next without waiting for the host (a
    host slower than the device in the forward catches up during the backward). Whatever needs a step's results
    or its parameters first (the log of a synthetic task, evaluation, a checkpoint, the end, a signal) reads them
    before the next step is queued. On CUDA only: on the CPU the host computes each step itself (nothing to
    overlap). With several ranks every rank reads and drains at the same steps: what decides (a stop signal on any
    rank, the time budget's clock) is all-reduced with the step's values (_results), so a signal stops the ranks
    one step later than in one process. With nothing in the step waiting for the device either, ZeRO-2 on 2 x H100
    trains Mamba2-350M at 1.00x the 1-GPU plain engine's tokens/s per GPU (docs/performance.md)."""
    return dist.device.type == "cuda"


@dataclass
class Queued:
    """A step queued on the device whose results are not read yet: (values, event) of _results."""
    step: int
    lr: float
    t0: float
    start: "torch.cuda.Event | None"  # CUDA: where its time starts on the device
    results: tuple
    fp_stats: list
    phase: str | None


@dataclass
class StepResult:
    """A step's values on the host. `loss`: the mean of its finite micro-batch losses (NaN if none); `signalled`:
    a stop signal was pending on some rank when it ran (one process: also one that came since); `clock_s`: the
    ranks' training clocks summed; `seconds`: its time (see _step_seconds)."""
    step: int
    lr: float
    loss: float
    nonfinite: int
    skipped: bool
    grad_norm: float
    signalled: bool
    clock_s: float
    seconds: float
    fp_stats: list
    phase: str | None


class Stepper:
    """Runs the steps through the engine and reads their results (see the module docstring). `after_forward`
    (step, micro, out) -> out may replace a model output (the synthetic task's accuracy, tests)."""

    def __init__(self, engine, reader, dist, *, accumulation: int, fused_loss: bool, signals, budget,
                 after_forward=None):
        self.engine, self.reader, self.dist = engine, reader, dist
        self.accumulation, self.fused_loss = accumulation, fused_loss
        self.signals, self.budget, self.after_forward = signals, budget, after_forward
        self.one_behind = one_behind(dist)
        self.behind: Queued | None = None  # queued, read after the next step is queued
        self.read_at = 0.0  # perf_counter when the last step's results were read

    def queue(self, step: int, lr: float, phase: str | None) -> Queued:
        """Run step `step` + 1 (its micro-batches and the optimizer step) and queue its results to the host."""
        t0 = time.perf_counter()
        # where the step's time starts on the device: the end of the step before it when that one was queued
        # straight ahead of this one, else a marker now
        start = self.behind.results[1] if self.behind is not None else _device_marker(self.dist.device)
        losses, fp_stats, (applied, grad_norm) = self._run(step, lr)
        results = _results(losses, applied, grad_norm, self.dist, self.accumulation,
                           self.signals.signal_name is not None, self.budget.clock_s())
        return Queued(step + 1, lr, t0, start, results, fp_stats, phase)

    def _run(self, step: int, lr: float):
        """One optimizer step over the micro-batches: (micro losses, solver stats, (applied, grad_norm))."""
        losses, fp_stats, result = [], [], None
        for micro in range(self.accumulation):
            inputs = to_model_inputs(next(self.reader), self.dist.device)
            if self.fused_loss:
                inputs["fused_loss"] = True
            out = self.engine.forward(inputs)
            if self.after_forward is not None:
                out = self.after_forward(step, micro, out)
            losses.append(out.loss.detach().float())  # read after the step: no sync per micro-batch
            if out.fixed_point_stats is not None:  # (a lazy mapping: not looked into before the step is read)
                fp_stats.append(out.fixed_point_stats)
            self.engine.backward(out.loss)
            stacked = torch.stack(losses) if micro == self.accumulation - 1 else None
            result = self.engine.micro_end(stacked is not None, lr, losses=stacked)
        return stacked, fp_stats, result

    def read(self, q: Queued) -> StepResult:
        """Step q's values (the host waits for its last kernel; the next step may already be queued behind it)."""
        loss_sum, nonfinite, n_micro, stops, clock_s, applied, norm = read_step(q)
        signalled = stops > 0 or (self.dist.world == 1 and self.signals.signal_name is not None)
        now = time.perf_counter()
        seconds = _step_seconds(q, now, self.read_at)
        self.read_at = now
        loss = loss_sum / (n_micro - nonfinite) if n_micro > nonfinite else float("nan")
        return StepResult(q.step, q.lr, loss, int(nonfinite), not applied or nonfinite > 0, norm, signalled, clock_s,
                          seconds, q.fp_stats, q.phase)


def read_step(q: Queued) -> list:
    """The values of _results, once the step has run: [loss sum, non-finite count, micro-batches, ranks with a
    stop signal, sum of the ranks' clocks, applied, grad norm]."""
    return read_host(q.results)


def _results(losses, applied, grad_norm, dist, n_micro: int, signalled: bool, clock_s: float) -> tuple:
    """A step's (sum of the finite micro losses, how many were not finite, micro-batches, ranks with a stop signal
    pending, the ranks' training clocks: each summed over the ranks; applied, grad norm: the same on every rank) as
    one float64 tensor, queued right behind the step: on CUDA copied to pinned host memory without waiting, with an
    event after the copy, so that reading it later waits for this step only, not for whatever was queued after it."""
    dev = losses.device

    def const(v):  # filled on the device: a tensor made from a Python number is a copy that waits for the stream
        return torch.full((), float(v), dtype=torch.float64, device=dev)

    finite = torch.isfinite(losses)
    summed = torch.stack([torch.where(finite, losses, torch.zeros_like(losses)).sum().double(),
                          (~finite).sum().double(), const(n_micro), const(signalled), const(clock_s)])
    dist.all_reduce_(summed)
    same = [v.to(dev, torch.float64) if isinstance(v, torch.Tensor) else const(v) for v in (applied, grad_norm)]
    return queue_to_host(torch.cat([summed, torch.stack(same)]))


def _device_marker(device) -> "torch.cuda.Event | None":
    """A timing event recorded on the device's current stream now (CUDA), else None."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _step_seconds(q: Queued, now: float, last_read: float) -> float:
    """A step's time: on CUDA the device's, from q.start to its results' event (a step queued right behind the one
    before starts where that one ended, so time the device waited for the host between them counts, while the
    host's own wait to queue work never shifts a step's reading); on the CPU the host's, from its start or the
    read of the step before, whichever is later."""
    end = q.results[1]
    if end is not None and q.start is not None:
        return q.start.elapsed_time(end) / 1000.0
    return now - max(q.t0, last_read)
