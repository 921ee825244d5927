"""Runs that survive clusters and users (issue 27): checkpoint files hashed as written and checked on resume,
one trainer per run folder (lock, stale locks taken over), SIGTERM -> checkpoint -> exact resume, kill -9 ->
metrics.jsonl with every step once, --resume on a finished run, MFU from the iterations run, and the
one-paragraph errors of `lm generate` / `lm eval` / `lm --help`. Tiny synthetic-data runs, one thread."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import train_checks

from lm.train.config import config_from_dict
from lm.train.preempt import EXIT_PREEMPTED, Preempted
from lm.train.trainer import train

REPO = Path(__file__).resolve().parents[1]
TINY = {**train_checks.TINY, "vocab_size": 64}


def _tree(run_dir, **over):
    return train_checks.tiny_run_tree(run_dir, {
        "model": {"overrides": dict(TINY), "implicit": {"max_iter": 6, "tol": 0.3, "phantom_steps": 1}},
        "data": {"source": "synthetic", "synthetic_vocab": 64, "seq_len": 16},
        "schedule": {"kind": "cosine", "warmup": 1},
        "train": {"global_batch_tokens": 64},
        "checkpoint": {"every_steps": 2},
    }, over)


def _cfg(run_dir, **over):
    return config_from_dict(_tree(run_dir, **over))


def _records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in _records(run_dir) if "event" not in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 6-step run."""
    run = tmp_path_factory.mktemp("ref") / "run"
    train(_cfg(run))
    return run


