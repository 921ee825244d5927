"""The `lm synth` runner: recipes and overrides, training, per-length evaluation (JSON + PNG), fixed-point
iterations per length, and a one-layer model that learns a tiny S3 word problem."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import lm  # noqa: F401  registers the model types
from lm.resources import configs_dir
from lm.data.synthetic import build_task, monoid_by_name
from lm.data.synthetic.run import (TrainingData, compare_runs, evaluate, load_recipe, lr_at, main, run,
                                   summarize)

ROOT = Path(__file__).resolve().parents[1]
SYNTH = configs_dir("synth")
RECIPES = sorted((SYNTH).glob("*.yaml"))


@pytest.fixture
def one_thread():
    """The CI machine is shared: one torch thread is much faster than two contending ones."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_one_layer_model_learns_tiny_s3(tmp_path, one_thread):
    cfg = load_recipe(SYNTH / "s3_tiny_cpu.yaml", [f"output_dir={tmp_path}"])
    assert cfg["model"]["num_hidden_layers"] == 1
    res = run(cfg, progress=False)
    acc = res["eval"]["3"]["token_accuracy"]
    assert acc > 0.95, res["train_log"]
    assert res["eval"]["3"]["last_accuracy"] > 0.9
    assert res["train_log"][0]["train_accuracy"] < 0.8  # it was learned, not there from the start
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["eval"]["3"]["token_accuracy"] == acc and set(saved["eval"]) == {"1", "2", "3"}
    assert (tmp_path / "accuracy_per_length.png").stat().st_size > 1000


def test_one_layer_deltaproduct_needs_two_householders_for_s3(tmp_path, one_thread):
    """DeltaProduct paper, Fig. 5: one layer with n_h = 2 tracks S3 and extrapolates; n_h = 1 cannot."""
    recipe = SYNTH / "s3_deltaproduct_cpu.yaml"
    two = run(load_recipe(recipe, [f"output_dir={tmp_path / 'nh2'}", "eval.lengths=[16,32]"]), progress=False)
    assert two["eval"]["16"]["token_accuracy"] > 0.95 and two["eval"]["32"]["token_accuracy"] > 0.9
    one = run(load_recipe(recipe, [f"output_dir={tmp_path / 'nh1'}", "eval.lengths=[16]",
                                   "model.num_householder=1", "train.steps=200"]), progress=False)
    assert one["eval"]["16"]["last_accuracy"] < 0.7


class PrefixProductOracle(nn.Module):
    """Answers the word problem exactly (one-hot logits of the brute-force prefix products)."""

    def __init__(self, group):
        super().__init__()
        self.m = monoid_by_name(group)
        self.table = torch.tensor(np.array(self.m.table))

    def forward(self, x):
        out = torch.empty_like(x)
        out[:, 0] = x[:, 0]
        for t in range(1, x.shape[1]):
            out[:, t] = self.table[out[:, t - 1], x[:, t]]
        return nn.functional.one_hot(out, self.m.order).float(), {"mean_sample_iterations": float(x.shape[1])}


def test_evaluate_per_length_with_an_oracle():
    task = build_task("word_problem", group="A4")
    res = evaluate(PrefixProductOracle("A4"), task, [3, 10, 17], examples=70, batch_size=32, seed=0,
                   device=torch.device("cpu"))
    for n in (3, 10, 17):
        r = res[n]
        assert r["token_accuracy"] == r["last_accuracy"] == r["sequence_accuracy"] == 1.0
        assert r["examples"] == 70 and len(r["per_position_accuracy"]) == n
        assert r["fixed_point"]["mean_sample_iterations"] == n  # averaged over batches
    s = summarize(task, res)
    assert s["mean_last_accuracy"] == 1.0 and s["longest_length_last_accuracy_above_0.9"] == 17
    assert s["mean_iterations"] == pytest.approx(10.0)


def test_evaluation_set_is_fixed_by_seed():
    task = build_task("word_problem", group="S3")
    class Guess(nn.Module):  # predicts from the current token only
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 6)

        def forward(self, x):
            return self.emb(x), None

    wrapped = Guess()
    a = evaluate(wrapped, task, [5], 64, 16, 3, torch.device("cpu"))
    b = evaluate(wrapped, task, [5], 64, 16, 3, torch.device("cpu"))
    c = evaluate(wrapped, task, [5], 64, 16, 4, torch.device("cpu"))
    assert a[5]["per_position_accuracy"] == b[5]["per_position_accuracy"]
    assert a[5]["per_position_accuracy"] != c[5]["per_position_accuracy"]


