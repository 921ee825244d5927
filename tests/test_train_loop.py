"""Single-process training runs (plain PyTorch engine) of a very small implicit Mamba2:
curriculum switch, exact resume, NaN/inf handling, missing data, bad checkpoints, export, plot, CLI."""
import json
import shutil

import pytest
import torch
from train_checks import TINY, tiny_run_tree

from lm.train.config import config_from_dict
from lm.train.trainer import TrainingStopped, train

PHASES = [{"name": "bounded", "until": 0.5, "implicit": {"max_iter": 2, "phantom_steps": 1}},
          {"name": "free", "until": 1.0, "implicit": {"max_iter": 6, "tol": 0.05, "phantom_steps": 2}}]


def make_corpus(tmp_path_factory):
    """A small prepared data folder (default tokenizer) from generated text."""
    from lm.data.prepare import main as prepare_main

    src = tmp_path_factory.mktemp("corpus")
    words = "the king shall speak and the queen doth answer him with love and fear".split()
    g = torch.Generator().manual_seed(0)
    for d in range(10):
        idx = torch.randint(0, len(words), (600,), generator=g).tolist()
        lines = [" ".join(words[i] for i in idx[k:k + 12]) + "." for k in range(0, 600, 12)]
        (src / f"doc{d:02d}.txt").write_text("\n".join(lines))
    out = tmp_path_factory.mktemp("data") / "corpus"
    assert prepare_main(["--input", str(src), "--output", str(out), "--val-fraction", "0.2", "--no-progress",
                         "--workers", "1"]) == 0
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory)


def _cfg(run_dir, data, **over):
    return config_from_dict(tiny_run_tree(run_dir, {
        "data": {"path": str(data), "seq_len": 32},
        "curriculum": PHASES,
        "schedule": {"kind": "constant_sqrt", "warmup": 1, "decay_start": "last_phase"},
        "train": {"global_batch_tokens": 128},
        "checkpoint": {"every_steps": 0},
    }, over))


def _losses(run_dir):
    recs = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in recs if "event" not in r}, recs


