"""`lm bench deltaproduct --quick` on CPU (the Triton interpreter), the op and the decode-step modes."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("mode", [[], ["--decode"]], ids=["chunk", "decode"])
def test_lm_bench_deltaproduct_quick_runs_on_cpu(tmp_path, mode):
    """Through the CLI, which has imported triton before the script runs: --quick still gets the interpreter (the
    environment without TRITON_INTERPRET, which the test session sets)."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "lm.cli", "bench", "deltaproduct", *mode, "--quick", "--B", "1", "--T", "16",
           "--H", "1", "--K", "16", "--V", "16", "--nh", "1", "--check-batch", "0", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    if mode:
        (row,) = data["decode"]
        assert row["triton_us"] > 0 and row["rel_err_o"] < 1e-5 and row["rel_err_state"] < 1e-5
    else:
        assert any(r.get("ours_fwd_bwd_ms", 0) > 0 for r in data["rows"])