def test_implicit_model_records_iterations_per_length(tmp_path, one_thread):
    cfg = load_recipe({
        "name": "implicit_tiny", "device": "cpu", "output_dir": str(tmp_path),
        "task": {"name": "word_problem", "group": "S3"},
        "model": {"model_type": "lm_mamba2", "hidden_size": 16, "num_hidden_layers": 1, "d_state": 8,
                  "headdim": 8, "expand": 2, "chunk_size": 8,
                  "implicit": {"max_iter": 2, "tol": 0.3, "phantom_steps": 1, "eval_factor": 4.0}},
        "train": {"steps": 2, "batch_size": 4, "lengths": [4, 6], "log_every": 1},
        "eval": {"lengths": [2, 8], "examples": 8, "batch_size": 8},
    })
    res = run(cfg, progress=False)
    for n in ("2", "8"):
        fp = res["eval"][n]["fixed_point"]
        assert 1 <= fp["mean_sample_iterations"] <= 8  # eval cap = eval_factor * max_iter
    assert "mean_iterations" in res["summary"]
    assert "fp_mean_sample_iterations" in res["train_log"][0]
    assert (tmp_path / "accuracy_per_length.png").exists()
    # overlay with a second (explicit) run
    explicit = load_recipe(cfg, ["model.implicit=null", f"output_dir={tmp_path / 'explicit'}", "name=explicit"])
    run(explicit, progress=False)
    table = compare_runs([tmp_path, tmp_path / "explicit" / "results.json"], tmp_path / "cmp.png")
    assert set(table) == {"implicit_tiny", "explicit"} and set(table["explicit"]) == {2, 8}
    assert (tmp_path / "cmp.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no results.json"):
        compare_runs([tmp_path / "nothing"], tmp_path / "x.png")


def test_compression_head_fixed_training_set_and_ood_eval(tmp_path, one_thread):
    cfg = load_recipe({
        "name": "mad_tiny", "device": "cpu", "output_dir": str(tmp_path),
        "task": {"name": "mad_compression", "vocab_size": 8},
        "model": {"model_type": "lm_llama", "hidden_size": 16, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "intermediate_size": 32},
        "train": {"steps": 3, "batch_size": 4, "lengths": [8, 8], "examples": 6, "log_every": 1},
        "eval": {"lengths": [8], "examples": 8},
    })
    res = run(cfg, progress=False)
    assert res["eval"]["8"]["examples"] == 8 and res["steps_run"] == 3
    assert all(np.isfinite(r["loss"]) for r in res["train_log"])

    cfg = load_recipe({
        "name": "mixture_tiny", "device": "cpu", "output_dir": str(tmp_path / "m"),
        "task": {"name": "monoid_mixture", "p": 0.1, "group": "A4"},
        "model": {"model_type": "lm_llama", "hidden_size": 16, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "intermediate_size": 32},
        "train": {"steps": 1, "batch_size": 2, "lengths": [8, 8]},
        "eval": {"lengths": [8], "examples": 4, "task": {"p": 0.5}},
    })
    res = run(cfg, progress=False)
    assert res["eval_task"]["p"] == 0.5 and res["task"]["p"] == 0.1
    assert "train_distribution" in res["summary"] and res["eval_train_distribution"]["8"]["examples"] == 4


def test_training_data_pool_and_fresh_batches():
    task = build_task("word_problem", group="S3")
    pool = TrainingData(task, (5, 5), 4, examples=10, seed=0)
    rows = {tuple(r) for r in pool.pool.inputs}
    seen = [pool.next() for _ in range(6)]
    assert all(tuple(r) in rows for b in seen for r in b.inputs)
    assert len({tuple(r) for b in seen for r in b.inputs}) == 10  # epochs cover the whole set
    fresh_a = TrainingData(task, (3, 9), 4, None, seed=1)
    fresh_b = TrainingData(task, (3, 9), 4, None, seed=1)
    for _ in range(5):
        a, b = fresh_a.next(), fresh_b.next()
        assert np.array_equal(a.inputs, b.inputs) and 3 <= a.inputs.shape[1] <= 9
    with pytest.raises(ValueError, match="one training length"):
        TrainingData(task, (3, 9), 4, examples=10, seed=0)
    # the background producer yields the same sequence of batches and stops on close()
    plain, fetched = TrainingData(task, (3, 9), 4, None, seed=2), TrainingData(task, (3, 9), 4, None, seed=2, prefetch=2)
    try:
        for _ in range(5):
            assert np.array_equal(plain.next().inputs, fetched.next().inputs)
    finally:
        fetched.close()
    assert not fetched._thread.is_alive()


