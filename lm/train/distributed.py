"""Processes: rank, world size, device and engine kind of this process, and the few collectives the trainer
needs (sums, "any rank", rank 0's answer for every rank).

Runs as one process, or one process per rank under `deepspeed`/`torchrun` (WORLD_SIZE in the env).
"""
from __future__ import annotations

import importlib.util
import os
import socket
import sys
import time
from pathlib import Path

import torch


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_available() -> bool:
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):
        return False


def resolve_auto_engine(world: int, deepspeed_config: str | None, deepspeed_available: bool) -> str:
    """train.engine=auto: DeepSpeed for several ranks or when a DeepSpeed config is given (e.g. CPU optimizer
    offload), else the plain PyTorch engine. On one H100, compiled Llama-350M trained at 135.6k tok/s with the
    plain engine and 113.0k under DeepSpeed ZeRO-2 (same run, docs/performance.md): ZeRO has nothing to
    partition over one rank, and a checkpoint resumes only with the world size that wrote it anyway."""
    want = world > 1 or deepspeed_config is not None
    return "deepspeed" if want and deepspeed_available else "torch"


def engine_kind(train_section, resumed_engine: str | None = None) -> str:
    """The engine this process will run (train.engine, with auto resolved), before any process group exists.
    `resumed_engine`: the engine that wrote the checkpoint the run resumes from, which auto keeps (a DeepSpeed run
    resumed by one process goes on under DeepSpeed, with its optimizer state)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    engine = train_section.engine
    if engine == "auto" and resumed_engine == "deepspeed" and deepspeed_available():
        return "deepspeed"
    if engine == "auto":
        engine = resolve_auto_engine(world, train_section.deepspeed_config, deepspeed_available())
    return engine


def lock_holders(lock: Path) -> list[int]:
    """The pids of the processes that hold `lock` open (Linux /proc; processes of other users are not readable, and
    torch's extension cache is per user). torch's build (torch.utils.file_baton) holds its lock file open from taking
    it to releasing it."""
    target = str(lock.resolve())
    pids = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.path.realpath(fd) == target for fd in fd_dir.iterdir()):
                pids.append(int(fd_dir.parent.name))
        except OSError:  # a process that ended meanwhile, or one we may not read
            continue
    return pids


def _unheld(lock: Path) -> bool:
    if not lock.exists():
        return False
    if Path("/proc/self/fd").is_dir():
        return not lock_holders(lock)
    return time.time() - lock.stat().st_mtime > 3600


def stale_lock(folder: Path, settle: float = 0.5) -> Path | None:
    """The build folder's lock file if it is a leftover of a killed build: present, and open in no process, now and
    `settle` seconds later (a build that finishes closes its lock, then deletes it); on a system without /proc:
    older than an hour. torch waits for such a lock forever, without a word, at every later build or load of the op."""
    lock = Path(folder) / "lock"
    if not _unheld(lock):
        return None
    time.sleep(settle)
    return lock if _unheld(lock) else None


def stale_lock_message(lock: Path) -> str:
    return (f"{lock} is left from a build of DeepSpeed's CPU communication op that was stopped (no process holds it), "
            f"and DeepSpeed would wait for it forever: delete it (rm {lock}) and run again")


def deepspeed_cpu_op():
    """(op builder, build folder) of the shared-memory communication op that DeepSpeed's CPU backend compiles at its
    first start on a machine (about 2 minutes on 2 cores) into torch's extension cache (TORCH_EXTENSIONS_DIR), or
    None where DeepSpeed's accelerator has no such op."""
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        return None
    return builder, Path(_get_build_directory(builder.NAME, verbose=False))


def _check_deepspeed_cpu_op(announce: bool) -> None:
    """Before DeepSpeed's CPU start: a RuntimeError that says what to delete if a killed build left the op's lock
    (stale_lock), instead of a silent hang; with `announce` (rank 0), a line saying that DeepSpeed compiles the op now
    unless torch's extension cache holds it already."""
    try:
        op = deepspeed_cpu_op()
    except Exception:  # noqa: BLE001 - only checks and a notice: DeepSpeed's own start reports its errors
        return
    if op is None:
        return
    builder, folder = op
    lock = stale_lock(folder)
    if lock is not None:
        raise RuntimeError(stale_lock_message(lock))
    if announce and not any(folder.glob(f"{builder.NAME}*.so")):
        print(f"DeepSpeed compiles its CPU communication op {builder.NAME} now (the first DeepSpeed start on this "
              f"machine, about 2 minutes; cached in {folder})", file=sys.stderr, flush=True)


class Dist:
    """Rank, world size, device and the engine kind of this process (initialises DeepSpeed's process group)."""

    def __init__(self, train_section, resumed_engine: str | None = None):
        t = train_section
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if t.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("train.device: cuda requested but no CUDA device is visible (use train.device=cpu)")
        cuda = torch.cuda.is_available() and t.device != "cpu"
        self.device = torch.device(f"cuda:{self.local_rank}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        engine = engine_kind(t, resumed_engine)
        if engine == "deepspeed" and not deepspeed_available():
            raise ValueError("train.engine: deepspeed is not installed (pip install deepspeed, or the `train` extra); "
                             "use train.engine=torch for a single process")
        if engine == "torch" and self.world > 1:
            raise ValueError(f"train.engine: torch runs a single process, but WORLD_SIZE={self.world}; "
                             "use train.engine=deepspeed (or auto) for several ranks")
        self.engine = engine
        if engine == "deepspeed":
            if self.device.type == "cpu":
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
            if self.world == 1:
                os.environ.setdefault("RANK", "0")
                os.environ.setdefault("LOCAL_RANK", "0")
                os.environ.setdefault("WORLD_SIZE", "1")
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(free_port()))
            import deepspeed

            if not torch.distributed.is_initialized():  # kept for a later train() in this process (shutdown())
                if not cuda:
                    _check_deepspeed_cpu_op(announce=self.rank == 0)
                deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def _grouped(self) -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    def barrier(self) -> None:
        if self._grouped:
            torch.distributed.barrier()

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a tensor on this rank's device over the ranks, in place (queued on the device: no host sync)."""
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        return self.all_reduce_(torch.tensor(values, dtype=torch.float64, device=self.device)).tolist()

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), on every rank."""
        if self.world == 1 or not self._grouped:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def on_main(self, fn):
        """Run fn() on rank 0 and give its result to every rank; a ValueError it raises is raised on every rank
        (so that all ranks stop with rank 0's message instead of waiting for it in a collective)."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except ValueError as err:
                error = str(err)
        if self.world > 1 and self._grouped:
            box = [(result, error)]
            torch.distributed.broadcast_object_list(box, src=0)
            result, error = box[0]
        if error is not None:
            raise ValueError(error)
        return result


def shutdown() -> None:
    """Destroy the process group (the CLI, before the process exits)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
