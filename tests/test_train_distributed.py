"""Two-rank DeepSpeed ZeRO-2 training on CPU (gloo) under torchrun: loss finite and falling, checkpoints
with per-rank state, the curriculum switch recorded, and an exact resume from a mid-run checkpoint."""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from train_checks import tiny_run_tree

pytest.importorskip("deepspeed")

from test_train_loop import make_corpus  # noqa: E402  (same tiny corpus)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(config, *extra):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port()),
           "-m", "lm.train", str(config), *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p


def _losses(run):
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in recs if "event" not in r}, recs


@pytest.mark.multirank
def test_two_rank_zero2_train_checkpoint_resume(tmp_path, tmp_path_factory):
    data = make_corpus(tmp_path_factory)
    run = tmp_path / "run"
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_run_tree(run, {
        "data": {"path": str(data), "seq_len": 32},
        "curriculum": [{"name": "bounded", "until": 0.5, "implicit": {"max_iter": 2, "phantom_steps": 1}},
                       {"name": "free", "until": 1.0, "implicit": {"max_iter": 6, "tol": 0.05, "phantom_steps": 2}}],
        "schedule": {"kind": "constant_sqrt", "warmup": 1, "decay_start": "last_phase"},
        "train": {"steps": 8, "global_batch_tokens": 256, "engine": "deepspeed", "zero_stage": 2},
        "checkpoint": {"every_steps": 4, "export": True}, "eval": {"at_end": True}})))
    p = _launch(cfg)
    assert "held-out perplexity" in p.stdout
    losses, recs = _losses(run)
    start = next(r for r in recs if r.get("event") == "start")
    assert (start["world_size"], start["engine"], start["accumulation"]) == (2, "deepspeed", 2)
    vals = [losses[s] for s in range(1, 9)]
    assert all(v == v and abs(v) < 100 for v in vals)
    assert sum(vals[-2:]) / 2 < vals[0] - 0.3, vals  # falling
    assert [(r["step"], r["phase"]) for r in recs if r.get("event") == "phase_switch"] == [(4, "free")]
    root = run / "checkpoints"
    for tag, phase in (("step_00000004", "bounded"), ("step_00000008", "free")):
        ck = root / tag
        names = {f.name for f in ck.iterdir()}
        assert {"manifest.json", "client.json", "client_rank0.pt", "client_rank1.pt", "config.json",
                "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= names, names
        assert json.loads((ck / "client.json").read_text())["phase"] == phase
    assert (run / "hf" / "model.safetensors").is_file()

    # resume from the step-4 checkpoint in a fresh run folder: steps 5..8 repeat exactly
    run2 = tmp_path / "run2"
    (run2 / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "step_00000004", run2 / "checkpoints" / "step_00000004")
    (run2 / "checkpoints" / "latest").write_text("step_00000004\n")
    _launch(cfg, f"run_dir={run2}", "checkpoint.export=false", "--resume")
    resumed, _ = _losses(run2)
    assert sorted(resumed) == [5, 6, 7, 8]
    for s in (5, 6, 7, 8):
        assert resumed[s] == pytest.approx(losses[s], rel=1e-5), (s, resumed[s], losses[s])


def _run_one_process(script):
    """Run a training script as one process on CPU (DeepSpeed's CPU accelerator, no launcher's rank variables)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def _printed(p, tag: str):
    """The JSON a script printed after `tag `."""
    return json.loads(next(line for line in p.stdout.splitlines() if line.startswith(tag + " "))[len(tag) + 1:])


def test_deepspeed_single_process_skips_nan_step_and_reinitialises(tmp_path, tmp_path_factory):
    """DeepSpeed engine in one process: a NaN loss is skipped (DeepSpeed drops the update), training
    goes on; a second train() in the same process reuses the process group."""
    data = make_corpus(tmp_path_factory)
    script = tmp_path / "run.py"
    script.write_text(f"""
import json, sys, warnings
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from test_train_loop import _cfg
from lm.train.trainer import train, shutdown
def hook(step, micro, out):
    if step == 2:
        out.loss = out.loss * float("nan")
    return out
for name in ("a", "b"):
    with warnings.catch_warnings(record=True):
        train(_cfg({str(tmp_path)!r} + "/" + name, {str(data)!r}, train={{"engine": "deepspeed", "steps": 4}}),
              hooks={{"after_forward": hook}})
shutdown()
""")
    _run_one_process(script)
    la, ra = _losses(tmp_path / "a")
    lb, _ = _losses(tmp_path / "b")
    assert la[3] == "nan" and [r["step"] for r in ra if r.get("event") == "skip"] == [3]
    assert all(isinstance(la[s], float) for s in (1, 2, 4)) and la == lb
    start = next(r for r in ra if r.get("event") == "start")
    assert start["engine"] == "deepspeed"


def test_deepspeed_step_does_not_synchronise_the_device(tmp_path, tmp_path_factory):
    """DeepSpeed's throughput timer (on by default) calls the accelerator's synchronize() at the start and the end of
    every micro-batch, a full device drain each; the trainer's DeepSpeed config turns it off: no synchronize() per
    training step (counted over steps 3-6 of a one-process run)."""
    data = make_corpus(tmp_path_factory)
    script = tmp_path / "run.py"
    script.write_text(f"""
import json, sys
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from deepspeed.accelerator import get_accelerator
from test_train_loop import _cfg
from lm.train.trainer import train, shutdown
calls = []
acc = type(get_accelerator())
orig = acc.synchronize
acc.synchronize = lambda self, *a, **k: (calls.append(step[0]), orig(self, *a, **k))[1]
step = [0]
def hook(s, micro, out):
    step[0] = s
    return out
train(_cfg({str(tmp_path)!r} + "/r", {str(data)!r}, train={{"engine": "deepspeed", "steps": 6}}),
      hooks={{"after_forward": hook}})
shutdown()
print("CALLS", json.dumps(calls))
""")
    p = _run_one_process(script)
    calls = _printed(p, "CALLS")
    assert [s for s in calls if s >= 3] == [], calls


def test_deepspeed_bf16_skip_decided_on_the_device(tmp_path, tmp_path_factory):
    """bf16 ZeRO-2 with the fused AdamW (CUDA's optimizer; the CPU has the kernel too): DeepSpeed's own overflow check
    (an all-reduced flag read on the host) is off and the fused AdamW's found_inf skips the NaN step instead; the same
    losses and skip as DeepSpeed's check with the foreach AdamW, and the skipped step leaves no trace in the
    optimizer (4 updates in 5 steps)."""
    data = make_corpus(tmp_path_factory)
    script = tmp_path / "run.py"
    script.write_text(f"""
import json, sys, warnings
import torch
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Z
import lm.train.trainer as T
from lm.train.optim import param_groups
from test_train_loop import _cfg
from lm.train.trainer import train, shutdown
checks, steps = [], {{}}
orig_check = Z.check_overflow
Z.check_overflow = lambda self, *a, **k: (checks.append(1), orig_check(self, *a, **k))[1]
plain = T.make_optimizer
def fused(model, *, lr, betas, eps, weight_decay, device):
    opt = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps, fused=True)
    steps["opt"] = opt
    return opt
def hook(step, micro, out):
    if step == 3:  # the 4th step
        out.loss = out.loss * float("nan")
    return out
out = {{}}
for name, make in (("fused", fused), ("foreach", plain)):
    T.make_optimizer = make
    checks.clear()
    with warnings.catch_warnings(record=True):
        train(_cfg({str(tmp_path)!r} + "/" + name, {str(data)!r}, train={{"engine": "deepspeed", "steps": 5,
                                                                      "precision": "bf16"}}),
              hooks={{"after_forward": hook}})
    out[name] = len(checks)
out["updates"] = sorted({{int(s["step"]) for s in steps["opt"].state.values()}})
shutdown()
print("OUT", json.dumps(out))
""")
    p = _run_one_process(script)
    out = _printed(p, "OUT")
    assert out["fused"] == 0 and out["foreach"] == 5 and out["updates"] == [4], out
    lf, rf = _losses(tmp_path / "fused")
    lr_, rr = _losses(tmp_path / "foreach")
    assert [r["step"] for r in rf if r.get("event") == "skip"] == [4] == [r["step"] for r in rr
                                                                         if r.get("event") == "skip"]
    for s in (1, 2, 3, 5):
        assert lf[s] == pytest.approx(lr_[s], rel=2e-2), (s, lf, lr_)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deepspeed_fused_overflow_check_and_grad_norm_equal_deepspeeds(tmp_path, tmp_path_factory, precision):
    """The trainer's ZeRO-2 overflow check and gradient norm (lm.train.engine._fused_norms: foreach norms
    instead of DeepSpeed's loop over parameters) give DeepSpeed's own results at every step of a one-process run,
    the NaN step (skipped: an overflow under bf16, an invalid norm -1 under fp32) included."""
    data = make_corpus(tmp_path_factory)
    script = tmp_path / "run.py"
    script.write_text(f"""
import json, sys
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Z
import lm.train.engine as E
from test_train_loop import _cfg
from lm.train.trainer import train, shutdown
pairs = []
fused = E._fused_norms
def both(opt):
    fused(opt)
    f_over, f_norm = opt.has_overflow_partitioned_grads_serial, opt.get_grad_norm_direct
    def over():
        a, b = f_over(), Z.has_overflow_partitioned_grads_serial(opt)
        pairs.append(["overflow", bool(a), bool(b)])
        return a
    def norm(g, p, norm_type=2):
        a, b = f_norm(g, p, norm_type), Z.get_grad_norm_direct(opt, g, p, norm_type)
        pairs.append(["norm", float(a), float(b)])
        return a
    opt.has_overflow_partitioned_grads_serial, opt.get_grad_norm_direct = over, norm
E._fused_norms = both
def hook(step, micro, out):
    if step == 3:  # the 4th step
        out.loss = out.loss * float("nan")
    return out
train(_cfg({str(tmp_path)!r} + "/r", {str(data)!r}, train={{"engine": "deepspeed", "steps": 5,
                                                          "precision": {precision!r}}}),
      hooks={{"after_forward": hook}})
shutdown()
print("PAIRS", json.dumps(pairs))
""")
    p = _run_one_process(script)
    pairs = _printed(p, "PAIRS")
    overs = [(a, b) for k, a, b in pairs if k == "overflow"]
    norms = [(a, b) for k, a, b in pairs if k == "norm"]
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in norms), pairs
    if precision == "bf16":  # checked first; the NaN step stops before the norm
        assert [a for a, _ in overs] == [False, False, False, True, False] and all(a == b for a, b in overs), pairs
        assert len(norms) in (4, 8) and all(b > 0 for _, b in norms), pairs  # one norm per parameter group
    else:  # no overflow check: the NaN step's norms are DeepSpeed's invalid -1
        g = len(norms) // 5
        assert overs == [] and g in (1, 2) and len(norms) == 5 * g, pairs
        assert [b == -1.0 for _, b in norms] == [False] * 3 * g + [True] * g + [False] * g, pairs


_ONE_BEHIND_SCRIPT = """
import json, os, signal, sys, time, types
sys.path.insert(0, {tests!r})
import lm.train.budget as budget
import lm.train.step as step_mod
from test_train_loop import _cfg
from lm.train.preempt import Preempted
from lm.train.trainer import train, shutdown
step_mod.one_behind = lambda dist: True  # as on CUDA
mode, run, data = sys.argv[1:4]
rank = int(os.environ["RANK"])
late = [0.0]
real = time.perf_counter
budget.time = types.SimpleNamespace(perf_counter=lambda: real() + late[0])
def hook(step, micro, out):
    if rank == 1 and step == 2 and micro == 0:  # in the third step, on rank 1 only
        if mode == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        else:  # rank 1's clock jumps past the time budget; rank 0's stays far from it
            late[0] = 10000.0
    return out
over = dict(train={{"engine": "deepspeed", "steps": 8, "max_minutes": 60}}, checkpoint={{"every_steps": 0}})
try:
    s = train(_cfg(run, data, **over), hooks={{"after_forward": hook}})
    out = {{"steps": s["steps"], "stopped": s.get("stopped")}}
except Preempted as err:
    out = {{"steps": err.summary["steps"], "stopped": "preempted", "checkpoint": err.summary.get("checkpoint")}}
shutdown()
open(run + f".rank{{rank}}.json", "w").write(json.dumps(out))
"""


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["signal", "clock"])
def test_two_ranks_one_behind_stop_at_the_same_step(tmp_path, tmp_path_factory, mode):
    """Several ranks reading each step one step late (as on CUDA) decide together: a SIGTERM on rank 1 only, or
    rank 1's clock alone past `train.max_minutes`, reaches rank 0 through the step's all-reduced values, and both
    ranks stop after the same step (no rank waits in a collective the other never joins): a checkpoint and
    "preempted" for the signal, a complete run stopped by the time budget for the clock."""
    data = make_corpus(tmp_path_factory)
    script = tmp_path / "run.py"
    script.write_text(_ONE_BEHIND_SCRIPT.format(tests=os.path.dirname(__file__)))
    run = tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port()),
           str(script), mode, str(run), str(data)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    r0, r1 = (json.loads(Path(f"{run}.rank{r}.json").read_text()) for r in (0, 1))
    assert r0["steps"] == r1["steps"] and 3 <= r0["steps"] < 8, (r0, r1)
    losses, recs = _losses(run)
    assert sorted(losses) == list(range(1, r0["steps"] + 1))
    if mode == "signal":
        assert r0["stopped"] == r1["stopped"] == "preempted"
        assert [r["step"] for r in recs if r.get("event") == "preempted"] == [r0["steps"]]
        assert (run / "checkpoints" / f"step_{r0['steps']:08d}" / "manifest.json").is_file()
    else:
        assert r0["stopped"] == r1["stopped"] == "time budget"


@pytest.mark.slow
def test_deepspeed_overrides_fall_back_on_an_untested_version(tmp_path, tmp_path_factory):
    """On a DeepSpeed version the overrides were not tested with (the installed version made to read 0.20 here), none
    is installed: DeepSpeed's own overflow check, norm, clip and checkpoint writer run, rank 0 prints one line per
    override, and the run trains as with them (bf16 ZeRO-2 with the fused AdamW, a NaN step skipped, a checkpoint
    whose manifest verifies)."""
    data = make_corpus(tmp_path_factory)
    script = tmp_path / "run.py"
    script.write_text(f"""
import json, sys, warnings
import torch
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Z
import lm.train.engine as E
import lm.train.trainer as T
from lm.train import checkpoint as ck
from lm.train.optim import param_groups
from test_train_loop import _cfg
from lm.train.trainer import train, shutdown
checks, seen = [], {{}}
orig_check = Z.check_overflow
Z.check_overflow = lambda self, *a, **k: (checks.append(1), orig_check(self, *a, **k))[1]
def fused(model, *, lr, betas, eps, weight_decay, device):
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps, fused=True)
T.make_optimizer = fused
overrides = E._zero_overrides
def spy(opt):
    overrides(opt)
    seen[name] = sorted(k for k in ("has_overflow_partitioned_grads_serial", "get_grad_norm_direct",
                                    "unscale_and_clip_grads", "scaled_global_norm") if k in vars(opt))
