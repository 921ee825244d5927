"""--resume as clusters and users do it (issue 58): the checkpoint's config is compared with the new one (another
model, data or global batch is refused with the keys named and nothing in the run changed; the length of the run,
logging and cadence may change; a defining key changes only when listed in checkpoint.allow_change), and a
DeepSpeed ZeRO-2 run resumed at another number of ranks with the same global batch, 2 ranks -> 1 -> 3 (gloo),
trains on with the losses of the uninterrupted 2-rank run: the ZeRO partitions re-split through DeepSpeed's
universal checkpoint and every rank at the data position an uninterrupted run would have reached."""
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from train_checks import TINY, tiny_run_tree

from lm.train.config import config_from_dict
from lm.train.trainer import train

pytestmark = pytest.mark.slow  # every test trains


def _tree(run_dir, *layers):
    return tiny_run_tree(run_dir, {
        "model": {"overrides": {**TINY, "vocab_size": 64}, "implicit": {"max_iter": 2, "phantom_steps": 1}},
        "data": {"source": "synthetic", "synthetic_vocab": 64, "seq_len": 16},
        "train": {"steps": 4, "global_batch_tokens": 64},
        "checkpoint": {"every_steps": 2},
    }, *layers)


def _snapshot(folder: Path) -> dict:
    """Every file under the folder with the sha256 of its bytes."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _losses(run):
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in recs if "event" not in r}, recs


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run stopped at step 2 of 4 (its checkpoint at 2)."""
    run = tmp_path_factory.mktemp("resume") / "run"
    train(config_from_dict(_tree(run, {"train": {"stop_after_steps": 2}})))
    return run


