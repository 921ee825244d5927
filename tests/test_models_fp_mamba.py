"""FP-Mamba (lm_fp_mamba): channel mixers against dense matrices, Q = I against Mamba2, the fixed-point
equation, sequential vs parallel fixed points, HF round trip, cached generation, overfit, presets,
stats, validation, implicit variant, packing."""
from __future__ import annotations

import math

import pytest
import torch

from lm.fixed_point import relative_residual
from lm.models.cache import LMCache
from lm.models.channel_mixers import (
    KroneckerMixer, ReflectionMixer, dense_matrix, dplr_apply, householder_apply, kronecker_apply,
    kronecker_factors, spectral_normalize, symmetric_psd,
)
from lm.models.fp_mamba import FPMambaMixer, LMFPMambaConfig, LMFPMambaForCausalLM
from lm.models.mamba2 import LMMamba2Config, LMMamba2ForCausalLM

F64 = torch.float64
SIZES = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, d_state=8, headdim=16, chunk_size=8)


def tiny(**kw) -> LMFPMambaForCausalLM:
    cfg = LMFPMambaConfig(**{**SIZES, **kw})
    return LMFPMambaForCausalLM(cfg)


def rel_inf(a, b):
    """max over samples of ||a - b||_inf / ||b||_inf."""
    return float(relative_residual(a, b, "inf").max()) if a.dim() > 1 else float((a - b).abs().max() / b.abs().max())


# --- channel mixers ---------------------------------------------------------------------------------
def test_reflection_functions_match_dense_products():
    torch.manual_seed(0)
    d, r = 6, 3
    u = torch.nn.functional.normalize(torch.randn(4, r, d, dtype=F64), dim=-1)
    alpha = torch.rand(4, r, dtype=F64)
    v = torch.randn(4, d, dtype=F64)
    eye = torch.eye(d, dtype=F64)
    for scale in (1.0, 2.0):
        H = [eye - scale * alpha[:, i, None, None] * u[:, i, :, None] * u[:, i, None, :] for i in range(r)]
        Q = H[2] @ H[1] @ H[0]
        assert torch.allclose(householder_apply(v, u, alpha, scale), (Q @ v[..., None])[..., 0], atol=1e-12)
        Qd = eye - scale * sum(alpha[:, i, None, None] * u[:, i, :, None] * u[:, i, None, :] for i in range(r))
        assert torch.allclose(dplr_apply(v, u, alpha, scale), (Qd @ v[..., None])[..., 0], atol=1e-12)
    # alpha = 1 with the factor 2: a product of reflections, orthogonal
    Qo = dense_matrix(lambda p, x: householder_apply(x, u[:1].expand(d, r, d), torch.ones(d, r, dtype=F64)),
                      torch.zeros(1, dtype=F64), d)
    assert torch.allclose(Qo @ Qo.T, eye, atol=1e-12)


