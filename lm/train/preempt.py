"""Preemption: SIGTERM (what SLURM sends before it preempts or times out a job, see scripts/slurm/train.sbatch)
and SIGINT (Ctrl-C) let the current step finish; the trainer then writes a checkpoint and stops with
`Preempted` (the CLI exits with EXIT_PREEMPTED). A second signal exits at once with 128 + signal number:
a checkpoint being written is left in checkpoints/.tmp, `latest` still names the last complete one.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped early on request, resumable (`lm train ... --resume`)


class Preempted(RuntimeError):
    """Training stopped on SIGTERM/SIGINT after writing a checkpoint; `summary` says where."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


class StopSignals:
    """Within the context, SIGTERM/SIGINT set `signal_name` instead of killing the process (main thread only)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, where: str):
        self.where = where  # e.g. the run folder, for the messages
        self.signal_name: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is not None:
            sys.stderr.write(f"\nlm train: second signal ({name}): exiting now without a checkpoint; the last "
                             f"complete checkpoint of {self.where} is intact\n")
            sys.stderr.flush()
            os._exit(128 + signum)
        self.signal_name = name
        sys.stderr.write(f"\nlm train: {name} received: finishing this step, then writing a checkpoint and stopping "
                         f"(send it again to exit at once)\n")
        sys.stderr.flush()

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)  # None: a handler not set from Python
        self._previous.clear()
