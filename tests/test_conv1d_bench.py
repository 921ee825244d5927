"""`lm bench conv1d` (lm.benchmarks.conv1d) runs end to end (tiny shape; on CPU under the Triton interpreter, no compile)."""
import importlib
import json

import pytest

pytest.importorskip("triton")


def test_bench_conv1d_tiny_writes_json(tmp_path):
    mod = importlib.import_module("lm.benchmarks.conv1d")
    out = tmp_path / "bench.json"
    res = mod.main(["--tiny", "--shapes", "tiny_packed", "--no-compile", "--warmup", "1", "--rep", "1",
                    "--json", str(out)])
    data = json.loads(out.read_text())
    row = data["shapes"]["tiny_packed"]
    assert data["shapes"].keys() == res["shapes"].keys()
    for path_name in ("ours", "torch"):
        for key in ("fwd_nograd_ms", "fwd_ms", "fwd_bwd_ms"):
            assert row[path_name][key] > 0, (path_name, key)
    for key in ("y", "dx", "dweight", "dbias"):  # ours in float32 against the float32 reference
        assert row["ours"][f"{key}_rel_vs_fp32"] < 1e-5, key
    assert row["ours_over_torch"]["fwd_bwd"] > 0
