"""The run folder's single writer and its metrics log across restarts.

RunLock: RUN/lock holds {host, pid, slurm_job, started} of the trainer that writes the run (rank 0 takes it
before anything in RUN is written or renamed, and removes it at the end). A second trainer on the same run
is refused with the holder named. A lock is stale, and taken over, when its holder is gone: same host and the
pid is not running; the same SLURM job (a requeued job starts on any node); or, on another host, when its
heartbeat (the file's mtime, refreshed every HEARTBEAT_S by a thread) is older than STALE_S.

Metrics: a resumed run first cuts RUN/metrics.jsonl back to the records up to the checkpoint's step, so
every step appears once (the steps after the last checkpoint are trained again); a fresh start moves an
old log aside (metrics.<time>.jsonl).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

LOCK = "lock"
HEARTBEAT_S = 30.0
STALE_S = 600.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class RunLocked(ValueError):
    """Another trainer holds the run folder."""


class RunLock:
    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK
        self.me = {"host": socket.gethostname(), "pid": os.getpid(),
                   "slurm_job": os.environ.get("SLURM_JOB_ID"), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._stop = threading.Event()
        self._thread = None
        self.held = False

    def _stale(self, holder: dict) -> str | None:
        """Why the holder's lock is stale (None: it is live)."""
        if holder.get("host") == self.me["host"]:
            if holder.get("pid") == self.me["pid"]:
                return "this process"
            return None if _pid_alive(int(holder.get("pid", -1))) else f"pid {holder.get('pid')} is not running"
        if holder.get("slurm_job") and holder.get("slurm_job") == self.me["slurm_job"]:
            return f"the same SLURM job {holder['slurm_job']} was requeued"
        age = time.time() - self.path.stat().st_mtime
        return f"no heartbeat for {age:.0f} s" if age > STALE_S else None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.me)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder = json.loads(self.path.read_text() or "{}")
                except (OSError, ValueError):
                    holder = {}
                why = self._stale(holder) if holder else "unreadable"
                if why is None:
                    raise RunLocked(
                        f"run_dir: {self.path.parent} is in use by another trainer (host {holder.get('host')}, pid "
                        f"{holder.get('pid')}, started {holder.get('started')}; lock file {self.path}). Two trainers "
                        "on one run overwrite each other's checkpoints and metrics: wait for it, stop it (e.g. "
                        f"`kill {holder.get('pid')}` on {holder.get('host')}; orphaned torchrun workers keep running "
                        "after their launcher is killed), or use another run_dir. If that process is gone, delete "
                        "the lock file.") from None
                try:  # stale: move it aside (one taker wins the rename), then try again
                    os.replace(self.path, self.path.with_name(f"{LOCK}.stale.{os.getpid()}"))
                    os.unlink(self.path.with_name(f"{LOCK}.stale.{os.getpid()}"))
                except FileNotFoundError:
                    pass  # another process took the stale lock first: try again against its lock
                continue
            with os.fdopen(fd, "w") as f:
                f.write(text)
            self.held = True
            self._thread = threading.Thread(target=self._beat, name="lm-run-lock", daemon=True)
            self._thread.start()
            return self
        raise RunLocked(f"run_dir: could not take the lock {self.path} (other trainers are starting on this run)")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if self.held:
            try:
                if json.loads(self.path.read_text()).get("pid") == self.me["pid"]:
                    self.path.unlink()
            except (OSError, ValueError):
                pass  # already gone or unreadable: nothing of ours to remove
            self.held = False


def archive_metrics(run_dir: Path) -> None:
    """A fresh start in a folder with an old log: keep it aside as metrics.<mtime>.jsonl."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        os.replace(metrics, run_dir / f"metrics.{int(metrics.stat().st_mtime)}.jsonl")


def truncate_metrics(run_dir: Path, step: int) -> int:
    """Cut the log back to the resumed checkpoint: everything after its {"event": "checkpoint", "step": step}
    record is dropped (what followed was trained after the checkpoint, and is trained again); without that
    record, the records with a step > `step`. A line cut short by a kill goes too. Rewritten atomically;
    returns the number of records dropped."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    records = []
    for line in metrics.read_text().splitlines():
        if line.strip():
            try:
                records.append((line, json.loads(line)))
            except ValueError:
                records.append((line, None))
    marks = [i for i, (_, r) in enumerate(records) if r and r.get("event") == "checkpoint" and r.get("step") == step]
    if marks:
        keep = [line for line, r in records[:marks[-1] + 1] if r is not None]
    else:
        keep = [line for line, r in records if r is not None and not (isinstance(r.get("step"), int)
                                                                     and r["step"] > step)]
    dropped = len(records) - len(keep)
    if dropped:
        tmp = metrics.with_name("metrics.jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, metrics)
    return dropped