E._zero_overrides = spy
def hook(step, micro, out):
    if step == 3:  # the 4th step
        out.loss = out.loss * float("nan")
    return out
out = {{}}
for name, version in (("tested", E.deepspeed_version()), ("untested", (0, 20))):
    E.deepspeed_version = lambda v=version: v
    checks.clear()
    with warnings.catch_warnings(record=True):
        train(_cfg({str(tmp_path)!r} + "/" + name, {str(data)!r}, train={{"engine": "deepspeed", "steps": 5,
                                                                      "precision": "bf16"}},
                   checkpoint={{"every_steps": 2}}), hooks={{"after_forward": hook}})
    out[name] = len(checks)
    ck.verify(ck.resolve({str(tmp_path)!r} + "/" + name))
out["installed"] = seen
shutdown()
print("OUT", json.dumps(out))
""")
    p = _run_one_process(script)
    out = _printed(p, "OUT")
    assert out["installed"] == {"tested": ["get_grad_norm_direct", "has_overflow_partitioned_grads_serial",
                                           "scaled_global_norm", "unscale_and_clip_grads"], "untested": []}, out
    assert out["tested"] == 0 and out["untested"] == 5, out  # DeepSpeed's own overflow check in every step
    said = [line for line in p.stderr.splitlines() if "is not a version lm's" in line]
    assert [line.split(" override")[0].split()[-1] for line in said] == [
        "fused_grad_checks", "clip_on_device", "skip_on_device", "hashing_writer"], said
    assert all(line.startswith("lm train: DeepSpeed 0.20 is not a version") and "(0.19.x): DeepSpeed's own method "
               "runs" in line for line in said), said
    tested, rt = _losses(tmp_path / "tested")
    untested, ru = _losses(tmp_path / "untested")
    assert [r["step"] for r in rt if r.get("event") == "skip"] == [4] == [r["step"] for r in ru
                                                                         if r.get("event") == "skip"]
    for s in (1, 2, 3, 5):
        assert untested[s] == pytest.approx(tested[s], rel=2e-2), (s, tested, untested)


@pytest.mark.slow
def test_deepspeed_overrides_ab_script_on_cpu(tmp_path):
    """scripts/dev/deepspeed_overrides_ab.py (the GPU measurement of what each override gains) runs every variant on
    the CPU and reports each override's gain from its own two figures (CPU times say nothing about a GPU)."""
    out = tmp_path / "ab.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "dev" / "deepspeed_overrides_ab.py"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, str(script), "--preset", "lm_mamba2-tiny", "--seq-len", "32", "--micro", "2",
                        "--steps", "2", "--warmup", "1", "--rounds", "1", "--precision", "fp32", "--device", "cpu",
                        "--run-root", str(tmp_path / "runs"), "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    import lm.train.engine as E

    table = json.loads(out.read_text())
    assert set(table["gain"]) == set(E.OVERRIDES)
    assert set(table["variants"]) == {"all", "none"} | {f"without {n}" for n in E.OVERRIDES}
    assert all(v["step_s"] > 0 and v["save_s"] > 0 for v in table["variants"].values()), table
    for n, g in table["gain"].items():
        key = "save_s" if n == "hashing_writer" else "step_s"
        assert g == pytest.approx(table["variants"][f"without {n}"][key] / table["variants"]["all"][key] - 1), n
