"""A lock file left by a killed build of DeepSpeed's CPU communication op (torch waits for it forever, silently):
scripts/build_deepspeed_cpu_op.py (run by .ci/run before the tests) and the trainer's DeepSpeed start on CPU name it
with what to do instead of hanging; a lock that a running build holds open is not stale."""
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lm.train.distributed import lock_holders, stale_lock

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_deepspeed_cpu_op.py"


def test_stale_lock_is_one_no_process_holds(tmp_path):
    assert stale_lock(tmp_path) is None  # no lock: nothing to say
    lock = tmp_path / "lock"
    lock.write_bytes(b"")
    assert stale_lock(tmp_path, settle=0.1) == lock  # left behind
    holder = subprocess.Popen([sys.executable, "-c", f"import os, time; fd = os.open({str(lock)!r}, os.O_RDONLY); "
                               "print('open', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        assert lock_holders(lock) == [holder.pid] and stale_lock(tmp_path, settle=0.1) is None  # a build in progress
    finally:
        holder.kill()
        holder.wait()
    deadline = time.time() + 10
    while lock_holders(lock) and time.time() < deadline:
        time.sleep(0.1)
    assert stale_lock(tmp_path, settle=0.1) == lock


def test_a_lock_released_while_looking_is_not_stale(tmp_path):
    """A build that finishes closes its lock, then deletes it: a lock seen without a holder in between is looked at
    again `settle` seconds later."""
    lock = tmp_path / "lock"
    lock.write_bytes(b"")
    remover = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(0.2); os.remove({str(lock)!r})"])
    try:
        assert stale_lock(tmp_path, settle=2.0) is None
    finally:
        remover.wait()


def _stale_build_folder(tmp_path, monkeypatch):
    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    (folder / "lock").write_bytes(b"")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    return folder / "lock"


def test_a_stale_lock_stops_the_build_with_what_to_do(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    lock = _stale_build_folder(tmp_path, monkeypatch)
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"rm {lock}" in r.stderr and "forever" in r.stderr, r.stderr


def test_a_stale_lock_stops_the_trainers_deepspeed_start(tmp_path, monkeypatch):
    """The trainer's process setup (Dist, engine deepspeed on CPU) raises the same message before DeepSpeed's start
    would wait on the lock, on every rank (each rank loads the op); with the lock gone it only announces the build."""
    pytest.importorskip("deepspeed")
    import torch

    from lm.train.config import TrainSection
    from lm.train.distributed import Dist, _check_deepspeed_cpu_op

    lock = _stale_build_folder(tmp_path, monkeypatch)
    for var, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "1")):
        monkeypatch.setenv(var, value)  # (Dist sets them where unset; restored after the test)
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="forever") as e:
        Dist(TrainSection(engine="deepspeed", device="cpu"))
    assert f"rm {lock}" in str(e.value)
    lock.unlink()
    _check_deepspeed_cpu_op(announce=False)  # no lock, nothing built: nothing to raise
