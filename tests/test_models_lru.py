"""lm_lru (variants lru | hlru | bdlru): mixers against their recurrences written out directly, LRU ring
initialisation, the BD-LRU / H-LRU bound, HF round trip, cached generation, packed documents,
overfitting, presets and config validation (explicit and implicit)."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
from model_checks import assert_incremental_equals_full, greedy_by_full_forward, overfit_losses
from transformers import AutoModelForCausalLM

from lm.models.lru import LMLRUConfig, LMLRUForCausalLM, l1_normalised_gates
from lm.models.presets import count_parameters, list_presets, load_config
from lm_kernels.lru import block_scan


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Many tiny ops: on a shared 2-core machine intra-op threads only add contention."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


IMPLICIT = {"max_iter": 3, "phantom_steps": 1, "eval_factor": 1.0}
VARIANTS = ["lru", "hlru", "bdlru"]
CASES = [(v, None) for v in VARIANTS] + [(v, IMPLICIT) for v in VARIANTS]
CASE_IDS = VARIANTS + [f"implicit_{v}" for v in VARIANTS]


def make_config(variant="lru", implicit=None, **over):
    kw = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=64, variant=variant,
              chunk_size=8, implicit=implicit)
    if variant != "lru":
        kw.update(block_size=3, num_states=12)
    kw.update(over)
    return LMLRUConfig(**kw)


def make_model(variant="lru", implicit=None, seed=0, **over):
    torch.manual_seed(seed)
    return LMLRUForCausalLM(make_config(variant, implicit, **over)).eval()


# --- mixers against their recurrences -------------------------------------------------------------
def lru_reference(mixer, x):
    """Complex arithmetic: h = lambda h + gamma (B x), y = Re(C h) + D x, with in_proj rows / out_proj
    columns holding (Re, Im) pairs and Re(C h) = C_re Re h - C_im Im h."""
    lam = torch.exp(-torch.exp(mixer.nu_log) + 1j * torch.exp(mixer.theta_log))
    gamma = torch.exp(mixer.gamma_log)
    Wb = mixer.in_proj.weight
    B = Wb[0::2] + 1j * Wb[1::2]  # (N, d)
    Wc = mixer.out_proj.weight
    C_re, C_im = Wc[:, 0::2], -Wc[:, 1::2]  # (d, N)
    b, t, _ = x.shape
    h = torch.zeros(b, mixer.N, dtype=torch.complex128)
    ys = []
    for i in range(t):
        h = lam * h + gamma * (x[:, i].to(torch.complex128) @ B.T)
        ys.append(h.real @ C_re.T - h.imag @ C_im.T + mixer.D * x[:, i])
    return torch.stack(ys, 1)


def hlru_reference(mixer, x):
    """h_t = sum_{i=1..m} a_{i,t} h_{t-i} + a_{0,t} v_t per channel; y = out_proj([h_t, ..., h_{t-m+1}])."""
    N, m = mixer.N, mixer.m
    proj = x @ mixer.in_proj.weight.T
    v, raw = proj[..., :N], proj[..., N:].reshape(*x.shape[:2], N, m + 1) + mixer.gate_bias
    a = l1_normalised_gates(raw, mixer.gate_activation)
    b, t, _ = x.shape
    hist = [torch.zeros(b, N, dtype=x.dtype) for _ in range(m)]  # h_{t-1}, ..., h_{t-m}
    ys = []
    for i in range(t):
        h = a[:, i, :, 0] * v[:, i] + sum(a[:, i, :, j] * hist[j - 1] for j in range(1, m + 1))
        hist = [h] + hist[:-1]
        ys.append(mixer.out_proj(torch.stack(hist, -1).reshape(b, N * m)))
    return torch.stack(ys, 1)


def bdlru_reference(mixer, x):
    """h^k_{i,t} = sum_j a^k_{i,j,t} h^k_{j,t-1} + a^k_{i,0,t} v^k_{i,t}; y = out_proj(h)."""
    N, m = mixer.N, mixer.m
    proj = x @ mixer.in_proj.weight.T
    b, t, _ = x.shape
    v = proj[..., : N * m].reshape(b, t, N, m)
    raw = proj[..., N * m:].reshape(b, t, N, m, m + 1) + mixer.gate_bias
    a = l1_normalised_gates(raw, mixer.gate_activation)
    h = torch.zeros(b, N, m, dtype=x.dtype)
    ys = []
    for i in range(t):
        h = torch.stack([sum(a[:, i, :, r, 1 + c] * h[:, :, c] for c in range(m)) + a[:, i, :, r, 0] * v[:, i, :, r]
                         for r in range(m)], -1)
        ys.append(mixer.out_proj(h.reshape(b, N * m)))
    return torch.stack(ys, 1)


REFERENCES = {"lru": lru_reference, "hlru": hlru_reference, "bdlru": bdlru_reference}


@pytest.mark.parametrize("variant,act", [("lru", "softmax"), ("hlru", "softmax"), ("bdlru", "softmax"),
                                         ("hlru", "sigmoid"), ("bdlru", "sigmoid")])
def test_mixer_matches_recurrence(variant, act):
    model = make_model(variant, gate_activation=act, initializer_range=0.5).double()
    mixer = model.model.layers[0].mixer
    if variant != "lru":
        with torch.no_grad():
            mixer.gate_bias.normal_()
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mixer(x), REFERENCES[variant](mixer, x), rtol=1e-10, atol=1e-10)


def test_lru_ring_initialisation():
    cfg = make_config("lru", num_states=4096, r_min=0.5, r_max=0.9, max_phase=3.0)
    mixer = LMLRUForCausalLM(cfg).model.layers[0].mixer
    r = torch.exp(-torch.exp(mixer.nu_log.detach()))
    phase = torch.exp(mixer.theta_log.detach())
    assert r.min() >= 0.5 - 1e-6 and r.max() <= 0.9 + 1e-6
    # |lambda|^2 uniform on [r_min^2, r_max^2]: mean (0.25 + 0.81) / 2
    assert abs((r ** 2).mean().item() - 0.53) < 0.02
    assert phase.min() > 0 and phase.max() <= 3.0 + 1e-6 and abs(phase.mean().item() - 1.5) < 0.1
    torch.testing.assert_close(torch.exp(mixer.gamma_log.detach()), torch.sqrt(1 - r ** 2))
    assert mixer.in_proj.weight.std().item() == pytest.approx(1 / math.sqrt(64), rel=0.1)


@pytest.mark.parametrize("variant", ["hlru", "bdlru"])
def test_normalised_gates_bound_the_state(variant):
    """Rows of [A, a_0] have L1 norm 1 (paper 002 Prop. 1): |h|_inf <= max_t |v_t|_inf even with large
    gate weights and long sequences (the appendix snippet's transposed H-LRU fails this)."""
    model = make_model(variant, initializer_range=2.0, block_size=4).double()
    mixer = model.model.layers[0].mixer
    x = torch.randn(3, 200, 32, dtype=torch.float64)
    with torch.no_grad():
        proj = mixer.in_proj(x)
        A, xin = mixer.transitions(proj)
        h, _ = block_scan(A, xin)
        v = proj[..., : mixer.v_dim]
        assert A.abs().sum(-1).max() <= 1 + 1e-12  # rows: gates (with a_0 > 0) or the companion shift
    assert h.abs().max() <= v.abs().max() + 1e-9


# --- Hugging Face round trip ----------------------------------------------------------------------
@pytest.mark.parametrize("variant,implicit", CASES, ids=CASE_IDS)
def test_save_load_roundtrip(tmp_path, variant, implicit):
    model = make_model(variant, implicit)
    ids = torch.randint(0, 64, (2, 13))
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "lm_lru" and cfg["variant"] == variant
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LMLRUForCausalLM and loaded.config.implicit == model.config.implicit
    with torch.no_grad():
        out = loaded(ids).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


# --- generation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant,implicit", CASES, ids=CASE_IDS)
def test_cached_generation_equals_full_forward_greedy(variant, implicit):
    model = make_model(variant, implicit)
    prompt = torch.randint(1, 64, (2, 5))
    with torch.no_grad():
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                             pad_token_id=0, eos_token_id=None, prefill="sequential")
    ref = greedy_by_full_forward(model, prompt, 8, sequential=implicit is not None)
    assert torch.equal(gen, ref)


