"""scripts/gpu_scaling.sh's CPU mode (--dry-run): one tiny case at 1 and 2 ranks (gloo) through the script users
run on the GPU machine; the JSON holds tokens/s per GPU, the scaling efficiency, peak memory, per-step losses
and their difference from the 1-rank run (equal global batch: accumulation 2 at 1 rank, 1 at 2)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[1]


def test_gpu_scaling_dry_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "CASES": "llama-tiny-implicit-4+1",
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu_scaling.sh"), "--dry-run"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "tok/s/GPU" in p.stdout
    doc = json.loads((tmp_path / "scaling.json").read_text())
    assert doc["settings"]["dry_run"] and doc["settings"]["gpus"] == [1, 2]
    runs = doc["cases"]["llama-tiny-implicit-4+1"]
    one, two = runs["1"], runs["2"]
    assert (one["accumulation"], two["accumulation"]) == (2, 1)
    assert one["global_batch_tokens"] == two["global_batch_tokens"]
    assert one["scaling_efficiency"] == 1.0 and two["scaling_efficiency"] > 0
    assert two["tokens_per_s_per_gpu"] == pytest.approx(two["tokens_per_s"] / 2)
    assert len(one["losses"]) == len(two["losses"]) == 4 and two["losses_compared"] == 4
    assert two["max_rel_loss_diff_vs_1"] < 1e-5  # fp32 on CPU: data parallel = accumulation up to rounding
    assert one["peak_mem_gb"] > 0
