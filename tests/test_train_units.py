"""Training pieces without a training run: config parsing/validation, LR schedules, curriculum,
checkpoint folders (manifest, partial/corrupt detection, latest, pruning), AdamW parameter groups."""
import json
import math
import re

import pytest
import torch

from lm.train import checkpoint as ck
from lm.train.config import config_from_dict, load_train_config
from lm.train.curriculum import paper_curriculum, parse_curriculum, phase_index
from lm.train.schedule import lr_at, warmup_steps_of


def _cfg(**tree):
    base = {"train": {"steps": 10}}
    for k, v in tree.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return config_from_dict(base)


# ------------------------------------------------------------------------------------------- config

def test_config_rejects_unknown_keys_wrong_types_and_ranges(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['train.stepz'\]"):
        _cfg(train={"stepz": 3})
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['modle'\]"):
        config_from_dict({"modle": {}, "train": {"steps": 1}})
    with pytest.raises(ValueError, match=r"train.micro_batch_size: expected int"):
        _cfg(train={"micro_batch_size": "eight"})
    with pytest.raises(ValueError, match=r"train.micro_batch_size: must be >= 1"):
        _cfg(train={"micro_batch_size": 0})
    with pytest.raises(ValueError, match=r"both train.steps=10 and train.tokens=100 are set .*add train.tokens=null "
                                         r"to train 10 steps, or train.steps=null"):
        _cfg(train={"tokens": 100})
    with pytest.raises(ValueError, match=r"set one of train.tokens and train.steps"):
        _cfg(train={"steps": None})
    with pytest.raises(ValueError, match=r"schedule.kind"):
        _cfg(schedule={"kind": "linear"})
    with pytest.raises(ValueError, match=r"'last_phase' needs a curriculum"):
        _cfg(schedule={"decay_start": "last_phase"})
    with pytest.raises(ValueError, match=r"model.implicit"):
        _cfg(curriculum="paper", model={"implicit": {"max_iter": 2}})


def test_config_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  tokens: 1e6\n  micro_batch_size: 4\noptim:\n  lr: 1e-3\ncurriculum: paper\n")
    cfg = load_train_config(p, ["train.micro_batch_size=2", "optim.betas=[0.9, 0.99]",
                                "model.overrides={hidden_size: 64}", "schedule.decay_start=last_phase"])
    assert cfg.train.tokens == 1_000_000 and cfg.train.micro_batch_size == 2
    assert cfg.optim.lr == 1e-3 and cfg.optim.betas == [0.9, 0.99]
    assert cfg.model.overrides == {"hidden_size": 64} and cfg.curriculum == "paper"
    with pytest.raises(ValueError, match="unknown config key"):
        load_train_config(p, ["optim.learning_rate=1"])
    with pytest.raises(ValueError, match="expected key=value"):
        load_train_config(p, ["optim.lr"])
    with pytest.raises(ValueError, match="not found"):
        load_train_config(tmp_path / "nope.yaml")


def test_shipped_train_configs_parse():
    from pathlib import Path

    from lm.resources import configs_dir

    root = configs_dir("train")
    files = sorted(root.glob("*.yaml"))
    assert any(f.name == "default.yaml" for f in files)
    for f in files:
        load_train_config(f)
    for f in (root.parent / "deepspeed").glob("*.json"):
        json.loads(f.read_text())


# ----------------------------------------------------------------------------------------- schedule

def test_schedules():
    kw = dict(peak_lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, 100, kind="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(9, 100, kind="cosine", **kw) == pytest.approx(1.0)
    assert lr_at(99, 100, kind="cosine", **kw) == pytest.approx(0.1)
    mid = 10 + 45 - 1  # half of the cosine span
    assert lr_at(mid, 100, kind="cosine", **kw) == pytest.approx(0.55)
    for kind in ("wsd", "constant_sqrt"):
        assert lr_at(79, 100, kind=kind, decay_start_step=80, **kw) == 1.0
        assert lr_at(99, 100, kind=kind, decay_start_step=80, **kw) == pytest.approx(0.1)
    # square-root cooldown: 1 - sqrt(p); p = 5/20 at step 84
    assert lr_at(84, 100, kind="constant_sqrt", decay_start_step=80, **kw) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(0.25)))
    assert lr_at(84, 100, kind="wsd", decay_start_step=80, **kw) == pytest.approx(1.0 - 0.9 * 0.25)
    assert lr_at(50, 100, kind="constant", **kw) == 1.0
    assert warmup_steps_of(0.05, 200) == 10 and warmup_steps_of(7, 200) == 7
    with pytest.raises(ValueError, match="schedule.kind"):
        lr_at(0, 10, kind="step", peak_lr=1.0)