@pytest.mark.parametrize("variant", VARIANTS)
def test_incremental_logits_equal_full_forward(variant):
    """Prefill (scan with a cache) + single steps (block_scan_step) == one full forward."""
    model = make_model(variant)
    assert_incremental_equals_full(model)


# --- packed documents -----------------------------------------------------------------------------
@pytest.mark.parametrize("variant,implicit", CASES, ids=CASE_IDS)
def test_packed_equals_unpacked(variant, implicit):
    model = make_model(variant, implicit)
    ids = torch.randint(0, 64, (3, 12))
    with torch.no_grad():
        batch = model(ids).logits
        cu = torch.tensor([0, 12, 24, 36], dtype=torch.int32)
        packed = model(ids.reshape(1, 36), cu_seqlens=cu).logits
    torch.testing.assert_close(packed.reshape(3, 12, -1), batch, rtol=1e-4, atol=1e-5)
    lens = [5, 19, 8]  # uneven documents, each against its own forward
    docs = [torch.randint(0, 64, (1, n)) for n in lens]
    cu = torch.tensor([0, 5, 24, 32], dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat(docs, 1), cu_seqlens=cu).logits
        for d, a, b in zip(docs, cu[:-1].tolist(), cu[1:].tolist()):
            torch.testing.assert_close(packed[:, a:b], model(d).logits, rtol=1e-4, atol=1e-5)


