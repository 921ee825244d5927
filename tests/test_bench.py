"""`lm bench` end to end at tiny shapes on CPU (the Triton kernels in the interpreter): every benchmark writes the
figures its docstring promises, each derived figure (ratio, tokens/s, MFU, ns per token, GB/s) is the one its
measured times give, and the accuracy checks it reports are at the reference's precision. CPU timings themselves
mean nothing; the GPU run is docs/performance.md's."""
import importlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def _finite_positive(*values):
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def _lm_bench(args, tmp_path, timeout=600):
    """`lm bench ...` through the CLI in its own process, without the test session's TRITON_INTERPRET (the
    benchmarks' --quick / --tiny modes must choose the interpreter themselves)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "lm.cli", "bench", *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_bench_lists_the_user_benchmarks(tmp_path):
    out = _lm_bench(["--help"], tmp_path).stdout
    listed = out.split("benchmarks:")[1].replace(",", " ").split()
    assert listed == ["conv1d", "data", "deltaproduct", "generate", "lru", "ssd", "train"]


def test_bench_conv1d(tmp_path):
    mod = importlib.import_module("lm.benchmarks.conv1d")
    out = tmp_path / "bench.json"
    res = mod.main(["--tiny", "--shapes", "tiny_packed", "--no-compile", "--warmup", "1", "--rep", "1",
                    "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["shapes"].keys() == res["shapes"].keys() == {"tiny_packed"}
    row = data["shapes"]["tiny_packed"]
    assert row["shape"] == dict(zip(("batch", "seqlen", "channels", "width", "proj_width", "offset", "bias", "docs"),
                                    mod.TINY["tiny_packed"]))
    for path in ("ours", "torch"):
        assert _finite_positive(*(row[path][k] for k in ("fwd_nograd_ms", "fwd_ms", "fwd_bwd_ms"))), path
        for key in ("y", "dx", "dweight", "dbias"):  # both in float32 against the float32 reference
            assert row[path][f"{key}_rel_vs_fp32"] < 1e-5, (path, key)
    o, t = row["ours"], row["torch"]
    for key, ms in (("fwd", "fwd_ms"), ("fwd_bwd", "fwd_bwd_ms"), ("fwd_nograd", "fwd_nograd_ms")):
        assert row["ours_over_torch"][key] == pytest.approx(o[ms] / t[ms])
    nbytes = 1 * 24 * 32 * 4  # b t c, float32
    assert o["fwd_GBps"] == pytest.approx(2 * nbytes / (o["fwd_nograd_ms"] * 1e-3) / 1e9)
    assert o["fwd_bwd_GBps"] == pytest.approx(5 * nbytes / (o["fwd_bwd_ms"] * 1e-3) / 1e9)


def test_bench_ssd_with_a_stand_in_peer(tmp_path, monkeypatch):
    """The peer (mamba_ssm) is a GPU import; here our own op stands in for it, so the comparison's code runs: the
    ratios are the quotients of the recorded times and the agreement of two equal functions is exact."""
    mod = importlib.import_module("lm.benchmarks.ssd")
    monkeypatch.setattr(mod, "peer_fn", lambda inp, chunk: mod.ours_fn(inp, chunk))
    out = tmp_path / "bench.json"
    res = mod.main(["--tiny", "--no-profile", "--warmup", "1", "--rep", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["targets"] == res["targets"] == mod.TARGETS and data["shapes"].keys() == {"tiny"}
    row = data["shapes"]["tiny"]
    assert row["shape"] == dict(zip(["batch", "seqlen", "nheads", "headdim", "dstate", "ngroups", "chunk"],
                                    mod.TINY["tiny"]))
    assert _finite_positive(*(row[k] for k in ("ours_fwd_ms", "ours_fwd_bwd_ms", "ours_nograd_fwd_ms",
                                               "ours_nograd_fwd_ms_repeat", "mamba_fwd_ms", "mamba_fwd_bwd_ms",
                                               "mamba_nograd_fwd_ms")))
    assert row["ratio_fwd"] == pytest.approx(row["ours_fwd_ms"] / row["mamba_fwd_ms"])
    assert row["ratio_fwd_bwd"] == pytest.approx(row["ours_fwd_bwd_ms"] / row["mamba_fwd_bwd_ms"])
    assert row["ratio_nograd_fwd"] == pytest.approx(row["ours_nograd_fwd_ms"] / row["mamba_fwd_ms"])
    assert set(row["ours_vs_mamba_rel"]) == {"y", "dx", "ddt", "dA", "dB", "dC", "dD", "ddt_bias"}
    assert all(v == 0 for v in row["ours_vs_mamba_rel"].values()), row["ours_vs_mamba_rel"]


@pytest.mark.parametrize("mode", [[], ["--decode"]], ids=["chunk", "decode"])
def test_bench_deltaproduct(tmp_path, mode):
    out = tmp_path / "bench.json"
    _lm_bench(["deltaproduct", *mode, "--quick", "--B", "1", "--T", "16", "--H", "1", "--K", "16", "--V", "16",
               "--nh", "1", "2", "--check-batch", "1", "--json", str(out)], tmp_path)
    data = json.loads(out.read_text())
    if mode:
        rows = data["decode"]
        assert [r["nh"] for r in rows] == [1, 2]
        for r in rows:
            assert _finite_positive(r["triton_us"]) and r["rel_err_o"] < 1e-5 and r["rel_err_state"] < 1e-5
        return
    assert data["info"]["shape"] == dict(B=1, T=16, H=1, K=16, V=16) and [r["nh"] for r in data["rows"]] == [1, 2]
    for r in data["rows"]:
        assert _finite_positive(r["ours_fwd_nograd_ms"], r["ours_fwd_grad_ms"], r["ours_fwd_bwd_ms"])
        assert r["ours_bwd_over_fwd"] == pytest.approx(r["ours_fwd_bwd_ms"] / r["ours_fwd_grad_ms"])
        assert r["ours_fwdbwd_over_nograd_fwd"] == pytest.approx(r["ours_fwd_bwd_ms"] / r["ours_fwd_nograd_ms"])
        check = r["check_vs_float64"]  # float32 through the interpreter against float64: the output and every grad
        assert check.pop("finite") is True and set(check) == {"o", "final_state", "dq", "dk", "dv", "dbeta", "dg",
                                                                "dh0"}
        assert max(check.values()) < 1e-4, check


def test_bench_lru(tmp_path):
    out = tmp_path / "lru.json"
    _lm_bench(["lru", "--tiny", "--ms", "2,4", "--no-sweep", "--out", str(out)], tmp_path)
    data = json.loads(out.read_text())
    b, t = data["batch"], data["seqlen"]
    assert [c["m"] for c in data["check"]] == [2, 4]
    for c in data["check"]:  # bf16 inputs against the float64 reference: bf16 rounding (2^-8 a value) and no more
        errors = {k: v for k, v in c.items() if k.startswith("rel_")}
        assert set(errors) == {"rel_h", "rel_dA", "rel_dx"} and max(errors.values()) < 1.5e-2, c
    assert [(r["kind"], r["m"]) for r in data["lru"]] == [("width", 2), ("width", 4), ("state", 2), ("state", 4)]
    for r in data["lru"]:
        assert r["nb"] * r["m"] == (data["width"] if r["kind"] == "width" else data["state"])
        assert _finite_positive(r["fwd_ms"], r["fwdbwd_ms"])
        assert r["fwd_ns_tok"] == pytest.approx(r["fwd_ms"] * 1e6 / (b * t))
        for peer, ratio in r.get("ratio", {}).items():  # ours / the SSD peer of the same kind
            s = next(q for q in data["ssd"] if q["peer"] == peer and q["kind"] == r["kind"])
            assert ratio["fwd"] == pytest.approx(r["fwd_ns_tok"] / s["fwd_ns_tok"])
    assert {s["peer"] for s in data["ssd"]} >= {"ours_ssd"} and all(r.get("ratio") for r in data["lru"])


def test_bench_generate(tmp_path):
    out = tmp_path / "gen.json"
    _lm_bench(["generate", "--quick", "--models", "llama,mamba2,implicit_mamba2,hf_llama", "--out", str(out)],
              tmp_path)
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["model"], r["batch"], r["prompt"]) for r in rows} == {
        (m, b, 16) for m in ("llama", "mamba2", "implicit_mamba2", "hf_llama") for b in (1, 2)}
    hf = {r["batch"]: r["decode_ms_per_token"] for r in rows if r["model"] == "hf_llama"}
    for r in rows:
        assert _finite_positive(r["prefill_ms"], r["generate_ms"]) and r["new_tokens"] == 6
        assert r["decode_ms_per_token"] == pytest.approx(max(r["generate_ms"] - r["prefill_ms"], 0) / 5)
        if r["model"] != "hf_llama":
            assert r["decode_vs_hf_llama"] == pytest.approx(r["decode_ms_per_token"] / hf[r["batch"]])
        if r["model"] == "implicit_mamba2":
            assert r["prefill_over_simultaneous"] == pytest.approx(r["prefill_ms"] / r["simultaneous_ms"])
            assert r["eval_max_iter"] >= 1
        if r["model"] in ("llama", "mamba2") and r["batch"] == 1:  # the eager decode beside it, first shape
            assert _finite_positive(r["eager_decode_ms_per_token"])


@pytest.mark.slow
def test_bench_train(tmp_path):
    """Explicit and implicit Mamba2 (their step-time ratio), and the hybrid beside the pure stacks whose layer-weighted
    mix it is reported against (lm_hybrid-mamba2-tiny: Mamba2 and attention layers); one `lm bench train` run, each
    case in its process as always."""
    from lm.benchmarks.train import layer_weighted_mix
    from lm.models.presets import load_config

    out = tmp_path / "train.json"
    _lm_bench(["train", "--size", "tiny", "--seq-len", "32", "--micro", "2", "--steps", "2", "--warmup", "1",
               "--precision", "fp32", "--cases", "mamba2-explicit,mamba2-implicit-4+1,llama-explicit,hybrid-explicit",
               "--out", str(out)], tmp_path)
    data = json.loads(out.read_text())
    cases = {r["case"]: r for r in data["results"]}
    assert set(cases) == {"mamba2-explicit", "mamba2-implicit-4+1", "llama-explicit", "hybrid-explicit"}
    for r in cases.values():
        assert r["measured_steps"] == 2 and len(r["step_times"]) == 2
        assert r["tokens_per_step"] == 2 * 32
        assert r["step_time_s"] == pytest.approx(sorted(r["step_times"])[0] / 2 + sorted(r["step_times"])[1] / 2)
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"])
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["train_flops_per_token"] / 989e12)
        assert 0 < r["final_loss"] < 1.5 * math.log(512) and r["params"] > 0
    assert cases["mamba2-implicit-4+1"]["fp_iterations"] >= 1 and cases["mamba2-explicit"]["fp_iterations"] is None
    assert cases["mamba2-implicit-4+1"]["train_flops_per_token"] > cases["mamba2-explicit"]["train_flops_per_token"]
    ratio = data["ratios"]["mamba2_implicit_over_explicit_step_time"]
    assert ratio == pytest.approx(cases["mamba2-implicit-4+1"]["step_time_s"] / cases["mamba2-explicit"]["step_time_s"])
    # the hybrid's tokens/s over the mix of the pure stacks' per-layer times (4 layers each in the tiny presets)
    kinds = load_config("lm_hybrid-mamba2-tiny").layer_kinds
    per = {"mamba2": (4, cases["mamba2-explicit"]["step_time_s"] / 64),
           "attention": (4, cases["llama-explicit"]["step_time_s"] / 64)}
    mix = layer_weighted_mix(kinds, per)
    assert data["ratios"]["hybrid-explicit_over_layer_mix"] == pytest.approx(cases["hybrid-explicit"]["tokens_per_s"]
                                                                               * mix)


def test_bench_train_forward_ratio(tmp_path, monkeypatch):
    """In this process (the mode builds its model here, no case processes; on CPU the references run whatever
    TRITON_INTERPRET says): the times, the host's within the wall's, the implied (4+1) cost."""
    from lm.benchmarks import train

    out = tmp_path / "fr.json"
    monkeypatch.setattr(sys, "argv", ["lm.benchmarks.train", "--forward-ratio", "--size", "tiny", "--seq-len", "32",
                                      "--micro", "1", "--steps", "2", "--warmup", "1", "--precision", "fp32",
                                      "--out", str(out)])
    assert train.main() == 0
    r = json.loads(out.read_text())
    assert _finite_positive(r["nograd_forward_ms"], r["forward_backward_ms"])
    assert 0 < r["nograd_forward_host_ms"] <= r["nograd_forward_ms"]  # host time is a part of the wall time
    assert "captured_nograd_forward_ms" not in r  # (CPU: nothing captured)
    assert r["implied_implicit_4p1_over_explicit"] > 1


def test_bench_data(tmp_path):
    out = tmp_path / "data.json"
    _lm_bench(["data", "--max-documents", "3", "--workers", "1", "--seconds", "0.2", "--json", str(out)], tmp_path)
    data = json.loads(out.read_text())
    (prep,) = data["prepare"]
    assert prep["workers"] == 1 and prep["documents"] == 3 and prep["tokens"] > 0
    assert prep["tokens_per_s"] == pytest.approx(prep["tokens"] / prep["seconds"], rel=0.01, abs=1)
    enc = data["encode_cpu"]
    assert enc["tokens"] > 0 and enc["tokens_per_cpu_s"] == pytest.approx(enc["tokens"] / enc["cpu_seconds"], rel=0.01)
    assert [(r["reader"], r["seq_len"]) for r in data["reader"]][:5] == [
        ("train", 256), ("train", 1024), ("train", 2048), ("train", 2048), ("train", 4096)]
    assert all(_finite_positive(r["tokens_per_s"]) for r in data["reader"])
