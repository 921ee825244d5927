#!/usr/bin/env python
"""Build DeepSpeed's CPU communication op (deepspeed_shm_comm) into torch's extension cache, once.

DeepSpeed compiles it at its first CPU start (`deepspeed.init_distributed` without CUDA), about 2 - 4 minutes on
2 cores, in whichever process comes first; .ci/run calls this before the tests so that no test pays for it:

    python scripts/build_deepspeed_cpu_op.py        # TORCH_EXTENSIONS_DIR as torch uses it (default ~/.cache/...)

A build that was killed leaves torch's lock file (`lock` in the op's build folder) behind, and every later build
waits for it forever without a word. A lock that no running process holds open is such a leftover: this script
stops with a message that names it and says to delete it, instead of hanging (lm.train.distributed.stale_lock; the
trainer checks the same before DeepSpeed's CPU start). Exit 0 when the op is built (or DeepSpeed is not installed:
nothing to build), 1 on a stale lock or a failed build.
"""
from __future__ import annotations

import os
import sys
import time


def main() -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("deepspeed is not installed: no CPU op to build")
        return 0
    from lm.train.distributed import deepspeed_cpu_op, stale_lock, stale_lock_message

    op = deepspeed_cpu_op()
    if op is None:
        from deepspeed.accelerator import get_accelerator
        print(f"DeepSpeed's {get_accelerator().device_name()} accelerator has no shared-memory comm op: nothing to build")
        return 0
    builder, folder = op
    lock = stale_lock(folder)
    if lock is not None:
        print(stale_lock_message(lock), file=sys.stderr)
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
