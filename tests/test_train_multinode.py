"""Two "nodes" on one machine, on CPU (gloo), launched by scripts/launch.sh as users launch several nodes:

- torchrun: two launcher processes (`NNODES=2 NODE_RANK=0|1 GPUS_PER_NODE=1 scripts/launch.sh torchrun`), one
  c10d rendezvous endpoint on 127.0.0.1. A tiny implicit Mamba2 trains under DeepSpeed ZeRO-2 (synthetic data)
  and checkpoints (one ZeRO partition per rank); resumed from its mid-run checkpoint by two nodes again, the
  losses continue exactly as in the uninterrupted run; resumed by one process with another global batch it is
  refused with a message naming both and what to do, and nothing is written.
- DeepSpeed's launcher: a hostfile with two entries for this machine (`localhost slots=1`, `127.0.0.1 slots=1`:
  DeepSpeed refuses the same name twice) and `NODE_RANK=0|1 scripts/launch.sh deepspeed`, i.e. `deepspeed
  --hostfile ... --no_ssh --node_rank i` started on every node; it resumes the same checkpoint, with the same
  losses. One node x 2 processes (plain torchrun) resumes it as well: the world size counts, not its split.
  DeepSpeed's default multi-node path (one command that reaches the other hosts through pdsh and ssh)
  is not tested: this machine has no pdsh and no ssh server, and that path differs only in how the per-node
  command is started.

Resuming at another world size (same global batch) is tests/test_train_resume.py's.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from train_checks import tiny_run_tree

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "scripts" / "launch.sh"
STEPS = 6


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "WANDB_MODE": "offline", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
              "NNODES", "HOSTFILE", "GPUS_PER_NODE", "LAUNCHER_ARGS"):
        env.pop(k, None)
    env.update(extra)
    return env


def _two_nodes(launcher, config, *args, timeout=240, **env):
    """Start `scripts/launch.sh LAUNCHER CONFIG ARGS` twice (NODE_RANK 0 and 1) and wait for both; their output."""
    procs = []
    for node in (0, 1):
        procs.append(subprocess.Popen(["bash", str(LAUNCH), launcher, str(config), *args], cwd=config.parent,
                                      env=_env(NODE_RANK=str(node), GPUS_PER_NODE="1", **env),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:  # a node left waiting for its peer (rendezvous, collective): stop its process group
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for node, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"node {node} ({launcher}) exited {p.returncode}:\n{out[-6000:]}"
    return outs


def _torchrun(config, *args):
    return _two_nodes("torchrun", config, *args, NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()),
                      RDZV_ID=f"test-{os.getpid()}-{_port()}", LAUNCHER_ARGS="--rdzv_conf join_timeout=120")


def _losses(run):
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in recs if "event" not in r}, recs


def _copy_checkpoint(src_run, tag, dst_run):
    (dst_run / "checkpoints").mkdir(parents=True)
    shutil.copytree(src_run / "checkpoints" / tag, dst_run / "checkpoints" / tag)
    (dst_run / "checkpoints" / "latest").write_text(tag + "\n")


def test_two_nodes_localhost_train_resume_and_refuse_other_global_batch(tmp_path):
    run = tmp_path / "run"
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_run_tree(run, {
        "model": {"implicit": {"max_iter": 2, "phantom_steps": 1}},
        "data": {"source": "synthetic", "synthetic_vocab": 64, "seq_len": 32},
        "schedule": {"kind": "constant_sqrt", "warmup": 1},
        "train": {"steps": STEPS, "global_batch_tokens": 128, "engine": "deepspeed", "zero_stage": 2},
        "checkpoint": {"every_steps": 3}, "eval": {"at_end": True}})))
    # two nodes x one process, uninterrupted
    out = _torchrun(cfg)
    assert "held-out perplexity" in out[0] + out[1]
    losses, recs = _losses(run)
    start = next(r for r in recs if r.get("event") == "start")
    assert (start["world_size"], start["engine"], start["accumulation"]) == (2, "deepspeed", 1)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert all(isinstance(v, float) and v == v for v in losses.values())
    for step in (3, 6):
        ck = run / "checkpoints" / f"step_{step:08d}"
        names = {f.name for f in ck.iterdir()}
        assert {"manifest.json", "client_rank0.pt", "client_rank1.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= names, names
        assert json.loads((ck / "manifest.json").read_text())["world_size"] == 2

    # one process with another global batch is refused before it writes anything
    run2 = tmp_path / "run2"
    _copy_checkpoint(run, "step_00000003", run2)
    before = sorted(p.name for p in run2.rglob("*"))
    p = subprocess.run([sys.executable, "-m", "lm.train", str(cfg), f"run_dir={run2}", "train.global_batch_tokens=256",
                        "--resume"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-4000:]
    msg = p.stderr
    assert "trained with train.global_batch_tokens=128, this config has 256" in msg, msg[-2000:]
    assert "set train.global_batch_tokens=128 to resume" in msg and "model.init_from" in msg, msg[-2000:]
    assert sorted(p.name for p in run2.rglob("*")) == before

    # two nodes again: steps 4..6 exactly as in the uninterrupted run
    _torchrun(cfg, f"run_dir={run2}", "--resume")
    resumed, recs2 = _losses(run2)
    assert next(r for r in recs2 if r.get("event") == "start")["world_size"] == 2
    assert sorted(resumed) == [4, 5, 6]
    for s in (4, 5, 6):
        assert resumed[s] == pytest.approx(losses[s], rel=1e-6), (s, resumed[s], losses[s])

    # the same 2 ranks split otherwise (one node x 2 processes) resume it too
    run4 = tmp_path / "run4"
    _copy_checkpoint(run, "step_00000003", run4)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "lm.train", str(cfg), f"run_dir={run4}", "--resume"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    resumed4, _ = _losses(run4)
    assert {s: resumed4[s] for s in (4, 5, 6)} == pytest.approx({s: losses[s] for s in (4, 5, 6)}, rel=1e-6)

    # DeepSpeed's launcher, a hostfile naming this machine twice, one `--no_ssh --node_rank i` command per node
    run3 = tmp_path / "run3"
    _copy_checkpoint(run, "step_00000003", run3)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    _two_nodes("deepspeed", cfg, f"run_dir={run3}", "--resume", HOSTFILE=str(hostfile), MASTER_PORT=str(_port()))
    resumed3, recs3 = _losses(run3)
    assert next(r for r in recs3 if r.get("event") == "start")["world_size"] == 2
    assert sorted(resumed3) == [4, 5, 6]
    for s in (4, 5, 6):
        assert resumed3[s] == pytest.approx(losses[s], rel=1e-6), (s, resumed3[s], losses[s])
    assert (run3 / "checkpoints" / "step_00000006" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
