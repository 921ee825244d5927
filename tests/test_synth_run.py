"""Synthetic tasks in `lm train` (data.source=task) and its `lm synth` front-end: recipes and overrides,
the task reader, per-length evaluation (JSON + PNG), fixed-point iterations per length, time budgets,
slices and resume, and a one-layer model that learns a tiny S3 word problem."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

import lm  # noqa: F401  registers the model types
from lm.resources import configs_dir
from lm.data.synthetic import build_task, monoid_by_name
from lm.data.synthetic.source import TaskReader
from lm.eval.synthetic import compare_runs, evaluate, summarize
from lm.train.budget import TimeBudget
from lm.train.synth import load_recipe, main, model_parameters, run

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
    assert cfg.model.overrides["num_hidden_layers"] == 1 and cfg.data.source == "task"
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

    def forward(self, input_ids):
        x = input_ids
        out = torch.empty_like(x)
        out[:, 0] = x[:, 0]
        for t in range(1, x.shape[1]):
            out[:, t] = self.table[out[:, t - 1], x[:, t]]
        return SimpleNamespace(logits=nn.functional.one_hot(out, self.m.order).float(),
                               fixed_point_stats={"mean_sample_iterations": float(x.shape[1])})


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

        def forward(self, input_ids):
            return SimpleNamespace(logits=self.emb(input_ids), fixed_point_stats=None)

    wrapped = Guess()
    a = evaluate(wrapped, task, [5], 64, 16, 3, torch.device("cpu"))
    b = evaluate(wrapped, task, [5], 64, 16, 3, torch.device("cpu"))
    c = evaluate(wrapped, task, [5], 64, 16, 4, torch.device("cpu"))
    assert a[5]["per_position_accuracy"] == b[5]["per_position_accuracy"]
    assert a[5]["per_position_accuracy"] != c[5]["per_position_accuracy"]


def test_implicit_model_records_iterations_per_length(tmp_path, one_thread):
    recipe = {
        "name": "implicit_tiny", "device": "cpu", "output_dir": str(tmp_path),
        "task": {"name": "word_problem", "group": "S3"},
        "model": {"model_type": "lm_mamba2", "hidden_size": 16, "num_hidden_layers": 1, "d_state": 8,
                  "headdim": 8, "expand": 2, "chunk_size": 8,
                  "implicit": {"max_iter": 2, "tol": 0.3, "phantom_steps": 1, "eval_factor": 4.0}},
        "train": {"steps": 2, "batch_size": 4, "lengths": [4, 6], "log_every": 1},
        "eval": {"lengths": [2, 8], "examples": 8, "batch_size": 8},
    }
    res = run(load_recipe(recipe), progress=False)
    for n in ("2", "8"):
        fp = res["eval"][n]["fixed_point"]
        assert 1 <= fp["mean_sample_iterations"] <= 8  # eval cap = eval_factor * max_iter
    assert "mean_iterations" in res["summary"]
    assert "fp/mean_sample_iterations" in res["train_log"][0]
    assert (tmp_path / "accuracy_per_length.png").exists()
    # overlay with a second (explicit) run
    explicit = load_recipe(recipe, ["model.implicit=null", f"output_dir={tmp_path / 'explicit'}", "name=explicit"])
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


def test_task_reader_pool_fresh_batches_prefetch_and_resume():
    task = build_task("word_problem", group="S3")
    pool = TaskReader(task, (5, 5), 4, seed=0, examples=10)
    rows = {tuple(r) for r in pool.pool.inputs}
    seen = [next(pool) for _ in range(5)]
    assert all(tuple(r) in rows for b in seen for r in b["input_ids"].tolist())
    assert len({tuple(r) for b in seen for r in b["input_ids"].tolist()}) == 10  # epochs cover the whole set
    fresh_a, fresh_b = TaskReader(task, (3, 9), 4, seed=1), TaskReader(task, (3, 9), 4, seed=1)
    for _ in range(5):
        a, b = next(fresh_a), next(fresh_b)
        assert torch.equal(a["input_ids"], b["input_ids"]) and 3 <= a["input_ids"].shape[1] <= 9
        assert a["targets"].shape == a["mask"].shape == a["input_ids"].shape
        assert (a["targets"][a["mask"]] != -100).all()
    with pytest.raises(ValueError, match="one training length"):
        TaskReader(task, (3, 9), 4, seed=0, examples=10)
    # the state (batches consumed) resumes the sequence exactly, with the fixed set too
    for kw in ({}, {"examples": 6}):
        lengths = (5, 5) if kw else (3, 9)
        ref = TaskReader(task, lengths, 4, seed=3, **kw)
        full = [next(ref)["input_ids"] for _ in range(6)]
        cut = TaskReader(task, lengths, 4, seed=3, **kw)
        cut.load_state_dict({**ref.state_dict(), "consumed": 2})
        assert all(torch.equal(next(cut)["input_ids"], x) for x in full[2:])
    with pytest.raises(ValueError, match="lengths"):
        TaskReader(task, (3, 8), 4, seed=3).load_state_dict(TaskReader(task, (3, 9), 4, seed=3).state_dict())
    # two ranks never share a batch; rank 0 of 2 takes the global batches 0, 2, 4 of one rank
    one, r0, r1 = (TaskReader(task, (3, 9), 4, seed=5, rank=r, world_size=w) for r, w in ((0, 1), (0, 2), (1, 2)))
    single = [next(one)["input_ids"] for _ in range(4)]
    assert torch.equal(next(r0)["input_ids"], single[0]) and torch.equal(next(r1)["input_ids"], single[1])
    # the background producer yields the same sequence of batches and stops on close()
    plain, fetched = TaskReader(task, (3, 9), 4, seed=2), TaskReader(task, (3, 9), 4, seed=2, prefetch=2)
    try:
        for _ in range(5):
            assert torch.equal(next(plain)["input_ids"], next(fetched)["input_ids"])
        thread = fetched._thread
    finally:
        fetched.close()
    assert not thread.is_alive()
    assert fetched.state_dict()["consumed"] == 5


def test_time_budget_moves_the_schedule_on(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("lm.train.budget.time.perf_counter", lambda: clock[0])
    b = TimeBudget(max_minutes=1.0, stop_after_minutes=0.5)
    assert b.schedule_step(20, 100, 10) == 20 and not b.out_of_time()
    clock[0] += 30.0  # half the budget: the schedule is at least half-way
    assert b.schedule_step(20, 100, 10) == 50 and b.schedule_step(70, 100, 10) == 70
    assert b.schedule_step(5, 100, 10) == 5  # warm-up in steps
    assert b.slice_done() and not b.out_of_time()
    b.exclude(10.0)  # evaluation time does not count
    assert b.elapsed_s() == pytest.approx(20.0) and not b.slice_done()
    later = TimeBudget(max_minutes=1.0)
    later.resume(60.0)  # the earlier slices' training time
    assert later.out_of_time() and later.schedule_step(30, 100, 10) == 99
    assert TimeBudget().schedule_step(30, 100, 10) == 30 and not TimeBudget().out_of_time()


def test_time_budget_stops_training_and_still_evaluates(tmp_path, one_thread, monkeypatch):
    """The budget's clock is a step clock here (each step 0.02 s of training time), so the run stops at the same step
    however busy the machine is: 1.2 s of budget = 60 steps, 40 of them past the 20 warm-up steps."""
    def step_clock(self, step, total_steps, warmup_steps):
        self.fake_s = getattr(self, "fake_s", 0.0) + 0.02  # called once per step, before the step runs
        return schedule_step(self, step, total_steps, warmup_steps)

    schedule_step = TimeBudget.schedule_step
    monkeypatch.setattr(TimeBudget, "schedule_step", step_clock)
    monkeypatch.setattr(TimeBudget, "clock_s", lambda self: getattr(self, "fake_s", 0.0))
    cfg = load_recipe(SYNTH / "s3_tiny_cpu.yaml",
                      [f"output_dir={tmp_path}", "train.steps=100000", "train.max_minutes=0.02", "train.log_every=1",
                       "train.target_accuracy=null"])
    res = run(cfg, progress=False)
    assert 55 <= res["steps_run"] <= 62 and res["complete"], res["steps_run"]
    assert res["train_log"][-1]["step"] == res["steps_run"]
    assert res["train_log"][-1]["lr"] < 0.5 * cfg.optim.lr  # the cosine followed the time budget
    assert set(res["eval"]) == {str(n) for n in cfg.task.eval_lengths}
    with pytest.raises(ValueError, match="train.max_minutes"):
        load_recipe(SYNTH / "s3_tiny_cpu.yaml", ["train.max_minutes=0"])


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipes_are_valid(path):
    cfg = load_recipe(path)
    task = build_task(cfg.task.name, **cfg.task.params)
    lo, hi = cfg.task.lengths or task.train_lengths
    assert cfg.data.seq_len == hi and cfg.train.global_batch_tokens == cfg.train.micro_batch_size * hi
    b = task.generate(np.random.default_rng(0), 2, lo)
    assert b.inputs.max() < task.vocab_size == cfg.model.overrides["vocab_size"]
    assert model_parameters(cfg) > 0  # the model config is valid


def test_recipe_errors(tmp_path, capsys):
    base = {"task": {"name": "parity"}, "model": {"model_type": "lm_llama"}}
    with pytest.raises(ValueError, match=r"unknown recipe key\(s\) \['train.stpes'\]"):
        load_recipe({**base, "train": {"stpes": 3}})
    with pytest.raises(ValueError, match="task.lengths"):
        load_recipe({**base, "train": {"lengths": [5, 3]}})
    assert load_recipe(base, ["train.lr=3e-3"]).optim.lr == 0.003  # YAML 1.1 reads 3e-3 as a string
    assert load_recipe({**base, "model": {"model_type": "lm_llama", "rms_norm_eps": "1e-6"}}).model.overrides[
        "rms_norm_eps"] == 1e-6
    with pytest.raises(ValueError, match="optim.lr"):
        load_recipe(base, ["train.lr=fast"])
    with pytest.raises(ValueError, match="key=value"):
        load_recipe(base, ["train.steps"])
    with pytest.raises(ValueError, match="task.name"):
        load_recipe({"model": {"model_type": "lm_llama"}})
    with pytest.raises(ValueError, match="not found"):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="differs from the task"):
        load_recipe({**base, "model": {"model_type": "lm_llama", "vocab_size": 7}})
    assert load_recipe(base, ["train.steps=7", "model.implicit.max_iter=3"]).model.implicit.max_iter == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: {name: parity, group: S5}\nmodel: {model_type: lm_llama}\ntrain: {steps: 1}\n"
                   f"output_dir: {tmp_path}\n")
    assert main([str(bad), "--quiet"]) == 2
    assert "does not take ['group']" in capsys.readouterr().err
    tiny = str(SYNTH / "s3_tiny_cpu.yaml")
    assert main([tiny, "--dry-run", "train.steps=3"]) == 0
    assert "model parameters" in capsys.readouterr().out
    assert main(["s3_tiny_cpu", "--dry-run", "model.model_type=lm_nope"]) == 2  # a recipe by name
    assert "lm_nope" in capsys.readouterr().err
    assert main([tiny, "--dry-run", "model.headdim=7"]) == 2
    assert "headdim" in capsys.readouterr().err
    from lm.cli import main as lm_main

    assert lm_main(["synth", "--list-tasks"]) == 0  # `lm synth` routes here
    assert "mod_arithmetic" in capsys.readouterr().out


def test_task_source_in_lm_train(tmp_path, one_thread):
    """data.source=task is a data source of `lm train` itself: config checks, results.json, `lm plot` curves."""
    from lm.train import train
    from lm.train.config import config_from_dict
    from lm.train.plot import plot_run

    tree = {"run_dir": str(tmp_path), "data": {"source": "task", "seq_len": 4},
            "model": {"preset": "lm_llama", "overrides": {"hidden_size": 16, "num_hidden_layers": 1,
                                                          "num_attention_heads": 2, "intermediate_size": 32,
                                                          "vocab_size": 6}},
            "task": {"name": "word_problem", "params": {"group": "S3"}, "lengths": [2, 4], "eval_lengths": [2, 8],
                     "eval_examples": 8},
            "train": {"steps": 3, "micro_batch_size": 4, "global_batch_tokens": 16, "device": "cpu",
                      "fused_loss": False},
            "log": {"progress": False}, "checkpoint": {"export": False}, "eval": {"sample_tokens": 0}}
    summary = train(config_from_dict(tree))
    res = json.loads((tmp_path / "results.json").read_text())
    assert summary["complete"] and res["steps_run"] == 3 and set(res["eval"]) == {"2", "8"}
    assert res["name"] == tmp_path.name and "running_accuracy" in res["train_log"][-1]
    assert plot_run(tmp_path).is_file()
    for change, field in ((("data", "seq_len", 8), "data.seq_len"), (("task", "name", None), "task.name"),
                          (("task", "target_accuracy", 0.9), "task.target_accuracy"),
                          (("task", "params", {"group": "Q9"}), "task"),
                          (("checkpoint", "at_end", False), "checkpoint.at_end"),
                          (("train", "max_minutes", -1.0), "train.max_minutes")):
        sec, key, value = change
        t = json.loads(json.dumps(tree))
        t[sec][key] = value
        if key == "target_accuracy":
            t["train"]["fused_loss"] = True
        if key == "at_end":
            t["train"]["stop_after_minutes"] = 5.0
        with pytest.raises(ValueError, match=field):
            config_from_dict(t)


def test_compression_head_model():
    from lm.models import MODEL_TYPES
    from lm.models.presets import load_config

    config = load_config("lm_llama", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, vocab_size=8, head="compression")
    model = MODEL_TYPES["lm_llama"][2](config)
    x = torch.randint(0, 8, (2, 6))
    out = model(input_ids=x, targets=x)
    assert out.logits.shape == (2, 6, 8) and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.compression_head.unembed[1].weight.grad is not None
    with pytest.raises(ValueError, match="targets="):
        model(input_ids=x, labels=x)
    with pytest.raises(ValueError, match="head"):
        load_config("lm_llama", head="pool")


def test_sliced_run_resumes_to_completion(tmp_path, one_thread):
    """A run cut by train.stop_after_minutes saves a checkpoint; resume= continues it to the step budget."""
    over = [f"output_dir={tmp_path}", "train.steps=60", "train.log_every=5", "train.target_accuracy=null"]
    cfg = load_recipe(SYNTH / "s3_tiny_cpu.yaml", over + ["train.stop_after_minutes=0.0005"])
    first = run(cfg, progress=False)
    assert not first["complete"] and first["checkpoint"] and Path(first["checkpoint"]).is_dir()
    k = first["steps_run"]
    assert 1 <= k < 60 and first["train_log"][-1]["step"] == k
    second = run(load_recipe(SYNTH / "s3_tiny_cpu.yaml", over + ["resume=auto"]), progress=False)
    assert second["complete"] and second["steps_run"] == 60 and second["resumed_from"]["step"] == k
    steps = [r["step"] for r in second["train_log"]]
    assert steps[: len(first["train_log"])] == [r["step"] for r in first["train_log"]]  # the log goes on
    assert steps == sorted(set(steps)) and steps[-1] == 60
    assert second["train_log"][-1]["lr"] < 0.05 * cfg.optim.lr  # the cosine ran to its end over both slices


def test_resume_restores_the_model_exactly(tmp_path, one_thread):
    over = [f"output_dir={tmp_path}", "train.steps=25", "train.target_accuracy=null", "train.save_checkpoint=true"]
    done = run(load_recipe(SYNTH / "s3_tiny_cpu.yaml", over), progress=False)
    assert done["complete"] and done["checkpoint"]
    # a finished run resumed: nothing trained or written, its results as they were
    again = run(load_recipe(SYNTH / "s3_tiny_cpu.yaml", over + ["resume=auto"]), progress=False)
    assert again == json.loads(json.dumps(done, default=str))
    # its checkpoint resumed into a new run with more steps: the same weights, then 5 more steps
    more = run(load_recipe(SYNTH / "s3_tiny_cpu.yaml", [f"output_dir={tmp_path / 'b'}", "train.steps=30",
                                                       "train.target_accuracy=null", f"resume={done['checkpoint']}"]),
               progress=False)
    assert more["steps_run"] == 30 and more["resumed_from"]["step"] == 25
    with pytest.raises(ValueError, match="nothing to train"):
        run(load_recipe(SYNTH / "s3_tiny_cpu.yaml", over + [f"resume={done['checkpoint']}",
                                                            f"output_dir={tmp_path / 'c'}"]), progress=False)


def test_resume_errors(tmp_path, one_thread):
    base = SYNTH / "s3_tiny_cpu.yaml"
    with pytest.raises(ValueError, match="no checkpoint found"):
        run(load_recipe(base, [f"output_dir={tmp_path}", f"resume={tmp_path / 'nothing'}"]), progress=False)
    run(load_recipe(base, [f"output_dir={tmp_path}", "train.steps=3", "train.save_checkpoint=true"]), progress=False)
    # another model or task is refused by the resume's config check, naming the key (lm.train.resume)
    with pytest.raises(ValueError, match=r"another model or data(.|\n)*model.overrides.hidden_size"):
        run(load_recipe(base, [f"output_dir={tmp_path / 'b'}", "train.steps=6", "model.hidden_size=32",
                               f"resume={tmp_path}"]), progress=False)
    with pytest.raises(ValueError, match=r"another model or data(.|\n)*task.lengths"):
        run(load_recipe(base, [f"output_dir={tmp_path / 'c'}", "train.steps=6", "train.lengths=[2,3]",
                               f"resume={tmp_path}"]), progress=False)
    with pytest.raises(ValueError, match="already holds checkpoints"):
        run(load_recipe(base, [f"output_dir={tmp_path}", "train.steps=3"]), progress=False)
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
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}

    def call(minutes):
        r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_synth.sh"), str(suite), str(minutes), str(out)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout, json.loads((out / "summary.json").read_text())[0]

    text, first = call(0.015)
    assert "started tiny" in text and "(sliced)" in text and not first["complete"]
    assert (out / "tiny" / "checkpoints" / "latest").is_file()
    text, second = call(0.015)
    assert "resumed tiny" in text and second["steps"] > first["steps"]
    assert json.loads((out / "tiny" / "results.json").read_text())["resumed_from"]["step"] == first["steps"]
    while not second["complete"]:  # the 0.9 s budget ends within a few slices
        text, second = call(0.015)
        assert "resumed tiny" in text
    text, _ = call(0.015)
    assert "done: tiny" in text