# --------------------------------------------------------------------------------------- curriculum

def test_paper_curriculum_and_phase_index():
    m = paper_curriculum("lm_mamba2")
    assert [p.name for p in m] == ["bounded", "free"] and m[0].until == 0.8
    assert (m[0].implicit.max_iter, m[0].implicit.phantom_steps, m[0].implicit.tol) == (4, 1, None)
    assert (m[1].implicit.max_iter, m[1].implicit.phantom_steps, m[1].implicit.tol) == (24, 4, 0.05)
    ll = paper_curriculum("lm_llama")
    assert (ll[1].implicit.max_iter, ll[1].implicit.phantom_steps) == (32, 4)
    assert [phase_index(m, f) for f in (0.0, 0.79, 0.8, 0.99, 1.0)] == [0, 0, 1, 1, 1]
    from lm.models.presets import build_model, load_config

    model = build_model(load_config("lm_mamba2-tiny", implicit=m[0].implicit), device="cpu")
    model.set_solver(m[1].implicit)  # held by the model; the shared config keeps its saved default
    assert model.solver is m[1].implicit and model.config.implicit is m[0].implicit
    saved = model.solver_config()  # what a training checkpoint writes: the config with the phase's settings
    assert saved is not model.config and saved.implicit is m[1].implicit and model.config.implicit is m[0].implicit
    explicit = build_model(load_config("lm_mamba2-tiny"), device="cpu")
    with pytest.raises(ValueError, match="built explicit"):
        explicit.set_solver(m[1].implicit)


def test_solver_settings_are_one_typed_object_from_yaml_to_the_model(tmp_path):
    from lm.models import ImplicitSettings

    p = tmp_path / "c.yaml"
    p.write_text("train:\n  steps: 3\nmodel:\n  implicit: {max_iter: 3, tol: 0.1}\n")
    cfg = load_train_config(p)
    assert cfg.model.implicit == ImplicitSettings(max_iter=3, tol=0.1)
    with pytest.raises(ValueError, match=r"model.implicit.max_iter: must be an integer >= 1"):
        load_train_config(p, ["model.implicit={max_iter: 0}"])
    cur = load_train_config(None, ["train.steps=3", "curriculum=[{until: 1.0, implicit: {max_iter: 2}}]"])
    assert isinstance(cur.curriculum[0].implicit, ImplicitSettings)
    # the dict form round-trips (train_config.json, client.json, resume)
    assert config_from_dict(json.loads(json.dumps(cur.to_dict()))).curriculum == cur.curriculum
    # config.json stores a dict; from_pretrained gives the typed object back
    from transformers import AutoModelForCausalLM

    from lm.models.presets import build_model, load_config

    model = build_model(load_config("lm_mamba2-tiny", implicit=cfg.model.implicit), device="cpu")
    model.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["implicit"]["tol"] == 0.1
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "m").config.implicit == cfg.model.implicit


def test_malformed_yaml_override_is_one_paragraph():
    with pytest.raises(ValueError, match=r"override 'model.overrides=\{hidden_size: 256': the value .* is not "
                                         r"valid YAML .*quote the whole item"):
        load_train_config(None, ["train.steps=3", "model.overrides={hidden_size: 256"])


def test_curriculum_validation():
    with pytest.raises(ValueError, match=r"curriculum\[1\].until"):
        parse_curriculum([{"until": 0.5, "implicit": {}}, {"until": 0.4, "implicit": {}}])
    with pytest.raises(ValueError, match=r"last phase must end at 1.0"):
        parse_curriculum([{"until": 0.5, "implicit": {}}])
    with pytest.raises(ValueError, match=r"curriculum\[0\].implicit: unknown key"):
        parse_curriculum([{"until": 1.0, "implicit": {"iters": 3}}])
    with pytest.raises(ValueError, match=r"curriculum\[0\]: unknown key"):
        parse_curriculum([{"until": 1.0, "implicit": {}, "lr": 1}])