def test_lr_schedules():
    assert lr_at(0, 100, 1.0, "cosine", 10, 0.0) == pytest.approx(0.1)
    assert lr_at(9, 100, 1.0, "cosine", 10, 0.0) == pytest.approx(1.0)
    assert lr_at(10, 100, 1.0, "cosine", 10, 0.1) == pytest.approx(1.0)
    assert lr_at(55, 100, 1.0, "cosine", 10, 0.0) == pytest.approx(0.5)
    assert lr_at(100, 100, 1.0, "cosine", 10, 0.1) == pytest.approx(0.1)
    assert lr_at(55, 100, 1.0, "linear", 10, 0.0) == pytest.approx(0.5)
    assert lr_at(99, 100, 1.0, "constant", 0, 0.0) == 1.0
    # a wall-clock budget moves the decay on when it runs out first; the step budget still counts
    assert lr_at(20, 100, 1.0, "cosine", 10, 0.0, time_frac=0.5) == pytest.approx(0.5)
    assert lr_at(20, 100, 1.0, "cosine", 10, 0.1, time_frac=1.0) == pytest.approx(0.1)
    assert lr_at(55, 100, 1.0, "cosine", 10, 0.0, time_frac=0.1) == pytest.approx(0.5)
    assert lr_at(5, 100, 1.0, "cosine", 10, 0.0, time_frac=0.9) == pytest.approx(0.6)  # warm-up in steps


def test_time_budget_stops_training_and_still_evaluates(tmp_path, one_thread):
    cfg = load_recipe(SYNTH / "s3_tiny_cpu.yaml",
                      [f"output_dir={tmp_path}", "train.steps=100000", "train.max_minutes=0.02", "train.log_every=1",
                       "train.target_accuracy=null"])
    res = run(cfg, progress=False)
    assert 1 <= res["steps_run"] < 100000 and res["train_time_s"] < 30
    assert res["train_log"][-1]["step"] == res["steps_run"]
    assert res["train_log"][-1]["lr"] < 0.5 * cfg["train"]["lr"]  # the cosine followed the time budget
    assert set(res["eval"]) == {str(n) for n in cfg["eval"]["lengths"]}
    with pytest.raises(ValueError, match="train.max_minutes"):
        load_recipe(SYNTH / "s3_tiny_cpu.yaml", ["train.max_minutes=0"])


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipes_are_valid(path):
    import transformers

    from lm.models import MODEL_TYPES

    cfg = load_recipe(path)
    task = build_task(cfg["task"]["name"], **{k: v for k, v in cfg["task"].items() if k != "name"})
    lo, hi = cfg["train"]["lengths"] or task.train_lengths
    b = task.generate(np.random.default_rng(0), 2, lo)
    assert b.inputs.max() < task.vocab_size
    if cfg["eval"]["task"]:
        build_task(cfg["task"]["name"], **{**{k: v for k, v in cfg["task"].items() if k != "name"},
                                            **cfg["eval"]["task"]})
    mcfg = {k: v for k, v in cfg["model"].items() if k != "model_type"}
    assert cfg["model"]["model_type"] in MODEL_TYPES, cfg["model"]["model_type"]
    transformers.AutoConfig.for_model(cfg["model"]["model_type"], vocab_size=task.vocab_size, **mcfg)


def test_recipe_errors(tmp_path, capsys):
    base = {"task": {"name": "parity"}, "model": {"model_type": "lm_llama"}}
    with pytest.raises(ValueError, match="unknown recipe key 'train.stpes'"):
        load_recipe({**base, "train": {"stpes": 3}})
    with pytest.raises(ValueError, match="train.lengths"):
        load_recipe({**base, "train": {"lengths": [5, 3]}})
    assert load_recipe(base, ["train.lr=3e-3"])["train"]["lr"] == 0.003  # YAML 1.1 reads 3e-3 as a string
    assert load_recipe({**base, "model": {"model_type": "lm_llama", "rms_norm_eps": "1e-6"}})["model"]["rms_norm_eps"] == 1e-6
    with pytest.raises(ValueError, match="train.lr"):
        load_recipe(base, ["train.lr=fast"])
    with pytest.raises(ValueError, match="key=value"):
        load_recipe(base, ["train.steps"])
    with pytest.raises(ValueError, match="task.name"):
        load_recipe({"model": {"model_type": "lm_llama"}})
    with pytest.raises(ValueError, match="not found"):
        load_recipe(tmp_path / "missing.yaml")
    assert load_recipe(base, ["train.steps=7", "model.implicit.max_iter=3"])["model"]["implicit"] == {"max_iter": 3}
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: {name: parity, group: S5}\nmodel: {model_type: lm_llama}\ntrain: {steps: 1}\n"
                   f"output_dir: {tmp_path}\n")
    assert main([str(bad), "--quiet"]) == 2
    assert "does not take ['group']" in capsys.readouterr().err
    tiny = str(SYNTH / "s3_tiny_cpu.yaml")
    assert main([tiny, "--dry-run", "train.steps=3"]) == 0
    assert "model parameters" in capsys.readouterr().out
    assert main([tiny, "--dry-run", "model.model_type=lm_nope"]) == 2
    assert "not registered" in capsys.readouterr().err
    assert main([tiny, "--dry-run", "model.headdim=7"]) == 2
    assert "headdim" in capsys.readouterr().err
    from lm.cli import main as lm_main

    assert lm_main(["synth", "--list-tasks"]) == 0  # `lm synth` routes here
    assert "mod_arithmetic" in capsys.readouterr().out


