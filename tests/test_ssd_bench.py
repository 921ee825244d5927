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