def test_curriculum_switch_resume_export_plot(tmp_path, corpus):
    # uninterrupted run, checkpoint every 2 steps; the switch happens at 50% = step 3
    full = tmp_path / "full"
    s = train(_cfg(full, corpus, checkpoint={"every_steps": 2, "export": True},
                   eval={"at_end": True, "sample_tokens": 4}))
    losses, recs = _losses(full)
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(list(losses.values()))))
    switches = [r for r in recs if r.get("event") == "phase_switch"]
    assert [(r["step"], r["phase"]) for r in switches] == [(3, "free")]
    steps = [r for r in recs if "event" not in r]
    assert [r["phase"] for r in steps] == ["bounded"] * 3 + ["free"] * 3
    assert all(r["fp/iterations"] <= 2 for r in steps[:3]) and "fp/residual_mean" in steps[0]
    assert all(r["mfu"] > 0 and r["tokens_per_s"] > 0 for r in steps)
    root = full / "checkpoints"
    c2 = json.loads((root / "step_00000002" / "client.json").read_text())
    c4 = json.loads((root / "step_00000004" / "client.json").read_text())
    assert (c2["phase"], c4["phase"]) == ("bounded", "free") and c4["implicit"]["max_iter"] == 6
    assert json.loads((root / "step_00000004" / "config.json").read_text())["implicit"]["max_iter"] == 6
    assert (root / "latest").read_text().strip() == "step_00000006"
    assert s["val_ppl"] > 1 and isinstance(s["sample"], str)

    # the HF export loads with from_pretrained (after import lm) and gives the same logits
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import lm  # noqa: F401

    hf = AutoModelForCausalLM.from_pretrained(str(full / "hf"))
    tok = AutoTokenizer.from_pretrained(str(full / "hf"))
    assert hf.config.implicit.max_iter == 6 and tok.eos_token_id is not None
    sd = torch.load(root / "step_00000006" / "model_optim.pt", weights_only=False)["model"]
    assert torch.equal(hf.state_dict()["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])

    # interrupted run: stop after step 3 (the checkpoint at the stop is written), then resume
    part = tmp_path / "part"
    train(_cfg(part, corpus, train={"stop_after_steps": 3}))
    assert (part / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert json.loads((part / "checkpoints" / "step_00000003" / "client.json").read_text())["phase"] == "bounded"
    train(_cfg(part, corpus, checkpoint={"resume": "auto"}))  # auto: the latest checkpoint exists
    resumed, recs2 = _losses(part)
    assert [r["step"] for r in recs2 if r.get("event") == "phase_switch"] == [3]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(losses[step], rel=1e-6, abs=1e-6), step

    # lm export / lm plot
    from lm.train.export import main as export_main
    from lm.train.plot import main as plot_main

    assert export_main([str(part), "--output", str(tmp_path / "exp")]) == 0
    assert (tmp_path / "exp" / "config.json").is_file() and (tmp_path / "exp" / "tokenizer.json").is_file()
    assert plot_main([str(full)]) == 0 and (full / "curves.png").stat().st_size > 10_000


@pytest.mark.parametrize("one_behind", [False, True], ids=["read_at_once", "read_one_behind"])
def test_nan_steps_skipped_then_stop(tmp_path, corpus, monkeypatch, capfd, one_behind):
    import lm.train.step as step_mod

    monkeypatch.setattr(step_mod, "one_behind", lambda dist: one_behind)

    def nan_at(bad_steps):
        def hook(step, micro, out):
            if step in bad_steps:
                out.loss = out.loss * float("nan")
            return out
        return hook

    # one bad step: skipped with a warning, parameters unchanged, training goes on
    snap = {}

    def spy(step, micro, out):
        return nan_at({2})(step, micro, out)

    run = tmp_path / "one"
    capfd.readouterr()
    train(_cfg(run, corpus), hooks={"after_forward": spy})
    printed = capfd.readouterr()
    out = printed.out + printed.err
    # the warning once, on a line of its own (not the warnings module's second copy with a source line)
    skip_lines = [line for line in out.splitlines() if "step 3 skipped" in line]
    assert skip_lines == ["warning: step 3 skipped (non-finite loss; parameters unchanged), 1 in a row (limit "
                          "train.max_bad_steps=5)"], out
    assert "RuntimeWarning" not in out
    losses, recs = _losses(run)
    assert [r["step"] for r in recs if r.get("event") == "skip"] == [3]
    assert len(losses) == 6 and all(isinstance(losses[s], float) for s in (1, 2, 4, 5, 6))
    del snap

    # K bad steps in a row stop the run; the checkpoint written before is intact
    run = tmp_path / "many"
    with pytest.raises(TrainingStopped, match=r"3 steps in a row.*step_00000002.*intact.*then resume from it"):
        train(_cfg(run, corpus, train={"max_bad_steps": 3}, checkpoint={"every_steps": 2}),
              hooks={"after_forward": nan_at({2, 3, 4, 5})})
    from lm.train.checkpoint import resolve

    assert resolve(run).name == "step_00000002"

    # without a checkpoint the advice is to start again, not to resume
    run = tmp_path / "none"
    with pytest.raises(TrainingStopped, match=r"no checkpoint was written, so there is nothing to resume.*start the "
                                              r"run again") as err:
        train(_cfg(run, corpus, train={"max_bad_steps": 2}), hooks={"after_forward": nan_at({1, 2, 3, 4, 5})})
    assert "then resume" not in str(err.value)


def test_parameters_unchanged_on_skipped_step(tmp_path, corpus):
    from lm.train.engine import TorchEngine
    from lm.train.optim import make_optimizer
    from lm.models.presets import build_model, load_config

    model = build_model(load_config("lm_mamba2-tiny", **TINY, implicit={"max_iter": 2}), device="cpu")
    opt = make_optimizer(model, lr=1e-2, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, device=torch.device("cpu"))
    eng = TorchEngine(model, opt, accumulation=1, grad_clip=1.0, precision="fp32", device=torch.device("cpu"))
    ids = torch.randint(0, 100, (2, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = eng.forward({"input_ids": ids, "targets": ids})
    eng.backward(out.loss * float("inf"))
    applied, norm = eng.micro_end(True, 1e-2)
    assert not applied and not torch.isfinite(torch.tensor(norm))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    out = eng.forward({"input_ids": ids, "targets": ids})
    eng.backward(out.loss)
    assert eng.micro_end(True, 1e-2)[0]


def test_fused_adamw_skips_on_the_device(tmp_path):
    """The fused AdamW path (CUDA's; the CPU has the kernel too): the step's skip is decided on the device from
    the gradient norm and the micro losses, with parameters, moments and step count left as they were."""
    from lm.models.presets import build_model, load_config
    from lm.train.engine import TorchEngine
    from lm.train.optim import param_groups

    torch.manual_seed(0)
    model = build_model(load_config("lm_llama-tiny", hidden_size=32, num_hidden_layers=1, vocab_size=64),
                        device="cpu")
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, fused=True)
    eng = TorchEngine(model, opt, accumulation=1, grad_clip=1.0, precision="fp32", device=torch.device("cpu"))
    ids = torch.randint(0, 64, (2, 16))

    def step(scale, losses=None):
        out = eng.forward({"input_ids": ids, "targets": ids})
        eng.backward(out.loss * scale)
        return eng.micro_end(True, 1e-2, losses=out.loss.detach()[None] if losses is None else losses)

    applied, norm = step(1.0)
    assert isinstance(applied, torch.Tensor) and bool(applied) and torch.isfinite(norm)
    snap = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}

    def unchanged():
        return (all(torch.equal(snap[k], v) for k, v in model.state_dict().items())
                and all(torch.equal(moments[id(p)][k], v) for p, s in opt.state.items() for k, v in s.items()))

    applied, norm = step(float("nan"))  # non-finite gradients
    assert not bool(applied) and not torch.isfinite(norm) and unchanged()
    applied, norm = step(1.0, losses=torch.tensor([1.0, float("inf")]))  # finite gradients, a non-finite loss
    assert not bool(applied) and torch.isfinite(norm) and unchanged()
    assert bool(step(1.0)[0]) and not unchanged()
    assert all(int(s["step"]) == 2 for s in opt.state.values())


def test_steps_read_one_behind(tmp_path, corpus, monkeypatch):
    """The loop queues step k + 1 before it reads step k's results (as on a GPU; on the CPU it reads each step
    at once), except where something needs them first (here a checkpoint at step 2 and the end); every step is
    read once, in order, and logged with its own values, equal to those of the loop that reads at once."""
    import lm.train.step as step_mod

    ref = tmp_path / "at_once"
    train(_cfg(ref, corpus, checkpoint={"every_steps": 2}))
    monkeypatch.setattr(step_mod, "one_behind", lambda dist: True)

    events = []
    read = step_mod.read_step

    def spy_read(p):
        events.append(("read", p.step))
        return read(p)

    def spy_forward(step, micro, out):
        if micro == 0:
            events.append(("forward", step + 1))
        return out

    monkeypatch.setattr(step_mod, "read_step", spy_read)
    run = tmp_path / "behind"
    train(_cfg(run, corpus, checkpoint={"every_steps": 2}), hooks={"after_forward": spy_forward})
    assert events == [("forward", 1), ("forward", 2), ("read", 1), ("read", 2),
                      ("forward", 3), ("forward", 4), ("read", 3), ("read", 4),
                      ("forward", 5), ("forward", 6), ("read", 5), ("read", 6)]
    losses, recs = _losses(run)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and all(r["step_time"] > 0 for r in recs if "event" not in r)
    assert [r["step"] for r in recs if r.get("event") == "checkpoint"] == [2, 4, 6]
    assert losses == _losses(ref)[0]


def test_solver_stats_read_with_the_step_one_behind(tmp_path, corpus, monkeypatch):
    """An implicit model's solver statistics (a lazy mapping: on CUDA a copy behind the solve, read on first lookup)
    are not looked into in the forward or the step, only where the loop reads the step, after the next step is
    queued; the logged values equal those of the loop that reads at once."""
    import lm.fixed_point as fp
    import lm.train.step as step_mod

    ref = tmp_path / "at_once"
    train(_cfg(ref, corpus))
    monkeypatch.setattr(step_mod, "one_behind", lambda dist: True)
    events = []
    get = fp.LazyStats._get

    def spy_get(self):
        if self._read is None:
            events.append("stats read")
        return get(self)

    def spy_forward(step, micro, out):
        assert isinstance(out.fixed_point_stats, fp.LazyStats)
        events.append(f"forward {step + 1}")
        return out

    monkeypatch.setattr(fp.LazyStats, "_get", spy_get)
    run = tmp_path / "behind"
    train(_cfg(run, corpus), hooks={"after_forward": spy_forward})
    # 2 micro-batches per step; step k's stats are read after step k + 1's forwards (the last step: at the end)
    assert events[:6] == ["forward 1", "forward 1", "forward 2", "forward 2", "stats read", "stats read"], events
    fp_keys = [k for k in _losses(ref)[1][1] if k.startswith("fp/")]
    assert fp_keys
    steps = lambda recs: [{k: r[k] for k in fp_keys} for r in recs if "event" not in r]  # noqa: E731
    assert str(steps(_losses(run)[1])) == str(steps(_losses(ref)[1]))  # (NaN where a phase has no tolerance)


def test_bad_input_messages(tmp_path, corpus):
    # missing data: the exact prepare command
    with pytest.raises(ValueError, match=r"lm prepare-data --input shakespeare --output .*shakespeare"):
        train(_cfg(tmp_path / "r", tmp_path / "data" / "shakespeare"))
    assert not (tmp_path / "r").exists()
    # batch arithmetic
    with pytest.raises(ValueError, match="train.global_batch_tokens: 100 is not a multiple"):
        train(_cfg(tmp_path / "r", corpus, train={"global_batch_tokens": 100}))
    # a model whose embedding cannot hold the data's token ids
    with pytest.raises(ValueError, match="vocab_size 100 is smaller than the data's vocabulary 8192"):
        train(_cfg(tmp_path / "r", corpus, model={"overrides": {**TINY, "vocab_size": 100}}))
    # a bad model override names the field
    with pytest.raises(ValueError, match="model: .*hidden_sise"):
        train(_cfg(tmp_path / "r", corpus, model={"overrides": {"hidden_sise": 3}}))
    # resume with nothing to resume / a partial checkpoint; nothing is deleted
    with pytest.raises(ValueError, match="no checkpoint found"):
        train(_cfg(tmp_path / "r", corpus, checkpoint={"resume": True}))
    run = tmp_path / "run"
    train(_cfg(run, corpus, train={"steps": 2}, checkpoint={"resume": "auto"}))  # auto, nothing yet: fresh
    ck = run / "checkpoints" / "step_00000002"
    (ck / "manifest.json").unlink()
    with pytest.raises(ValueError, match="partial"):
        train(_cfg(run, corpus, train={"steps": 4}, checkpoint={"resume": True}))
    # a corrupt (truncated) weights file
    train(_cfg(tmp_path / "run2", corpus, train={"steps": 2}))
    w = tmp_path / "run2" / "checkpoints" / "step_00000002" / "model_optim.pt"
    w.write_bytes(w.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt: model_optim.pt has 1000 bytes"):
        train(_cfg(tmp_path / "run2", corpus, train={"steps": 4}, checkpoint={"resume": True}))
    assert w.is_file() and ck.is_dir()


def test_zero3_refused_for_implicit(tmp_path, corpus):
    with pytest.raises(ValueError, match="ZeRO-3 is refused for implicit models"):
        train(_cfg(tmp_path / "r", corpus, train={"engine": "deepspeed", "zero_stage": 3}))
    with pytest.raises(ValueError, match="ZeRO-3 is refused"):  # implicit through the model settings
        train(_cfg(tmp_path / "r", corpus, curriculum=None, model={"implicit": {"max_iter": 2}},
                   schedule={"decay_start": 0.5}, train={"engine": "auto", "zero_stage": 3}))
    assert not (tmp_path / "r").exists()


def test_fresh_run_refuses_a_run_dir_with_checkpoints(tmp_path, corpus):
    run = tmp_path / "run"
    train(_cfg(run, corpus, train={"steps": 1}))
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(ValueError, match="already holds checkpoints.*--resume"):
        train(_cfg(run, corpus, train={"steps": 2}))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_cli_errors(tmp_path, capsys, monkeypatch):
    from lm.train.cli import main

    monkeypatch.chdir(tmp_path)  # the default run_dir is relative: runs/default
    assert main(["train.tokenz=5"]) == 2
    assert "unknown config key(s) ['train.tokenz']" in capsys.readouterr().err
    assert main(["--print-config", "train.tokens=1e6"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["tokens"] == 1_000_000
    # a failed start writes and renames nothing in an existing run folder
    run = tmp_path / "runs" / "default"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main([f"data.path={tmp_path}/nodata", "train.engine=torch"]) == 2
    assert "lm prepare-data --input SOURCE --output" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    assert main(["model.overrides={hidden_size: 256"]) == 2
    assert "is not valid YAML" in capsys.readouterr().err


def test_activation_checkpointing_and_bf16_runs(tmp_path, corpus):
    """Activation checkpointing recomputes the same numbers; bf16 autocast trains with finite losses."""
    base = _losses(_run(tmp_path / "plain", corpus))[0]
    ck = _losses(_run(tmp_path / "ck", corpus, model={"activation_checkpointing": True}))[0]
    assert ck == pytest.approx(base, rel=1e-5)
    bf = _losses(_run(tmp_path / "bf", corpus, train={"precision": "bf16", "steps": 3}))[0]
    assert all(abs(v - base[k]) < 0.05 for k, v in bf.items())


def _run(run_dir, corpus, **over):
    train(_cfg(run_dir, corpus, **{"train": {"steps": 3}, **over}))
    return run_dir


@pytest.mark.slow
def test_compiled_blocks_give_the_same_losses(tmp_path, corpus):
    """model.compile: torch.compile per block (inductor) with the scan kernels as opaque calls; the
    losses of the implicit model (solve, phantom steps, curriculum) match the eager run. The suite's one end-to-end
    inductor compile (the other compile tests use aot_eager)."""
    from torch._dynamo.utils import counters

    base = _losses(_run(tmp_path / "eager", corpus))[0]
    counters.clear()
    comp = _losses(_run(tmp_path / "compiled", corpus, model={"compile": True}))[0]
    assert counters["stats"]["unique_graphs"] >= 2  # the blocks were compiled, not run eagerly
    assert comp == pytest.approx(base, rel=1e-4)


def test_fp_mamba_trains_and_logs_its_layer_solvers(tmp_path, corpus):
    """FP-Mamba iterates inside its layers: its stats come as fp/layer_* (no model-level solver); the
    trainer's progress line and `lm plot` read those (a KeyError on 'fp/iterations' stopped its first log)."""
    run = tmp_path / "fp"
    cfg = _cfg(run, corpus, curriculum=None,
               model={"preset": "lm_fp_mamba-tiny", "overrides": {"hidden_size": 32, "num_hidden_layers": 2,
                                                                  "d_state": 8, "headdim": 16, "chunk_size": 16,
                                                                  "layer_solver": {"max_iter": 3}}},
               schedule={"kind": "constant_sqrt", "warmup": 1, "decay_start": 0.5},
               train={"steps": 2}, log={"progress": True})
    train(cfg)
    _, recs = _losses(run)
    steps = [r for r in recs if "event" not in r]
    assert len(steps) == 2 and all(1 <= r["fp/layer_iterations"] <= 3 for r in steps)
    assert "fp/iterations" not in steps[0]
    # MFU counts the layer iterations run (no-grad solve + phantom steps), not one application per layer
    from lm.models.presets import flops_per_token, load_config

    config = load_config("lm_fp_mamba-tiny", **cfg.model.overrides)
    for r in steps:
        counted = flops_per_token(config, 32, layer_iterations=r["fp/layer_iterations"])["train"]
        assert r["flops_per_token"] == pytest.approx(counted)
        assert r["flops_per_token"] > flops_per_token(config, 32)["train"]
    from lm.train.plot import main as plot_main

    assert plot_main([str(run)]) == 0 and (run / "curves.png").stat().st_size > 10_000