def test_sliced_run_resumes_to_completion(tmp_path, one_thread):
    """A run cut by train.stop_after_minutes saves checkpoint.pt; resume= continues it to the step budget."""
    over = [f"output_dir={tmp_path}", "train.steps=60", "train.log_every=5", "train.target_accuracy=null"]
    cfg = load_recipe(SYNTH / "s3_tiny_cpu.yaml", over + ["train.stop_after_minutes=0.0005"])
    first = run(cfg, progress=False)
    ckpt = tmp_path / "checkpoint.pt"
    assert not first["complete"] and ckpt.is_file() and first["checkpoint"] == str(ckpt)
    k = first["steps_run"]
    assert 1 <= k < 60 and first["train_log"][-1]["step"] == k
    second = run(load_recipe(SYNTH / "s3_tiny_cpu.yaml", over + [f"resume={tmp_path}"]),
                 progress=False)
    assert second["complete"] and second["steps_run"] == 60 and second["resumed_from"]["step"] == k
    steps = [r["step"] for r in second["train_log"]]
    assert steps[: len(first["train_log"])] == [r["step"] for r in first["train_log"]]  # the log goes on
    assert steps == sorted(set(steps)) and steps[-1] == 60
    assert second["train_log"][-1]["lr"] < 0.05 * cfg["train"]["lr"]  # the cosine ran to its end over both slices


def test_resume_restores_the_model_exactly(tmp_path, one_thread):
    over = [f"output_dir={tmp_path}", "train.steps=25", "train.target_accuracy=null", "train.save_checkpoint=true"]
    done = run(load_recipe(SYNTH / "s3_tiny_cpu.yaml", over), progress=False)
    assert done["complete"] and (tmp_path / "checkpoint.pt").is_file()
    again = run(load_recipe(SYNTH / "s3_tiny_cpu.yaml",
                            over + [f"resume={tmp_path / 'checkpoint.pt'}", f"output_dir={tmp_path / 'b'}"]),
                progress=False)
    assert again["steps_run"] == 25 and again["resumed_from"]["step"] == 25  # nothing left to train
    assert again["eval"] == done["eval"]  # same weights, same fixed evaluation set


def test_resume_errors(tmp_path, one_thread):
    base = SYNTH / "s3_tiny_cpu.yaml"
    with pytest.raises(ValueError, match="not found"):
        run(load_recipe(base, [f"output_dir={tmp_path}", f"resume={tmp_path / 'nothing'}"]), progress=False)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable synth checkpoint"):
        run(load_recipe(base, [f"output_dir={tmp_path}", f"resume={tmp_path / 'junk.pt'}"]), progress=False)
    run(load_recipe(base, [f"output_dir={tmp_path}", "train.steps=3", "train.save_checkpoint=true"]), progress=False)
    with pytest.raises(ValueError, match="model differ"):
        run(load_recipe(base, [f"output_dir={tmp_path / 'b'}", "train.steps=3", "model.hidden_size=32",
                               f"resume={tmp_path}"]), progress=False)
    with pytest.raises(ValueError, match="train.stop_after_minutes"):
        load_recipe(base, ["train.stop_after_minutes=-1"])


def test_gpu_synth_script_slices_and_resumes(tmp_path):
    """scripts/gpu_synth.sh with SLICE: the first call stops every run with a checkpoint, the next call
    resumes it, and a finished run is not started again (run here on CPU with DEVICE=cpu)."""
    import os
    import subprocess

    suite = tmp_path / "suite.txt"
    suite.write_text("# one tiny run\ntiny configs/synth/s3_tiny_cpu.yaml train.target_accuracy=null "
                     "train.steps=100000 train.log_every=5 eval.examples=64\n")
    out = tmp_path / "out"
    env = {**os.environ, "DEVICE": "cpu", "SLICE": "0.01", "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    def call(minutes):
        r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_synth.sh"), str(suite), str(minutes), str(out)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout, json.loads((out / "summary.json").read_text())[0]

    text, first = call(0.015)
    assert "started tiny" in text and "(sliced)" in text and not first["complete"]
    assert (out / "tiny" / "checkpoint.pt").is_file()
    text, second = call(0.015)
    assert "resumed tiny" in text and second["steps"] > first["steps"]
    assert json.loads((out / "tiny" / "results.json").read_text())["resumed_from"]["step"] == first["steps"]
    while not second["complete"]:  # the 0.9 s budget ends within a few slices
        text, second = call(0.015)
        assert "resumed tiny" in text
    text, _ = call(0.015)
    assert "done: tiny" in text
