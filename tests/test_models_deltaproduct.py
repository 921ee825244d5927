"""lm_deltaproduct: the mixer against the per-token Householder-product definition, HF round trip,
cached generation, packed documents, overfitting, presets and config validation (explicit and implicit)."""
from __future__ import annotations

import json
import re

import pytest
import torch
from model_checks import assert_incremental_equals_full, greedy_by_full_forward, overfit_losses
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from lm.models.deltaproduct import LMDeltaProductConfig, LMDeltaProductForCausalLM
from lm.models.presets import count_parameters, list_presets, load_config



@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tests run many tiny ops: on a shared 2-core machine intra-op threads only add contention
    (measured: ~1 s vs 40 ms per training step of the tiny model under load)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


L2EPS = 1e-6  # the op's L2 normalisation: x / sqrt(|x|^2 + 1e-6)
IMPLICIT = {"max_iter": 3, "phantom_steps": 1, "eval_factor": 1.0}

# small configs covering the options: gates on/off, beta range, conv on/off, n_h 1..3
CONFIGS = {
    "gated_nh2": dict(num_householder=2, use_forget_gate=True, use_output_gate=True, allow_neg_eigval=True),
    "plain_nh1": dict(num_householder=1, allow_neg_eigval=False),
    "noconv_nh3": dict(num_householder=3, use_short_conv=False, expand_v=2.0),
}
CASES = [("gated_nh2", None), ("plain_nh1", None), ("noconv_nh3", None), ("gated_nh2", IMPLICIT)]
CASE_IDS = ["gated_nh2", "plain_nh1", "noconv_nh3", "implicit_gated_nh2"]


def make_config(name="gated_nh2", implicit=None, **over):
    kw = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_heads=2,
              chunk_size=16, implicit=implicit)
    kw.update(CONFIGS[name])
    kw.update(over)
    return LMDeltaProductConfig(**kw)


def make_model(name="gated_nh2", implicit=None, seed=0, **over):
    torch.manual_seed(seed)
    return LMDeltaProductForCausalLM(make_config(name, implicit, **over)).eval()


# --- the mixer against its definition -------------------------------------------------------------
def householder_reference(mixer, x):
    """Per-token loop of paper 001's recurrence from the mixer's own parameters (float64):
    H <- g H; H <- (I - beta k k^T) H + beta k v^T for each step; o = H^T q / sqrt(dk)."""
    b, t, _ = x.shape
    Hn, dk, dv, nh = mixer.H, mixer.dk, mixer.dv, mixer.nh
    proj = x @ mixer.in_proj.weight.T
    nq, nk, nv, nb, na, ng = mixer.split
    qkv = proj[..., : nq + nk + nv]
    if mixer.conv1d is not None:
        w = mixer.conv1d.weight[:, 0, :]  # (c, W): tap W-1 is the current token
        W = w.shape[-1]
        pad = F.pad(qkv, (0, 0, W - 1, 0))
        qkv = sum(pad[:, j: j + t] * w[:, j] for j in range(W))
    qkv = F.silu(qkv)
    off = nq + nk + nv
    beta = torch.sigmoid(proj[..., off: off + nb]) * (2 if mixer.allow_neg_eigval else 1)
    a = proj[..., off + nb: off + nb + na]
    gate = proj[..., off + nb + na:]
    out = torch.zeros(b, t, Hn, dv, dtype=x.dtype)
    for bi in range(b):
        S = torch.zeros(Hn, dk, dv, dtype=x.dtype)
        for i in range(t):
            q = qkv[bi, i, :nq].reshape(Hn, dk)
            k = qkv[bi, i, nq: nq + nk].reshape(nh, Hn, dk)
            v = qkv[bi, i, nq + nk: off].reshape(nh, Hn, dv)
            be = beta[bi, i].reshape(nh, Hn)
            if mixer.use_forget_gate:
                logg = -torch.exp(mixer.A_log) * F.softplus(a[bi, i] + mixer.dt_bias)
                S = S * logg.exp()[:, None, None]
            for h in range(Hn):
                for j in range(nh):
                    kk = k[j, h] / (k[j, h].pow(2).sum() + L2EPS).sqrt()
                    P = torch.eye(dk, dtype=x.dtype) - be[j, h] * torch.outer(kk, kk)
                    S[h] = P @ S[h] + be[j, h] * torch.outer(kk, v[j, h])
            qq = q / (q.pow(2).sum(-1, keepdim=True) + L2EPS).sqrt()
            out[bi, i] = torch.einsum("hk,hkv->hv", qq, S) * dk ** -0.5
    o = out / out.pow(2).mean(-1, keepdim=True).add(mixer.o_norm.eps).sqrt() * mixer.o_norm.weight
    if mixer.use_output_gate:
        o = o * F.silu(gate.reshape(b, t, Hn, dv))
    return mixer.o_proj(o.reshape(b, t, Hn * dv))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mixer_matches_householder_definition(name):
    model = make_model(name, initializer_range=0.3).double()  # large weights: beta spans its range
    mixer = model.model.layers[0].mixer
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    with torch.no_grad():
        y = mixer(x)
        ref = householder_reference(mixer, x)
    # float64 throughout except the per-head RMSNorm (lm.models.layers.rms_norm computes in float32)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_beta_range_uses_negative_eigenvalues():
    """allow_neg_eigval gives beta > 1 (reflections); without it beta stays in [0, 1]."""
    x = torch.randn(1, 6, 32)
    for neg, lo, hi in ((True, 0.0, 2.0), (False, 0.0, 1.0)):
        mixer = make_model("plain_nh1", allow_neg_eigval=neg, initializer_range=1.0).model.layers[0].mixer
        nq, nk, nv, nb = mixer.split[:4]
        raw = mixer.in_proj(x)[..., nq + nk + nv: nq + nk + nv + nb]
        beta = torch.sigmoid(raw) * (2 if neg else 1)
        assert beta.min() >= lo and beta.max() <= hi
        assert (beta.max() > 1) == neg