def _copy(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst


@pytest.mark.parametrize("change,keys", [
    ({"model": {"preset": "lm_mamba2-130m"}}, ["model.preset"]),
    ({"model": {"overrides": {**TINY, "vocab_size": 64, "hidden_size": 64}}}, ["model.overrides.hidden_size"]),
    ({"data": {"seq_len": 32}, "train": {"global_batch_tokens": 64}}, ["data.seq_len"]),
    ({"data": {"synthetic_vocab": 32}}, ["data.synthetic_vocab"]),
    ({"model": {"implicit": {"max_iter": 3, "phantom_steps": 1}}, "train": {"seed": 1}},
     ["model.implicit.max_iter", "train.seed"]),
], ids=["preset", "hidden_size", "seq_len", "data", "solver+seed"])
def test_another_model_or_data_is_refused_and_nothing_changes(stopped_run, tmp_path, change, keys):
    run = _copy(stopped_run, tmp_path)
    before = _snapshot(run)
    with pytest.raises(ValueError) as err:
        train(config_from_dict(_tree(run, change, {"checkpoint": {"resume": True}})))
    msg = str(err.value)
    assert "belongs to a run with another model or data" in msg, msg
    for k in keys:
        assert f"  {k}: " in msg, msg
    assert f"--allow-change {','.join(sorted(keys))}" in msg and "model.init_from=DIR" in msg, msg
    assert "corrupt" not in msg
    assert _snapshot(run) == before  # train_config.json, metrics.jsonl and the checkpoints as they were


def test_another_global_batch_is_refused_with_the_way_to_do_it(stopped_run, tmp_path):
    run = _copy(stopped_run, tmp_path)
    before = _snapshot(run)
    with pytest.raises(ValueError, match=r"trained with train.global_batch_tokens=64, this config has 128.*keeps its "
                                         r"global batch \(at any number of ranks: set train.global_batch_tokens=64 "
                                         r"to resume\).*lm export .*model.init_from=DIR"):
        train(config_from_dict(_tree(run, {"train": {"global_batch_tokens": 128},
                                           "checkpoint": {"resume": True}})))
    assert _snapshot(run) == before
    with pytest.raises(ValueError, match=r"checkpoint.allow_change: .*train.global_batch_tokens never changes"):
        config_from_dict(_tree(run, {"checkpoint": {"allow_change": ["train.global_batch_tokens"]}}))
    with pytest.raises(ValueError, match=r"'log.every_steps' is not a key a resume keeps"):
        config_from_dict(_tree(run, {"checkpoint": {"allow_change": ["log.every_steps"]}}))


def test_run_length_logging_and_cadence_may_change(stopped_run, tmp_path, capfd):
    run = _copy(stopped_run, tmp_path)
    capfd.readouterr()
    s = train(config_from_dict(_tree(run, {"train": {"steps": 6}, "log": {"every_steps": 2},
                                           "checkpoint": {"resume": True, "every_steps": 3}})))
    assert s["steps"] == 6
    out = capfd.readouterr()
    printed = out.out + out.err
    assert "changed since the checkpoint: train.steps: 4 -> 6" in printed, printed
    assert "changed since the checkpoint: log.every_steps: 1 -> 2" in printed, printed
    start = [r for r in _losses(run)[1] if r.get("event") == "start"][-1]
    assert "checkpoint.every_steps: 2 -> 3" in start["config_changes"]
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["train"]["steps"] == 6  # written once the checks passed


def test_a_defining_key_changes_when_allowed(stopped_run, tmp_path):
    run = _copy(stopped_run, tmp_path)
    cfg = _tree(run, {"model": {"implicit": {"max_iter": 3, "phantom_steps": 1}},
                      "checkpoint": {"resume": True, "allow_change": ["model.implicit"]}})
    s = train(config_from_dict(cfg))
    assert s["steps"] == 4
    _, recs = _losses(run)
    assert "model.implicit.max_iter: 2 -> 3" in [r for r in recs if r.get("event") == "start"][-1]["config_changes"]
    assert all(r["fp/iterations"] == 3 for r in recs if "event" not in r and r["step"] > 2)


def test_weights_of_another_shape_are_named_not_called_corrupt(stopped_run, tmp_path):
    """A model change allowed on purpose whose weights do not fit: the message says so, the checkpoint is intact."""
    run = _copy(stopped_run, tmp_path)
    before = _snapshot(run)
    cfg = _tree(run, {"model": {"overrides": {**TINY, "vocab_size": 64, "hidden_size": 64}},
                      "checkpoint": {"resume": True, "allow_change": ["model.overrides"]}})
    with pytest.raises(ValueError, match=r"the weights in .*step_00000002 do not fit this config's model \(.*size "
                                         r"mismatch.*config.json.*The checkpoint is intact") as err:
        train(config_from_dict(cfg))
    assert "corrupt" not in str(err.value)
    assert _snapshot(run) == before


def test_cli_allow_change_flag(stopped_run, tmp_path):
    run = _copy(stopped_run, tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_tree(run, {"model": {"implicit": {"max_iter": 3, "phantom_steps": 1}}})))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "lm.train", str(cfg), "--resume"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 2 and "--allow-change model.implicit.max_iter" in p.stderr, p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "lm.train", str(cfg), "--resume", "--allow-change",
                        "model.implicit.max_iter"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "changed since the checkpoint: model.implicit.max_iter: 2 -> 3" in p.stdout + p.stderr


def test_plain_engine_resumes_with_another_micro_batch(tmp_path):
    """The plain engine runs one process; what it can change on resume with the same global batch is the micro-batch
    (and so the accumulation): the run goes on with the uninterrupted run's losses."""
    ref = tmp_path / "ref"
    train(config_from_dict(_tree(ref, {"train": {"steps": 4, "global_batch_tokens": 128}})))
    run = tmp_path / "run"
    train(config_from_dict(_tree(run, {"train": {"steps": 4, "global_batch_tokens": 128, "stop_after_steps": 2}})))
    train(config_from_dict(_tree(run, {"train": {"steps": 4, "global_batch_tokens": 128, "micro_batch_size": 1},
                                       "checkpoint": {"resume": True}})))
    want, _ = _losses(ref)
    got, recs = _losses(run)
    assert [r["accumulation"] for r in recs if r.get("event") == "start"] == [4, 8]
    assert sorted(got) == [1, 2, 3, 4]
    for s in (3, 4):
        assert got[s] == pytest.approx(want[s], rel=1e-5), (s, got[s], want[s])


