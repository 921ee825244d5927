"""`lm bench ssd` (lm.benchmarks.ssd) runs end to end (tiny shape; on CPU under the Triton interpreter, no peer)."""
import importlib
import json

import pytest
import torch

pytest.importorskip("triton")


def test_bench_ssd_tiny_writes_json(tmp_path):
    mod = importlib.import_module("lm.benchmarks.ssd")
    out = tmp_path / "bench.json"
    res = mod.main(["--tiny", "--no-peer", "--no-profile", "--warmup", "1", "--rep", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    row = data["shapes"]["tiny"]
    assert data["targets"] == res["targets"]
    for key in ("ours_fwd_ms", "ours_fwd_bwd_ms", "ours_nograd_fwd_ms", "ours_nograd_fwd_ms_repeat"):
        assert row[key] > 0, key
    if not torch.cuda.is_available():
        assert "mamba_fwd_ms" not in row


_CAPTURE = """
import sys
sys.path.insert(0, 'scripts/sm90')
import torch
from ssd_stats import capture_forward
names = [fn.__name__ for fn, _, _ in capture_forward((1, 64, 2, 16, 16, 1, 32), dtype=torch.float32, backward=True)]
print(' '.join(names))
"""


def test_sm90_stats_script_captures_every_launch_of_forward_and_backward():
    """scripts/sm90/ssd_stats.py intercepts the launches of one forward + backward (what it compiles for sm_90 on a
    machine without a GPU): it follows triton_ssd's _forward / _backward, so a change to their signatures or to
    the launched kernels shows here rather than when the tool is next needed. Its own process: without
    TRITON_INTERPRET (the launches are JITFunction.run's)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _CAPTURE], cwd=root, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    names = p.stdout.split()
    for k in ("dtcb_fwd_kernel", "state_fwd_kernel", "dstate_bwd_kernel", "dcb_bwd_kernel", "dx_bwd_kernel",
              "dbdc_bwd_kernel", "dt_bwd_kernel", "sum_rows_kernel"):
        assert k in names, (k, names)