def test_kronecker_functions():
    torch.manual_seed(0)
    assert kronecker_factors(16) == (4, 4) and kronecker_factors(12) == (3, 4) and kronecker_factors(7) == (1, 7)
    m1, m2 = 3, 4
    k1, k2 = torch.randn(2, m1, m1, dtype=F64), torch.randn(2, m2, m2, dtype=F64)
    v = torch.randn(2, m1 * m2, dtype=F64)
    dense = torch.eye(m1 * m2, dtype=F64) - 2 * torch.stack([torch.kron(k1[i], k2[i]) for i in range(2)])
    assert torch.allclose(kronecker_apply(v, k1, k2, 2.0), (dense @ v[..., None])[..., 0], atol=1e-12)
    K = symmetric_psd(torch.randn(5, m2 * (m2 + 1) // 2, dtype=F64), m2)
    assert torch.allclose(K, K.transpose(-1, -2)) and bool((torch.linalg.eigvalsh(K) > -1e-12).all())
    Kn = spectral_normalize(K, iters=200)
    assert torch.allclose(torch.linalg.eigvalsh(Kn)[..., -1], torch.ones(5, dtype=F64), atol=1e-6)


@pytest.mark.parametrize("mixer", [
    lambda: ReflectionMixer(10, 8, 2, product=True),
    lambda: ReflectionMixer(10, 8, 3, product=False, activation="identity", neg_eigval=False),
    lambda: KroneckerMixer(10, 8),
    lambda: KroneckerMixer(10, 8, normalization="row", proj_rank=4),
])
def test_mixer_modules_are_linear_in_v(mixer):
    torch.manual_seed(0)
    mod = mixer().double()
    p = torch.randn(2, 3, 10, dtype=F64)
    v = torch.randn(2, 3, 8, dtype=F64)
    Q = dense_matrix(mod, p, 8)
    assert torch.allclose(mod(p, v), (Q @ v[..., None])[..., 0], atol=1e-10)
    assert not torch.allclose(Q, torch.eye(8, dtype=F64).expand_as(Q), atol=1e-3)  # it mixes channels


# --- relation to Mamba2 -------------------------------------------------------------------------------
def _mamba2_pair(**fp_kw):
    torch.manual_seed(0)
    mamba = LMMamba2ForCausalLM(LMMamba2Config(**SIZES)).double().eval()
    fp = tiny(mixer_type="identity", bc_norm=False, **fp_kw).double().eval()
    missing, unexpected = fp.load_state_dict(mamba.state_dict(), strict=False)
    assert not unexpected
    assert all(".bc_y_proj." in k for k in missing), missing  # everything else has Mamba2's names
    return mamba, fp


def test_q_identity_one_iteration_is_mamba2_layer():
    mamba, fp = _mamba2_pair()  # bc_h_dep on: the y-terms vanish at y = 0
    torch.manual_seed(1)
    x = torch.randn(2, 11, SIZES["hidden_size"], dtype=F64)
    m2mix, mix = mamba.model.layers[0].mixer, fp.model.layers[0].mixer
    with torch.no_grad():
        inp, _ = mix._inputs(x, None, None, None)
        y1, _ = mix.layer_map(inp, torch.zeros_like(inp.x))
        assert torch.allclose(mix._output(y1, inp), m2mix(x), atol=1e-12)
        # later iterations differ (B, C depend on y_{t-1})
        y2, _ = mix.layer_map(inp, y1)
        assert not torch.allclose(y2, y1, atol=1e-6)


def test_q_identity_without_state_dependence_is_mamba2_model():
    mamba, fp = _mamba2_pair(bc_h_dep=False)  # the map no longer depends on y: every iterate is Mamba2
    ids = torch.randint(0, SIZES["vocab_size"], (2, 13))
    with torch.no_grad():
        ref = mamba(ids).logits
        assert torch.allclose(fp(ids).logits, ref, atol=1e-10)
        assert torch.allclose(fp(ids, use_cache=True).logits, ref, atol=1e-10)  # sequential mode too


# --- the fixed point ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(), dict(mixer_type="kronecker"), dict(mixer_type="dplr", mixer_input="sum")])
def test_converged_output_satisfies_fixed_point_equation(kw):
    torch.manual_seed(0)
    tol = 1e-3
    model = tiny(layer_solver={"tol": tol, "eval_cap": 300}, **kw).double().eval()
    mix = model.model.layers[0].mixer
    x = torch.randn(3, 12, SIZES["hidden_size"], dtype=F64)
    with torch.no_grad():
        y, y_star, st, inp, _ = mix.iterate(x)
        fy, _ = mix.layer_map(inp, y_star)
    assert bool(st.converged.all()) and st.iterations < 300
    assert float(relative_residual(fy, y_star, "inf").max()) < tol  # ||f(y*) - y*|| / ||f(y*)|| < tol
    assert torch.equal(y, fy)  # the output is one more application at y* (phantom_steps = 1)


def test_sequential_and_parallel_fixed_points_agree():
    torch.manual_seed(0)
    tol = 1e-4
    model = tiny(layer_solver={"tol": tol, "eval_cap": 300}).double().eval()
    ids = torch.randint(0, SIZES["vocab_size"], (2, 12))
    with torch.no_grad():
        mix, layer = model.model.layers[0].mixer, model.model.layers[0]
        x = layer.norm(model.model.embed_tokens(ids))
        par, seq = mix(x), mix(x, cache=LMCache(2))
        h_par, _ = model.model(ids)
        h_seq, _ = model.model(ids, cache=LMCache(2))
    assert rel_inf(seq, par) < 10 * tol
    assert rel_inf(h_seq, h_par) < 30 * tol
    assert rel_inf(seq, par) > 0  # two different computations


def test_gradient_at_the_fixed_point():
    """phantom_steps = 1: the gradient is autograd through one application of the map at the detached y*."""
    torch.manual_seed(0)
    model = tiny(layer_solver={"tol": 1e-3}).double().train()
    mix = model.model.layers[0].mixer
    x = torch.randn(2, 9, SIZES["hidden_size"], dtype=F64)
    out = mix(x)
    mix.pop_stats()
    out.square().sum().backward()
    g = {n: p.grad.clone() for n, p in mix.named_parameters()}
    assert all(v.abs().sum() > 0 for v in g.values()), [n for n, v in g.items() if v.abs().sum() == 0]
    mix.zero_grad()
    with torch.no_grad():
        _, y_star, _, _, _ = mix.iterate(x)
    inp, _ = mix._inputs(x, None, None, None)
    mix._output(mix.layer_map(inp, y_star)[0], inp).square().sum().backward()
    for n, p in mix.named_parameters():
        assert torch.allclose(p.grad, g[n], atol=1e-8), n


# --- HF integration -----------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = tiny(mixer_type="kronecker", shifted_output_gate=True, layer_solver={"train_iter_gamma": [4.0, 1.0]}).eval()
    ids = torch.randint(0, SIZES["vocab_size"], (2, 10))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LMFPMambaForCausalLM and loaded.config.layer_solver == model.config.layer_solver
    assert loaded.config.layer_solver.train_iter_gamma == (4.0, 1.0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_cached_generation_equals_sequential_full_forward():
    """Full forward for FP-Mamba = the sequential (per-token) mode from scratch on the whole sequence."""
    torch.manual_seed(0)
    model = tiny().eval()
    prompt = torch.randint(0, SIZES["vocab_size"], (2, 5))
    gen = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    ids = prompt
    with torch.no_grad():
        for step in range(6):
            logits = model(ids, cache=LMCache(2), use_cache=True).logits[:, -1]
            assert torch.allclose(gen.logits[step], logits, atol=1e-5)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(gen.sequences, ids)


def test_parallel_prefill_equals_parallel_forward():
    torch.manual_seed(0)
    model = tiny(prefill="parallel", layer_solver={"tol": 1e-5, "eval_cap": 200}, num_hidden_layers=1).double().eval()
    ids = torch.randint(0, SIZES["vocab_size"], (2, 8))
    cache = LMCache(1)
    with torch.no_grad():
        pre = model(ids[:, :6], cache=cache, use_cache=True).logits
        assert torch.allclose(pre, model(ids[:, :6]).logits, atol=1e-12)
        dec = model(ids[:, 6:8], cache=cache, use_cache=True).logits  # continues from the cache
        ref8 = model(ids[:, :8]).logits
    assert torch.allclose(dec, ref8[:, 6:8], atol=1e-3)  # same fixed point, reached by other iterates
    assert len(cache.get(0)) == 3 and cache.get(0)["y"].shape == (2, 2 * SIZES["hidden_size"])


def test_one_batch_overfit_and_stats_reach_output():
    torch.manual_seed(0)
    model = tiny(layer_solver={"max_iter": 8}, num_hidden_layers=1).train()
    ids = torch.randint(0, SIZES["vocab_size"], (4, 12))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(12):
        out = model(ids, labels=ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    st = out.fixed_point_stats
    assert {"layer_iterations", "layer_residual_max", "layer_converged"} <= set(st)
    assert 1 <= st["layer_iterations"] <= 8
    assert all(layer.mixer.pop_stats() == [] for layer in model.model.layers)  # popped by the model


def test_solver_settings_train_eval_and_gamma_cap(spy_solve):
    """The layer's solve takes its config's layer_solver (one ImplicitSettings, FP-Mamba's defaults completing a
    partial dict): the training cap drawn from train_iter_gamma at every forward, the evaluation cap and quantile."""
    import lm.models.fp_mamba as fp

    seen = spy_solve(fp)
    model = tiny(layer_solver={"max_iter": 50, "train_iter_gamma": [4.0, 1.0]}, num_hidden_layers=1)
    s = model.config.layer_solver
    assert (s.tol, s.stop_quantile, s.eval_quantile, s.norm, s.patience, s.damping_decay, s.eval_max_iter) == (
        0.1, 0.75, 1.0, "inf", 15, 0.9, 1000)
    ids = torch.randint(0, SIZES["vocab_size"], (2, 6))
    model.train()
    torch.manual_seed(3)
    expected = min(50, max(1, math.ceil(float(torch.distributions.Gamma(4.0, 1.0).sample()))))
    torch.manual_seed(3)
    model(ids)
    assert seen[-1] == dict(max_iter=expected, tol=0.1, damping=1.0, stop_quantile=0.75, norm="inf", anderson=0,
                            patience=15, damping_decay=0.9)
    caps = set()
    for _ in range(30):
        model(ids)
        caps.add(seen[-1]["max_iter"])
    assert len(caps) > 2 and max(caps) <= 50  # drawn anew at every forward
    model.eval()
    model(ids)
    assert seen[-1]["max_iter"] == 1000 and seen[-1]["stop_quantile"] == 1.0


def test_presets():
    from lm.models.presets import count_parameters, load_config

    cfg = load_config("lm_fp_mamba-tiny")
    assert cfg.vocab_size == 8192 and 1e6 < count_parameters(cfg)["total"] < 5e6
    big = load_config("lm_fp_mamba-200m")
    assert big.num_hidden_layers == 12 and big.hidden_size == 768
    assert abs(count_parameters(big)["total"] / 200e6 - 1) < 0.15


@pytest.mark.parametrize("field,value", [
    ("mixer_type", "monarch"), ("mixer_rank", 0), ("mixer_input", "both"), ("kronecker_norm", "frobenius"),
    ("layer_solver", None), ("layer_solver", {"tol": 1.5}), ("layer_solver", {"phantom_steps": 0}),
    ("layer_solver", {"max_iter": 0}), ("layer_solver", {"stop_quantile": 0.0}), ("layer_solver", {"nax_iter": 3}),
    ("layer_solver", {"train_iter_gamma": [4.0]}), ("layer_solver", {"train_iter_gamma": [0.0, 1.0]}),
    ("fp_tol", 1.5), ("fp_eval_quantile", 1.2), ("fp_damping_decay", 2.0), ("fp_patience", 0), ("fp_max_iter", 0),
    ("fp_train_iter_gamma", [4.0]), ("d_conv", -1), ("headdim", 24),
    ("bc_norm", "yes"), ("mixer_gate_bias", float("nan")), ("mixer_proj_rank", -2),
])
def test_bad_config_values_raise(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        LMFPMambaConfig(**{**SIZES, field: value})


def test_unknown_key_raises():
    with pytest.raises(ValueError, match="max_iterations"):
        LMFPMambaConfig(max_iterations=3)


# --- implicit variant and packing -------------------------------------------------------------------
def test_implicit_forward_backward_and_generation():
    torch.manual_seed(0)
    model = tiny(layer_solver={"max_iter": 4, "eval_cap": 20},
                 implicit={"max_iter": 2, "phantom_steps": 1, "tol": 0.05}).train()
    assert FPMambaMixer.injection_dim(model.config) == model.model.injection.proj.out_features
    ids = torch.randint(0, SIZES["vocab_size"], (2, 10))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert "layer_iterations" in out.fixed_point_stats and "iterations" in out.fixed_point_stats
    assert model.model.injection.proj.weight.grad.abs().sum() > 0
    assert model.model.layers[0].mixer.q_mixer.u_proj.weight.grad.abs().sum() > 0
    model.eval()
    gen = model.generate(ids[:1, :4], max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert gen.shape == (1, 6)


def test_packed_documents_match_separate_runs():
    torch.manual_seed(0)
    model = tiny(layer_solver={"tol": 1e-5, "eval_cap": 300}).double().eval()
    mix = model.model.layers[0].mixer
    a = torch.randn(1, 7, SIZES["hidden_size"], dtype=F64)
    b = torch.randn(1, 5, SIZES["hidden_size"], dtype=F64)
    cu = torch.tensor([0, 7, 12])
    with torch.no_grad():
        packed = mix(torch.cat([a, b], dim=1), cu_seqlens=cu)
        sep = torch.cat([mix(a), mix(b)], dim=1)
    assert torch.allclose(packed, sep, atol=1e-4)
    with torch.no_grad():  # without cu_seqlens the second document sees the first (the test can fail)
        assert not torch.allclose(mix(torch.cat([a, b], dim=1)), sep, atol=1e-3)


def test_older_fp_fields_are_read_into_the_layer_solver(tmp_path):
    """A config.json written before layer_solver (its fp_* fields and n_backwards, as an older version saved them)
    loads: each field is read into the ImplicitSettings field of the same meaning, and the model computes what a
    model configured with layer_solver computes."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from lm.models.fp_mamba import LAYER_SOLVER, LEGACY_FIELDS

    old = {"fp_damping": 0.9, "fp_damping_decay": 0.8, "fp_eval_max_iter": 50, "fp_eval_quantile": 0.9,
           "fp_max_iter": 7, "fp_patience": 9, "fp_tol": 0.05, "fp_train_iter_gamma": [4.0, 1.0],
           "fp_train_quantile": 0.5, "n_backwards": 2}
    assert set(old) == set(LEGACY_FIELDS)
    new = {"damping": 0.9, "damping_decay": 0.8, "eval_cap": 50, "eval_stop_quantile": 0.9, "max_iter": 7,
           "patience": 9, "tol": 0.05, "train_iter_gamma": (4.0, 1.0), "stop_quantile": 0.5, "phantom_steps": 2}
    assert LMFPMambaConfig(**old).layer_solver.to_dict() == {**LAYER_SOLVER.to_dict(), **new,
                                                             "train_iter_gamma": [4.0, 1.0]}
    assert LMFPMambaConfig(fp_max_iter=16).layer_solver.eval_max_iter == 1000  # the older default cap stays
    torch.manual_seed(0)
    tiny(layer_solver=new).double().save_pretrained(tmp_path / "new")
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    cfg = json.loads((tmp_path / "new" / "config.json").read_text())
    del cfg["layer_solver"]
    (tmp_path / "old" / "config.json").write_text(json.dumps({**cfg, **old}))
    model, loaded = (AutoModelForCausalLM.from_pretrained(tmp_path / d, dtype=torch.float64).eval()
                     for d in ("new", "old"))
    assert loaded.config.layer_solver == model.config.layer_solver
    ids = torch.randint(0, SIZES["vocab_size"], (2, 9))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    with pytest.raises(ValueError, match=r"^fp_tol \(read into layer_solver.tol\): must be None or in \(0, 1\)"):
        LMFPMambaConfig(fp_tol=2.0)
    with pytest.raises(ValueError, match=r"layer_solver: given together with the older field\(s\) \['fp_tol'\]"):
        LMFPMambaConfig(fp_tol=0.1, layer_solver={"max_iter": 3})