# ---------------------------------------------------------------------------------------- another world size


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(n, config, *extra):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if n == 1:
        cmd = [sys.executable, "-m", "lm.train", str(config), *extra]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
               str(_port()), "-m", "lm.train", str(config), *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p.stdout + p.stderr


def _only(run, src, tag):
    """A run folder holding one checkpoint of another run."""
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / tag, run / "checkpoints" / tag)
    (run / "checkpoints" / "latest").write_text(tag + "\n")


@pytest.mark.multirank
def test_zero2_resumes_at_other_world_sizes_with_the_same_losses(tmp_path, tmp_path_factory):
    pytest.importorskip("deepspeed")
    from test_train_loop import make_corpus

    from lm.train.checkpoint import verify

    data = make_corpus(tmp_path_factory)
    ref = tmp_path / "ref"
    cfg = tmp_path / "tiny.yaml"
    # 6 micro-batches of 2 x 32 tokens per step: 3 per rank at 2 ranks, 6 at 1, 2 at 3; engine auto: DeepSpeed at
    # several ranks, and at one rank because the checkpoint is DeepSpeed's
    cfg.write_text(yaml.safe_dump(tiny_run_tree(ref, {
        "model": {"implicit": {"max_iter": 2, "phantom_steps": 1}},
        "data": {"path": str(data), "seq_len": 32},
        "schedule": {"kind": "cosine", "warmup": 1},
        "train": {"steps": 6, "global_batch_tokens": 384, "engine": "auto", "zero_stage": 2},
        "checkpoint": {"every_steps": 2}})))
    _ranks(2, cfg)
    losses, recs = _losses(ref)
    assert next(r for r in recs if r.get("event") == "start")["engine"] == "deepspeed"
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]

    # 2 ranks -> 1: steps 3, 4 (stopped after 4, its checkpoint written)
    one = tmp_path / "one"
    _only(one, ref, "step_00000002")
    source = one / "checkpoints" / "step_00000002"
    before = _snapshot(source)
    out = _ranks(1, cfg, f"run_dir={one}", "train.stop_after_steps=4", "--resume")
    assert "engine deepspeed on cpu, resumed at step 2 (written by 2 ranks)" in out, out[-3000:]
    assert _snapshot(source) == before  # the checkpoint is only read
    assert not (one / "checkpoints" / ".tmp" / "universal").exists()
    got1, recs1 = _losses(one)
    start = next(r for r in recs1 if r.get("event") == "start")
    assert (start["world_size"], start["accumulation"], start["resumed_world_size"]) == (1, 6, 2)
    ck4 = one / "checkpoints" / "step_00000004"
    verify(ck4)
    assert {p.name for p in ck4.glob("*optim_states.pt")} == {"zero_pp_rank_0_mp_rank_00_optim_states.pt"}

    # 1 rank -> 3: steps 5, 6
    three = tmp_path / "three"
    _only(three, one, "step_00000004")
    _ranks(3, cfg, f"run_dir={three}", "--resume")
    got3, recs3 = _losses(three)
    assert next(r for r in recs3 if r.get("event") == "start")["accumulation"] == 2
    assert sorted(got1) == [3, 4] and sorted(got3) == [5, 6]
    resumed = {**got1, **got3}
    for s in (3, 4, 5, 6):  # the same data, weights and optimizer state: float32 summation order differs only
        assert resumed[s] == pytest.approx(losses[s], rel=2e-5, abs=1e-6), (s, resumed[s], losses[s])
    assert {p.name for p in (three / "checkpoints" / "step_00000006").glob("*optim_states.pt")} == {
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)}
