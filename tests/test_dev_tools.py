"""The developer tools of scripts/dev/ on CPU: what a training step saves for its backward (saved.py), the step's
floor (floor.py) and the sm_90 compile statistics' launch capture (sm90/ssd_stats.py)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from dev_tools import DEV, load
from lm.models.presets import load_config

saved = load("saved")
OUTSIDE, build, origins, saved_tensors, summarize = (saved.OUTSIDE, saved.build, saved.origins, saved.saved_tensors,
                                                     saved.summarize)
layer_stages, step_floor = load("floor").layer_stages, load("floor").step_floor


def test_saved_counts_each_storage_once_and_by_layer():
    torch.manual_seed(0)
    model = build("lm_mamba2-tiny", ["num_hidden_layers=2"], None, vocab=128)
    ids = torch.randint(0, 128, (2, 32))
    res = saved_tensors(model, ids)
    s = summarize(res)
    labels = set(s["by_label"])
    assert {"layer 0", "layer 1", OUTSIDE} <= labels
    assert s["total"] == sum(r["bytes"] for r in res["records"]) and s["params_saved"] > 0
    # storages are unique: the same storage never appears twice
    assert len(res["records"]) == len({(r["label"], id(r)) for r in res["records"]})
    # layer 1's saved z (the gated norm's gate) is its own (tokens x d_inner) buffer
    d_inner = model.config.d_inner
    assert any(r["shape"][-1] == d_inner and r["bytes"] == 2 * 32 * d_inner * 4 for r in origins(res, "layer 1"))
    # the model is left as it was: the layers are plain Blocks again
    assert type(model.model.layers[0]).__name__ == "Block" and not hasattr(model.model.layers[0], "_orig_call")


def test_saved_counts_only_what_the_backward_holds(monkeypatch):
    """A save whose graph node is dropped in the forward is not counted (its tensor is freed; the allocator may give
    its address to a later storage, which the count then keeps apart)."""
    torch.manual_seed(0)
    model = build("lm_llama-tiny", ["num_hidden_layers=2"], None, vocab=64)
    ids = torch.randint(0, 64, (2, 16))
    base = summarize(saved_tensors(model, ids))
    mixer = model.model.layers[1].mixer
    orig = mixer.forward

    def with_dropped_branch(x, *a, **k):
        (x * 2).sin()  # sin saves x * 2; the result is dropped, and with it the node and its saved tensor
        return orig(x, *a, **k)

    monkeypatch.setattr(mixer, "forward", with_dropped_branch)
    again = summarize(saved_tensors(model, ids))
    assert again["by_label"] == base["by_label"] and again["total"] == base["total"]


def test_saved_cli_json(tmp_path):
    out = tmp_path / "s.json"
    p = subprocess.run([sys.executable, str(DEV / "saved.py"), "--preset", "lm_llama-tiny", "--overrides",
                        "num_hidden_layers=1", "--seq-len", "16", "--vocab", "64", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "B/token" in p.stdout
    d = json.loads(out.read_text())
    assert d["summary"]["per_layer"] > 0 and d["records"]


def test_floor_counts_the_gemm_flops():
    cfg = load_config("lm_mamba2-tiny")
    n = 2 * 64
    rows = layer_stages(cfg, n, 64)
    gemm = sum(r["fwd_flops"] for r in rows if r["kind"] == "gemm")
    in_w, out_w = cfg.hidden_size * (2 * cfg.d_inner + 2 * cfg.d_state + cfg.d_inner // cfg.headdim), \
        cfg.d_inner * cfg.hidden_size
    assert gemm == 2 * n * (in_w + out_w)
    fl = step_floor(cfg, n, 64, {"matmul_tflops": 1e-3, "bandwidth_gbs": 1.0})
    assert fl["layer_bwd_ms"] > fl["layer_fwd_ms"] > 0
    imp = step_floor(load_config("lm_mamba2-tiny", implicit={"max_iter": 4, "phantom_steps": 1}), n, 64,
                     {"matmul_tflops": 1e-3, "bandwidth_gbs": 1.0})
    assert abs(imp["step_ms"] - fl["step_ms"] - 4 * fl["nograd_forward_ms"]) < 1e-9
    assert fl["over_explicit"] == pytest.approx(1.0) and imp["explicit_step_ms"] == pytest.approx(fl["step_ms"])
    assert imp["over_explicit"] == pytest.approx(imp["step_ms"] / fl["step_ms"]) and imp["over_explicit"] > 1
    # Mamba2-350M at an H200's rates: four no-grad forwards cost ~1.2 explicit steps at the floor
    big = step_floor(load_config("lm_mamba2-350m", implicit={"max_iter": 4, "phantom_steps": 1}), 16 * 2048, 2048,
                     {"matmul_tflops": 650, "bandwidth_gbs": 4200})
    assert 2.1 < big["over_explicit"] < 2.3


_CAPTURE = """
import sys
sys.path.insert(0, 'scripts/dev/sm90')
import torch
from ssd_stats import capture_forward
names = [fn.__name__ for fn, _, _ in capture_forward((1, 64, 2, 16, 16, 1, 32), dtype=torch.float32, backward=True)]
print(' '.join(names))
"""


def test_sm90_stats_script_captures_every_launch_of_forward_and_backward():
    """scripts/dev/sm90/ssd_stats.py intercepts the launches of one forward + backward (what it compiles for sm_90 on a
    machine without a GPU): it follows triton_ssd's _forward / _backward, so a change to their signatures or to
    the launched kernels shows here rather than when the tool is next needed. Its own process: without
    TRITON_INTERPRET (the launches are JITFunction.run's)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _CAPTURE], cwd=DEV.parents[1], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    names = p.stdout.split()
    for k in ("dtcb_fwd_kernel", "state_fwd_kernel", "dstate_bwd_kernel", "dcb_bwd_kernel", "dx_bwd_kernel",
              "dbdc_bwd_kernel", "dt_bwd_kernel", "sum_rows_kernel"):
        assert k in names, (k, names)