# --------------------------------------------------------------------------------------- checkpoint

def _fake_ckpt(root, step, payload=b"x" * 100):
    stage = ck.staging_dir(root, ck.tag_of(step))
    stage.mkdir(parents=True)
    (stage / "weights.pt").write_bytes(payload)
    ck.write_manifest(stage, {"step": step})
    return ck.publish(root, ck.tag_of(step), keep_last=2)


def test_checkpoint_publish_latest_prune_and_verify(tmp_path):
    root = ck.checkpoints_root(tmp_path)
    for s in (1, 2, 3):
        _fake_ckpt(root, s)
    assert [s for s, _ in ck.list_checkpoints(root)] == [2, 3]
    assert (root / "latest").read_text().strip() == "step_00000003"
    assert ck.resolve(tmp_path) == root / "step_00000003"
    assert ck.verify(root / "step_00000002")["step"] == 2
    # truncated file -> corrupt
    (root / "step_00000003" / "weights.pt").write_bytes(b"x" * 10)
    with pytest.raises(ValueError, match=r"corrupt: weights.pt has 10 bytes.*earlier checkpoints: .*step_00000002"):
        ck.resolve(tmp_path)
    # same size, other bytes (changed in place): the content hash names the file and the earlier checkpoints
    (root / "step_00000003" / "weights.pt").write_bytes(b"y" * 100)
    with pytest.raises(ValueError, match=r"corrupt: weights.pt has other bytes than were written.*"
                                         r"earlier checkpoints: .*step_00000002"):
        ck.resolve(tmp_path)
    assert ck.resolve(tmp_path, hashes=False) == root / "step_00000003"  # sizes alone do not see it
    # a folder without manifest (a save that died before publishing) -> partial
    (root / "step_00000004").mkdir()
    with pytest.raises(ValueError, match="is partial"):
        ck.resolve(root / "step_00000004")
    with pytest.raises(ValueError, match="no checkpoint found"):
        ck.resolve(tmp_path / "elsewhere")
    # nothing was deleted by the failed resolves
    assert (root / "step_00000002" / "weights.pt").is_file()


# ------------------------------------------------------------------------------------------- optim

def test_no_weight_decay_on_norms_biases_alog_dtbias():
    from lm.models.presets import build_model, load_config
    from lm.train.optim import param_groups

    model = build_model(load_config("lm_mamba2-tiny", implicit={"max_iter": 2}), device="cpu")
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert any(n.endswith("A_log") for n in nd) and any(n.endswith("dt_bias") for n in nd)
    assert any(n.endswith("norm.weight") for n in nd) and any(n.endswith("conv1d.bias") for n in nd)
    assert all(not n.endswith(("A_log", "dt_bias", "bias")) and "norm" not in n.split(".")[-2] for n in d)
    assert any(n.endswith("in_proj.weight") for n in d) and any("injection.proj" in n for n in d)


def test_paper_curriculum_only_for_the_paper_families():
    import pytest

    from lm.train.curriculum import paper_curriculum

    assert paper_curriculum("lm_llama")[1].implicit.max_iter == 32
    assert paper_curriculum("lm_mamba2")[1].implicit.max_iter == 24
    with pytest.raises(ValueError, match="give the phases explicitly"):
        paper_curriculum("lm_deltaproduct")


def test_auto_engine_is_plain_torch_for_one_process():
    from lm.train.distributed import resolve_auto_engine

    assert resolve_auto_engine(1, None, True) == "torch"  # one GPU: DeepSpeed only adds overhead
    assert resolve_auto_engine(2, None, True) == "deepspeed"
    assert resolve_auto_engine(1, "configs/deepspeed/zero2_offload.json", True) == "deepspeed"
    assert resolve_auto_engine(1, None, False) == "torch"
    assert resolve_auto_engine(4, None, False) == "torch"  # Dist then refuses torch with several ranks