# --- training -------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant,implicit", [("lru", None), ("bdlru", None), ("hlru", IMPLICIT), ("bdlru", IMPLICIT)],
                         ids=["lru", "bdlru", "implicit_hlru", "implicit_bdlru"])
def test_overfits_one_batch(variant, implicit):
    model = make_model(variant, implicit).train()
    ids = torch.randint(0, 64, (2, 16))
    losses = overfit_losses(model, ids)
    assert losses[-1] < 0.3 * losses[0], losses
    if implicit is not None:
        assert model.model.injection.proj.weight.grad is not None


# --- presets and validation -----------------------------------------------------------------------
def test_presets():
    names = [n for n in list_presets() if n.startswith("lm_lru-")]
    assert {"lm_lru-tiny", "lm_lru-tiny-hlru", "lm_lru-tiny-bdlru"} <= set(names)
    for n in names:
        cfg = load_config(n)
        total = count_parameters(cfg)["total"]
        variant = n.split("-")[2] if n.count("-") >= 2 else "lru"
        assert cfg.variant == variant
        m = re.search(r"-(\d+)m", n)
        if m:
            target = int(m.group(1)) * 1e6
            assert abs(total - target) <= 0.15 * target, (n, total)
        else:
            assert cfg.vocab_size == 8192 and 1e6 <= total <= 10e6, (n, total)


@pytest.mark.parametrize("field,value,variant", [
    ("variant", "gru", "lru"), ("block_size", 3, "lru"), ("block_size", 9, "bdlru"), ("block_size", 0, "hlru"),
    ("num_states", 0, "hlru"), ("gate_activation", "relu", "bdlru"), ("r_max", 1.0, "lru"),
    ("r_min", 0.9995, "lru"), ("max_phase", 0.0, "lru"), ("chunk_size", 0, "lru"),
])
def test_bad_config_values_raise(field, value, variant):
    with pytest.raises(ValueError, match=field):
        make_config(**{"variant": variant, field: value})


def test_defaults_resolve_per_variant():
    assert (make_config("lru", num_states=None).num_states, make_config("lru").block_size) == (32, 2)
    c = LMLRUConfig(hidden_size=32, variant="bdlru")
    assert (c.num_states, c.block_size) == (8, 4)
    c = LMLRUConfig(hidden_size=32, variant="hlru")
    assert (c.num_states, c.block_size) == (32, 4)