def test_sigterm_checkpoints_then_resume_equals_uninterrupted(tmp_path, reference):
    def term_in_step_3(step, micro, out):
        if step == 2 and micro == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    run = tmp_path / "run"
    with pytest.raises(Preempted, match=r"stopped by SIGTERM after step 3 of 6; checkpoint .*step_00000003 written"):
        train(_cfg(run), hooks={"after_forward": term_in_step_3})
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert [r["event"] for r in _records(run) if r.get("event") in ("preempted", "end")] == ["preempted"]
    assert not (run / "lock").exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handlers are restored
    train(_cfg(run, checkpoint={"resume": True}))
    assert _losses(run) == _losses(reference)  # bitwise: same data, RNG and optimizer state
    steps = [r["step"] for r in _records(run) if "event" not in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_mfu_counts_the_iterations_the_solver_ran(reference):
    from lm.models.presets import flops_per_token, load_config

    config = load_config("lm_mamba2-tiny", **TINY, implicit={"max_iter": 6, "tol": 0.3, "phantom_steps": 1})
    for r in (r for r in _records(reference) if "event" not in r):
        assert r["fp/iterations"] < 6  # the tolerance stops the solve before max_iter
        assert r["flops_per_token"] == pytest.approx(flops_per_token(config, 16, r["fp/iterations"])["train"])
        assert r["flops_per_token"] < flops_per_token(config, 16)["train"]


def test_in_place_corruption_is_caught_with_the_file_named(tmp_path):
    run = tmp_path / "run"
    train(_cfg(run, train={"steps": 4}, checkpoint={"every_steps": 1}))
    w = run / "checkpoints" / "step_00000004" / "model_optim.pt"
    size = w.stat().st_size
    with open(w, "r+b") as f:  # 4 KB overwritten in the middle: same size
        f.seek(size // 2)
        f.write(os.urandom(4096))
    assert w.stat().st_size == size
    with pytest.raises(ValueError, match=r"step_00000004 is corrupt: model_optim.pt has other bytes than were "
                                         r"written.*earlier checkpoints: .*step_00000003"):
        train(_cfg(run, train={"steps": 6}, checkpoint={"every_steps": 1, "resume": True}))
    # an earlier checkpoint resumes
    train(_cfg(run, train={"steps": 6}, checkpoint={"every_steps": 1,
                                                     "resume": str(run / "checkpoints" / "step_00000003")}))
    assert sorted(_losses(run)) == [1, 2, 3, 4, 5, 6]


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_second_trainer_is_refused_and_a_stale_lock_taken_over(tmp_path):
    import socket

    run = tmp_path / "run"
    run.mkdir()
    holder = _sleeper()
    try:
        lock = {"host": socket.gethostname(), "pid": holder.pid, "slurm_job": None, "started": "2026-11-25 10:00:00"}
        (run / "lock").write_text(json.dumps(lock))
        with pytest.raises(ValueError, match=rf"is in use by another trainer \(host {socket.gethostname()}, pid "
                                             rf"{holder.pid}, started 2026-11-25 10:00:00"):
            train(_cfg(run))
        assert sorted(p.name for p in run.iterdir()) == ["lock"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone (same host, dead pid): the lock is stale and taken over
    train(_cfg(run, train={"steps": 2}))
    assert not (run / "lock").exists() and (run / "checkpoints" / "latest").is_file()
    # another host's lock is live while its heartbeat is fresh, stale after STALE_S
    from lm.train.rundir import STALE_S, RunLock

    (run / "lock").write_text(json.dumps({**lock, "host": "node-elsewhere", "pid": 1}))
    with pytest.raises(ValueError, match="host node-elsewhere, pid 1"):
        RunLock(run).acquire()
    old = time.time() - STALE_S - 5
    os.utime(run / "lock", (old, old))
    RunLock(run).acquire().release()
    assert not (run / "lock").exists()


def _slow_run(run, hang_from: int, **popen):
    """A training process (the _tree config) whose step `hang_from` + 1 hangs, started once step `hang_from`
    is logged (and the checkpoint before it written). It hangs in short sleeps: a signal that the kernel hands to
    another of the process's threads does not wake the main thread from one long sleep, and Python runs the
    handler only when the main thread runs again (the second-signal test then waited out the whole sleep)."""
    script = textwrap.dedent(f"""
        import json, sys, time
        from lm.train.config import config_from_dict
        from lm.train.trainer import train
        def slow(step, micro, out):
            if step >= {hang_from}:
                for _ in range(1200):
                    time.sleep(0.1)
            return out
        train(config_from_dict(json.loads(sys.argv[1])), hooks={{"after_forward": slow}})
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return _wait_logged(subprocess.Popen([sys.executable, "-c", script, json.dumps(_tree(run))], env=env, **popen),
                        run, hang_from)


def _wait_logged(proc, run, step: int):
    """Wait until the training process `proc` has logged the record of `step` in run/metrics.jsonl."""
    deadline = time.time() + 240
    while not ((run / "metrics.jsonl").is_file()
               and any(r.get("step") == step and "loss" in r for r in _records(run))):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"step {step} was not logged (process exit {proc.poll()})")
        time.sleep(0.5)
    return proc


def _signal(proc, *signals) -> str:
    """Send the signals a second apart, wait for the process to end; its stderr."""
    try:
        for i, sig in enumerate(signals):
            if i:
                time.sleep(1.0)
            proc.send_signal(sig)
        return proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_kill_9_then_resume_leaves_every_step_once_in_metrics(tmp_path, reference):
    run = tmp_path / "run"
    proc = _slow_run(run, 5)  # killed in step 6, after the checkpoint at 4 and the record of 5
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads((run / "lock").read_text())["pid"] == proc.pid  # left behind by kill -9
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    train(_cfg(run, checkpoint={"resume": "auto"}))  # the dead holder's lock is taken over
    steps = [r["step"] for r in _records(run) if "event" not in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # step 5 was trained again; its first record is gone
    assert _losses(run) == _losses(reference)
    from lm.train.plot import main as plot_main

    assert plot_main([str(run)]) == 0


def test_resume_of_a_finished_run_changes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    train(_cfg(run, train={"steps": 2}, checkpoint={"export": True}))
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    s = train(_cfg(run, train={"steps": 2}, checkpoint={"resume": True, "export": True}))
    assert s["finished"] and s["steps"] == 2
    from lm.train.cli import main

    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_tree(run, train={"steps": 2})))
    assert main([str(tmp_path / "c.yaml"), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "is finished" in err and "nothing was trained or changed" in err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before
    # the export has a manifest too: a weights file changed in place is named when it is loaded
    from lm.eval.checkpoint import load_checkpoint

    manifest = json.loads((run / "hf" / "manifest.json").read_text())["files"]
    assert "model.safetensors" in manifest and "config.json" in manifest
    w = run / "hf" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-100:] = bytes(100)
    w.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model folder .*hf is corrupt: model.safetensors has other bytes"):
        load_checkpoint(run / "hf", device="cpu")


def test_sigterm_through_the_cli_exits_75(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "lm.train", f"run_dir={run}", "data.source=synthetic", "data.synthetic_vocab=64",
           "data.seq_len=16", "train.tokens=1e9", "train.global_batch_tokens=32", "train.micro_batch_size=2",
           "train.engine=torch", "log.progress=false", "checkpoint.export=false", "eval.at_end=false",
           "model.overrides={hidden_size: 32, num_hidden_layers: 1, d_state: 8, headdim: 16, vocab_size: 64}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = _wait_logged(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path), run, 1)
    err = _signal(proc, signal.SIGTERM)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "SIGTERM received: finishing this step" in err and "stopped by SIGTERM after step" in err
    assert "Traceback" not in err
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert int(latest.split("_")[1]) >= 1


def test_generate_and_eval_on_bad_folders_say_what_to_do(tmp_path, capsys):
    from lm.eval.generate import main as generate_main
    from lm.eval.harness import main as eval_main

    assert generate_main([str(tmp_path / "nope"), "hi"]) == 2
    assert "is not a model folder (no config.json" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "lm_mamba2", ')
    assert generate_main([str(broken), "hi"]) == 2
    err = capsys.readouterr().err
    assert "could not be loaded as a model" in err and "lm export" in err and "Traceback" not in err
    # a Hub that cannot be reached: a few seconds, one paragraph (a closed local port stands for it)
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    old = {k: os.environ.get(k) for k in (*env, "HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update(env)
    os.environ.pop("HF_DATASETS_OFFLINE", None)
    os.environ.pop("HF_HUB_OFFLINE", None)
    try:
        t0 = time.time()
        assert eval_main([str(broken), "--tasks", "lambada_openai"]) == 2
        assert time.time() - t0 < 10
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    err = capsys.readouterr().err
    assert "lambada_openai (EleutherAI/lambada_openai)" in err and "cannot be reached" in err


def test_lm_help_is_fast_and_imports_no_torch(tmp_path):
    code = ("import sys, time; t = time.time(); sys.argv = ['/venv/bin/lm', '--help']; from lm.cli import main; "
            "main(['--help']); print(time.time() - t, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True).stdout.splitlines()[-1].split()
    assert out[1:] == ["False", "False"] and float(out[0]) < 1.0


def test_a_second_signal_exits_at_once_with_latest_intact(tmp_path):
    run = tmp_path / "run"
    proc = _slow_run(run, 3, stderr=subprocess.PIPE, text=True)  # the signals arrive during step 4
    err = _signal(proc, signal.SIGTERM, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "second signal (SIGTERM): exiting now without a checkpoint" in err
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    from lm.train.checkpoint import resolve

    assert resolve(run).name == "step_00000002"


def test_metrics_are_cut_back_to_the_resumed_checkpoint(tmp_path):
    from lm.train.rundir import truncate_metrics

    lines = [{"step": 3, "loss": 1.0}, {"step": 4, "loss": 0.9}, {"event": "checkpoint", "step": 4},
             {"event": "phase_switch", "step": 4}, {"step": 5, "loss": 0.8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 6, "lo')
    assert truncate_metrics(tmp_path, 4) == 3  # the switch logged after the checkpoint is logged again
    assert _records(tmp_path) == lines[:3]


def test_init_from_an_export_with_other_solver_settings(tmp_path):
    run = tmp_path / "run"
    train(_cfg(run, train={"steps": 2}, checkpoint={"export": True}))
    new = tmp_path / "new"
    s = train(_cfg(new, train={"steps": 2}, checkpoint={"export": True},
                   model={"init_from": str(run / "hf"), "implicit": {"max_iter": 2, "phantom_steps": 1}}))
    assert s["steps"] == 2
    assert json.loads((new / "hf" / "config.json").read_text())["implicit"]["max_iter"] == 2
    (run / "hf" / "config.json").write_text((run / "hf" / "config.json").read_text().replace("32", "33", 1))
    with pytest.raises(ValueError, match=r"model folder .*hf is corrupt: config.json has"):
        train(_cfg(tmp_path / "third", train={"steps": 2}, model={"init_from": str(run / "hf")}))