def test_manifest_hashes_come_from_the_bytes_as_written(tmp_path):
    import hashlib

    import torch

    hashes = {}
    with ck.HashingWriter(tmp_path / "w.pt", hashes) as f:
        torch.save({"x": torch.arange(1000)}, f)
    digest, size = hashes[str((tmp_path / "w.pt").resolve())]
    data = (tmp_path / "w.pt").read_bytes()
    assert digest == hashlib.sha256(data).hexdigest() and size == len(data)
    assert torch.equal(torch.load(tmp_path / "w.pt")["x"], torch.arange(1000))
    # the manifest takes the recorded hash (no second read of the file); files written otherwise are read
    (tmp_path / "small.json").write_text("{}")
    hashes[str((tmp_path / "w.pt").resolve())] = ("recorded", size)
    files = ck.file_records(tmp_path, hashes)
    assert files["w.pt"] == {"bytes": size, "sha256": "recorded"}
    assert files["small.json"]["sha256"] == hashlib.sha256(b"{}").hexdigest()


@pytest.mark.parametrize("norm", [3.0, 0.5, float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_zero_unscale_and_clip_equals_deepspeeds(norm, clip):
    """The trainer's ZeRO-1/2 unscale_and_clip_grads (lm.train.engine._unscale_and_clip_grads: the invalid norm
    chosen on the device, no host read) scales the gradient partitions exactly as DeepSpeed's own, for valid,
    non-finite and sentinel (-1) norms, with and without clipping, on flat and listed partitions."""
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from lm.train.engine import _unscale_and_clip_grads

    gen = torch.Generator().manual_seed(int(abs(norm) * 7 if norm == norm and abs(norm) != float("inf") else 5))
    flat = [torch.randn(33, generator=gen), [torch.randn(5, generator=gen), torch.randn(7, generator=gen)]]
    for total in (torch.tensor(norm), torch.tensor([norm])):
        ours, theirs = ([g.clone() if torch.is_tensor(g) else [x.clone() for x in g] for g in flat] for _ in range(2))
        opt = SimpleNamespace(clip_grad=clip, loss_scale=1.0, device=torch.device("cpu"))
        _unscale_and_clip_grads(opt, ours, total)
        DeepSpeedZeroOptimizer.unscale_and_clip_grads(opt, theirs, total)
        for a, b in zip(ours, theirs):
            for x, y in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b]):
                assert torch.equal(x, y), (norm, clip, x, y)


# ------------------------------------------------------------------------------------- loop components

class _Budget:
    """A TimeBudget stand-in whose answers the test sets."""

    def __init__(self, out=False, slice_=False):
        self.out, self.slice_, self.agreed = out, slice_, None

    def out_of_time(self):
        return self.out

    def slice_done(self):
        return self.slice_

    def agree(self, s):
        self.agreed = s


def _stop(world=1, signal=None, max_bad=3, **budget):
    from types import SimpleNamespace

    from lm.train.stopping import Stop

    return Stop(at=10, budget=_Budget(**budget), signals=SimpleNamespace(signal_name=signal),
                dist=SimpleNamespace(world=world), max_bad_steps=max_bad)


def _res(step, skipped=False, signalled=False, clock_s=0.0):
    from types import SimpleNamespace

    return SimpleNamespace(step=step, skipped=skipped, signalled=signalled, clock_s=clock_s)


def test_stop_records_one_reason_and_signals_apart(tmp_path):
    """The loop's one stop path: the first time reason is kept, a target accuracy replaces it (complete), the NaN
    policy fails the run at max_bad_steps in a row (a finite step resets the count), a signal ends it whatever the
    reason; with several ranks the budget answers from the ranks' mean clock."""
    s = _stop()
    assert not s.now and s.reason is None
    s.check_time(3)
    assert not s.now
    s.budget.slice_ = True
    s.check_time(10)  # at the last step a spent slice is no reason: the run ends there anyway
    assert s.reason is None
    s.check_time(4)
    assert s.reason == "slice" and s.now and not s.complete(4, 10) and s.summary_reason() == "slice"
    s.budget.out = True
    s.check_time(5)
    assert s.reason == "slice"  # the first reason stays
    s.target_reached()
    assert s.reason == "target accuracy" and s.complete(5, 10)
    assert _stop(out=True).reason == "time budget"  # a resumed run whose budget is spent runs no step

    s = _stop(max_bad=2)
    for step, skipped in [(1, True), (2, False), (3, True)]:
        s.read(_res(step, skipped))
    assert not s.failed and s.bad_in_row == 1
    s.read(_res(4, True))
    assert s.failed and s.failed_at == 4 and s.now and s.summary_reason() is None
    s.target_reached()  # a failed run stays failed
    assert s.failed
    assert re.match("stopped at step 4: 2 steps in a row.*no checkpoint was written", str(s.failure(tmp_path)))

    s = _stop(world=2)
    s.read(_res(1, clock_s=6.0))
    assert s.budget.agreed == 3.0 and not s.signal
    s.read(_res(2, signalled=True))
    assert s.signal and s.now and s.reason is None and s.signal_name() == "a signal on another rank"
    assert not s.signal_local()
    one = _stop(signal="SIGTERM")
    assert one.signal_local() and one.signal_name() == "SIGTERM"


