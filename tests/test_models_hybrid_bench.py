"""The hybrid benchmarks (issue 59, item 6) on CPU: the layer-weighted mix of the pure stacks' per-layer times is the
sum it claims, `lm bench train` runs the hybrid cases beside the pure ones and reports the hybrid's tokens/s over the
mix's (end to end in test_bench.py::test_bench_train, in the same run as the Mamba2 cases), and `lm bench generate`
times the hybrid and transformers' static-cache Llama. CPU timings mean nothing; the GPU run is the lead's."""
import json

import pytest
from test_bench import _lm_bench

from lm.benchmarks.train import CASES, hybrid_mix_ratios, layer_weighted_mix
from lm.models.presets import load_config


def test_layer_weighted_mix_is_the_sum_of_per_layer_times():
    kinds = ["mamba2"] * 5 + ["attention"]
    pure = {"mamba2": (48, 0.96e-6), "attention": (24, 1.2e-6)}
    assert layer_weighted_mix(kinds, pure) == pytest.approx(5 * 0.02e-6 + 0.05e-6)
    with pytest.raises(ValueError, match="deltaproduct"):
        layer_weighted_mix(kinds + ["deltaproduct"], pure)


def test_hybrid_mix_ratios_pair_cases_by_implicit_and_compile():
    """The 350m hybrid (35 Mamba2 + 7 attention layers) against Mamba2-350M (48 layers) and Llama-350M (24)."""
    def result(case, compile_, tps, implicit=None):
        template, _ = CASES[case]
        return {"case": case + ("+compile" if compile_ else ""), "preset": template.format(size="350m"),
                "implicit": implicit, "overrides": {}, "compile": compile_, "tokens_per_step": 1000,
                "step_time_s": 1000 / tps, "tokens_per_s": tps}

    imp = {"max_iter": 4, "phantom_steps": 1}
    results = [result("mamba2-explicit", True, 100.0), result("llama-explicit", True, 200.0),
               result("hybrid-explicit", True, 110.0), result("mamba2-explicit", False, 50.0),
               result("hybrid-implicit-4+1", True, 40.0, imp), result("mamba2-implicit-4+1", True, 30.0, imp)]
    ratios = hybrid_mix_ratios(results)
    mix = 35 / 48 / 100.0 + 7 / 24 / 200.0  # s per token
    assert load_config("lm_hybrid-mamba2-350m").layer_kinds.count("attention") == 7
    assert ratios["hybrid-explicit+compile_mix_tokens_per_s"] == pytest.approx(1 / mix)
    assert ratios["hybrid-explicit+compile_over_layer_mix"] == pytest.approx(110.0 * mix)
    assert not any(k.startswith("hybrid-implicit") for k in ratios)  # no implicit Llama timed: no mix


@pytest.mark.slow
def test_bench_generate_hybrid_and_static_cache_llama(tmp_path):
    out = tmp_path / "gen.json"
    _lm_bench(["generate", "--quick", "--models", "hybrid,hf_llama,hf_llama_static", "--out", str(out)], tmp_path)
    rows = json.loads(out.read_text())["rows"]
    assert {r["model"] for r in rows} == {"hybrid", "hf_llama", "hf_llama_static"}
    static = {r["batch"]: r["decode_ms_per_token"] for r in rows if r["model"] == "hf_llama_static"}
    for r in rows:
        if r["model"] == "hybrid":
            assert r["decode_vs_hf_llama_static"] == pytest.approx(r["decode_ms_per_token"] / static[r["batch"]])
            assert r["eager_decode_ms_per_token"] > 0 if r["batch"] == 1 else True
