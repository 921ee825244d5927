"""scripts/train_trace.py on the CPU: the profile of a tiny run's steps 2-3 is written with its tables, the run itself
finishes as `lm train` would, and --sync says it needs CUDA."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from train_checks import tiny_run_tree

from test_train_loop import make_corpus

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_trace.py"


def _cfg(tmp_path, data):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_run_tree(tmp_path / "run", {
        "data": {"path": str(data), "seq_len": 32}, "train": {"steps": 5, "global_batch_tokens": 128},
        "checkpoint": {"every_steps": 0, "at_end": False, "export": False}, "eval": {"at_end": False}})))
    return cfg


def test_profile_of_two_steps(tmp_path, tmp_path_factory):
    data = make_corpus(tmp_path_factory)
    out = tmp_path / "trace"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(SCRIPT), "--first", "2", "--steps", "2", "--out", str(out), "--",
                        str(_cfg(tmp_path, data))], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    text = (out / "rank0.txt").read_text()
    assert text.startswith("steps profiled 2; wall per step") and "== host" in text
    walls = text.split("[", 1)[1].split("]", 1)[0].split(",")
    assert len(walls) == 2 and all(float(w) > 0 for w in walls)
    assert "trained 5 steps" in p.stdout + p.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU's message")
def test_sync_needs_cuda(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--sync", "--", "x.yaml"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and "needs CUDA" in p.stderr