def test_task_component_interface():
    """NoTask (a language-model run) and the synthetic task's hook offer the same methods with the same
    parameters, so the loop calls them without asking which it has."""
    import inspect

    from lm.eval.synthetic import TaskEvalHook
    from lm.train.synth import NoTask, task_component

    for name, fn in inspect.getmembers(NoTask, inspect.isfunction):
        theirs = getattr(TaskEvalHook, name)
        assert list(inspect.signature(theirs).parameters) == list(inspect.signature(fn).parameters), name
    assert isinstance(task_component(_cfg(), None, None, None), NoTask)


def test_curriculum_component_switches_and_records(tmp_path):
    """Curriculum: the phase of each step set on the model, a phase_switch event for every switch after the first
    phase, a console line for each; resume sets the checkpoint's phase without an event."""
    from types import SimpleNamespace

    from lm.train.curriculum import Curriculum

    phases = parse_curriculum([{"name": "a", "until": 0.5, "implicit": {"max_iter": 2}},
                               {"name": "b", "until": 1.0, "implicit": {"max_iter": 5}}])
    set_to, events, lines = [], [], []
    model = SimpleNamespace(set_solver=set_to.append)
    c = Curriculum(phases, model, total_steps=4, tokens_per_step=10, logger=SimpleNamespace(log=events.append),
                   console=SimpleNamespace(write=lines.append))
    for step in range(4):
        c.enter(step)
    assert [s.max_iter for s in set_to] == [2, 5] and c.phase == "b"
    assert [(e["step"], e["tokens"], e["phase"]) for e in events] == [(2, 20, "b")]
    assert lines == ["step 0: curriculum phase a (2+1, no tol) until 50% of tokens",
                     "step 2: curriculum phase b (5+1, no tol) until 100% of tokens"]
    assert c.client() == {"phase_index": 1, "phase": "b"}
    r = Curriculum(phases, model, total_steps=4, tokens_per_step=10, logger=SimpleNamespace(log=events.append),
                   console=SimpleNamespace(write=lines.append))
    r.resume(1)
    r.enter(3)
    assert set_to[-1].max_iter == 5 and len(events) == 1 and len(lines) == 2
    none = Curriculum(None, model, total_steps=4, tokens_per_step=10, logger=None, console=None)
    none.enter(0)
    none.resume(None)
    assert none.client() == {"phase_index": None, "phase": None} and len(set_to) == 3


def test_deepspeed_overrides_only_on_tested_versions(monkeypatch, capsys):
    """Each DeepSpeed override is installed on the versions it was tested with only; on another version DeepSpeed's
    own method stays and one line says so, once per override and process."""
    pytest.importorskip("deepspeed")
    import lm.train.engine as E

    assert E.deepspeed_version() in E.TESTED_DEEPSPEED  # the lock's DeepSpeed
    assert all(E.use_override(name) for name in E.OVERRIDES)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(E, "_warned", set())
    for version in ((0, 18), (0, 20), (1, 0)):
        monkeypatch.setattr(E, "deepspeed_version", lambda v=version: v)
        assert not any(E.use_override(name) for name in E.OVERRIDES)
        E.use_override("fused_grad_checks")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == len(E.OVERRIDES)  # once per override (the first untested version's)
    assert lines[0] == ("lm train: DeepSpeed 0.18 is not a version lm's fused_grad_checks override was tested with "
                        f"(0.19.x): DeepSpeed's own method runs ({E.OVERRIDES['fused_grad_checks']})")