# --- Hugging Face round trip ----------------------------------------------------------------------
@pytest.mark.parametrize("name,implicit", CASES, ids=CASE_IDS)
def test_save_load_roundtrip(tmp_path, name, implicit):
    model = make_model(name, implicit)
    ids = torch.randint(0, 64, (2, 13))
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "lm_deltaproduct" and cfg["implicit"] == (
        None if implicit is None else model.config.implicit.to_dict())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LMDeltaProductForCausalLM
    with torch.no_grad():
        out = loaded(ids).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


# --- generation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,implicit", CASES, ids=CASE_IDS)
def test_cached_generation_equals_full_forward_greedy(name, implicit):
    model = make_model(name, implicit)
    prompt = torch.randint(1, 64, (2, 5))
    with torch.no_grad():
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                             pad_token_id=0, eos_token_id=None, prefill="sequential")
    ref = greedy_by_full_forward(model, prompt, 8, sequential=implicit is not None)
    assert torch.equal(gen, ref)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_incremental_logits_equal_full_forward(name):
    """Prefill (chunkwise, with a cache) + single steps (deltaproduct_step, conv state) == one full forward."""
    model = make_model(name)
    assert_incremental_equals_full(model)


# --- packed documents -----------------------------------------------------------------------------
@pytest.mark.parametrize("name,implicit", CASES, ids=CASE_IDS)
def test_packed_equals_unpacked(name, implicit):
    model = make_model(name, implicit)
    ids = torch.randint(0, 64, (3, 12))
    with torch.no_grad():
        batch = model(ids).logits
        cu = torch.tensor([0, 12, 24, 36], dtype=torch.int32)
        packed = model(ids.reshape(1, 36), cu_seqlens=cu).logits
    torch.testing.assert_close(packed.reshape(3, 12, -1), batch, rtol=1e-4, atol=1e-5)
    # uneven documents, each against its own forward
    lens = [5, 19, 8]
    docs = [torch.randint(0, 64, (1, n)) for n in lens]
    cu = torch.tensor([0, 5, 24, 32], dtype=torch.int32)
    with torch.no_grad():
        packed = model(torch.cat(docs, 1), cu_seqlens=cu).logits
        for d, a, b in zip(docs, cu[:-1].tolist(), cu[1:].tolist()):
            torch.testing.assert_close(packed[:, a:b], model(d).logits, rtol=1e-4, atol=1e-5)


# --- training -------------------------------------------------------------------------------------
@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
def test_overfits_one_batch(implicit):
    model = make_model("gated_nh2", implicit).train()
    ids = torch.randint(0, 64, (2, 16))
    losses = overfit_losses(model, ids)
    assert losses[-1] < 0.3 * losses[0], losses
    if implicit is not None:
        assert model.model.injection.proj.weight.grad is not None


# --- presets and validation -----------------------------------------------------------------------
def test_presets_parameter_counts():
    names = [n for n in list_presets() if n.startswith("lm_deltaproduct-")]
    assert {f"lm_deltaproduct-{s}-nh{k}" for s in ("213m", "392m", "805m") for k in (1, 2, 3)} <= set(names)
    assert "lm_deltaproduct-tiny" in names
    for n in names:
        cfg = load_config(n)
        total = count_parameters(cfg)["total"]
        m = re.search(r"-(\d+)m", n)
        if m:
            target = int(m.group(1)) * 1e6
            assert abs(total - target) <= 0.15 * target, (n, total)
            nh = int(re.search(r"-nh(\d)", n).group(1))
            assert cfg.num_householder == nh
        else:
            assert cfg.vocab_size == 8192 and 1e6 <= total <= 10e6, (n, total)


@pytest.mark.parametrize("field,value", [
    ("num_householder", 0), ("num_heads", 3), ("head_dim", -1), ("expand_v", 0.3), ("conv_size", 0),
    ("chunk_size", 0), ("chunk_size", 48), ("allow_neg_eigval", "yes"), ("dt_min", 0.0), ("A_init_range", [2.0, 1.0]),
    ("use_forget_gate", 1),
])
def test_bad_config_values_raise(field, value):
    with pytest.raises(ValueError, match=field):
        make_config(**{field: value})


def test_unknown_key_raises():
    with pytest.raises(ValueError, match="num_householders"):
        LMDeltaProductConfig(num_householders=2)
