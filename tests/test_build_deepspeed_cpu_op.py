"""scripts/build_deepspeed_cpu_op.py (run by .ci/run before the tests): a lock file left by a killed build is named
with what to do instead of a silent wait; a lock that a running build holds open is not."""
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_deepspeed_cpu_op.py"


def _module():
    spec = importlib.util.spec_from_file_location("build_deepspeed_cpu_op", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stale_lock_is_one_no_process_holds(tmp_path):
    mod = _module()
    assert mod.stale_lock(tmp_path) is None  # no lock: nothing to say
    lock = tmp_path / "lock"
    lock.write_bytes(b"")
    assert mod.stale_lock(tmp_path) == lock  # left behind
    holder = subprocess.Popen([sys.executable, "-c", f"import os, time; fd = os.open({str(lock)!r}, os.O_RDONLY); "
                               "print('open', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        assert mod.lock_holders(lock) == [holder.pid] and mod.stale_lock(tmp_path) is None  # a build in progress
    finally:
        holder.kill()
        holder.wait()
    deadline = time.time() + 10
    while mod.lock_holders(lock) and time.time() < deadline:
        time.sleep(0.1)
    assert mod.stale_lock(tmp_path) == lock


def test_a_stale_lock_stops_the_build_with_what_to_do(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    (folder / "lock").write_bytes(b"")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"rm {folder / 'lock'}" in r.stderr and "forever" in r.stderr, r.stderr
