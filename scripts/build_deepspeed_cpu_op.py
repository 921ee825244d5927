#!/usr/bin/env python
"""Build DeepSpeed's CPU communication op (deepspeed_shm_comm) into torch's extension cache, once.

DeepSpeed compiles it at its first CPU start (`deepspeed.init_distributed` without CUDA), about 2 - 4 minutes on
2 cores, in whichever process comes first; .ci/run calls this before the tests so that no test pays for it:

    python scripts/build_deepspeed_cpu_op.py        # TORCH_EXTENSIONS_DIR as torch uses it (default ~/.cache/...)

A build that was killed leaves torch's lock file (`lock` in the op's build folder) behind, and every later build
waits for it forever without a word. A lock that no running process holds open is such a leftover: this script
stops with a message that names it and says to delete it, instead of hanging. Exit 0 when the op is built (or
DeepSpeed is not installed: nothing to build), 1 on a stale lock or a failed build.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def lock_holders(lock: Path) -> list[int]:
    """The pids of the processes that hold `lock` open (Linux /proc); torch's build holds its lock file open from
    taking it to releasing it."""
    pids = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.path.realpath(fd) == str(lock.resolve()) for fd in fd_dir.iterdir()):
                pids.append(int(fd_dir.parent.name))
        except OSError:  # a process that ended meanwhile, or one we may not read
            continue
    return pids


def stale_lock(folder: Path) -> Path | None:
    """The build folder's lock file if it is a leftover: present, and open in no process (on a system without
    /proc: older than an hour)."""
    lock = folder / "lock"
    if not lock.exists():
        return None
    if Path("/proc/self/fd").is_dir():
        return None if lock_holders(lock) else lock
    return lock if time.time() - lock.stat().st_mtime > 3600 else None


def main() -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        print("deepspeed is not installed: no CPU op to build")
        return 0
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        print(f"DeepSpeed's {get_accelerator().device_name()} accelerator has no shared-memory comm op: nothing to build")
        return 0
    folder = Path(_get_build_directory(builder.NAME, verbose=False))
    lock = stale_lock(folder)
    if lock is not None:
        print(f"{lock} is left from a build that was stopped (no process holds it), and a new build would wait for "
              f"it forever: delete it (rm {lock}) and run again", file=sys.stderr)
        return 1
    if any(folder.glob(f"{builder.NAME}*.so")):
        print(f"{builder.NAME}: built already ({folder})")
        return 0
    t0 = time.time()
    print(f"{builder.NAME}: building into {folder} (2 - 4 minutes on 2 cores)", flush=True)
    try:
        builder.load(verbose=False)
    except Exception as e:  # noqa: BLE001 - report the build's own error and fail
        print(f"{builder.NAME}: the build failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"{builder.NAME}: built in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
