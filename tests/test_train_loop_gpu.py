"""The training loop on CUDA, where it reads each step's results one step late (lm.train.step.one_behind) and the
fused AdamW skips a non-finite step on the device: the same losses, skips and checkpoints as the loop that reads
every step at once, and step k's read waits for step k only (its event), not for the step queued behind it."""
from __future__ import annotations

import json

import pytest
import torch
from train_checks import TINY, tiny_run_tree

import lm.train.step as step_mod
from lm.train.config import config_from_dict
from lm.train.trainer import train

pytestmark = pytest.mark.gpu


def _cfg(run_dir):
    return config_from_dict(tiny_run_tree(run_dir, {
        "data": {"source": "synthetic", "seq_len": 64, "synthetic_vocab": 256},
        "model": {"preset": "lm_mamba2-tiny", "overrides": {**TINY, "vocab_size": 256}},
        "train": {"global_batch_tokens": 256, "device": "cuda", "steps": 8},
        "checkpoint": {"every_steps": 3},
    }))


def _records(run_dir):
    recs = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return ({r["step"]: r["loss"] for r in recs if "event" not in r},
            [r["step"] for r in recs if r.get("event") == "skip"],
            [r["step"] for r in recs if r.get("event") == "checkpoint"])


def test_one_behind_equals_reading_at_once_on_cuda(tmp_path, monkeypatch):
    assert step_mod.one_behind(type("D", (), {"world": 1, "device": torch.device("cuda")})())

    def nan_at_4(step, micro, out):
        if step == 3:
            out.loss = out.loss * float("nan")
        return out

    runs = {}
    for one_behind in (True, False):
        monkeypatch.setattr(step_mod, "one_behind", lambda dist, v=one_behind: v)
        torch.manual_seed(0)
        run = tmp_path / f"run{int(one_behind)}"
        train(_cfg(run), hooks={"after_forward": nan_at_4})
        runs[one_behind] = _records(run)
    losses, skips, ckpts = runs[True]
    assert sorted(losses) == list(range(1, 9)) and skips == [4] and ckpts == [3, 6, 8]
    assert runs[True] == runs[False]


def test_reading_a_step_waits_for_that_step_only():
    """_results' event: after a long kernel is queued behind the step, reading the step does not wait for it."""
    losses = torch.tensor([1.0, float("nan")], device="cuda")
    one = type("OneRank", (), {"world": 1, "all_reduce_": lambda self, t: t})()
    q = step_mod.Queued(1, 0.1, 0.0, None, step_mod._results(losses, torch.tensor(True, device="cuda"),
                                                             torch.tensor(2.5, device="cuda"), one, 2, False, 7.5), [],
                        None)
    big = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # ~0.2 s or more of queued work behind the step
        big = big @ big
        big = big / big.norm()
    done = torch.cuda.Event()
    done.record()
    # loss sum, non-finite, micro-batches, signalled ranks, clocks, applied, grad norm
    assert step_mod.read_step(q) == [1.0, 1.0, 2.0, 0.0, 7.5, 1.0, 2.5]
    assert not done.query()  # the queued products were still running when the step was read
    torch.cuda.synchronize()
