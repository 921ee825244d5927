"""Core model families (issue 2): Llama and Mamba2, explicit and implicit, as Hugging Face causal LMs."""
import copy

import pytest
import torch
from model_checks import greedy_by_full_forward, markov_tokens, overfit_losses
from transformers import AutoConfig, AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.fixed_point import relative_residual
from lm.models import LMCache, LMLlamaConfig, LMMamba2Config
from lm.models.presets import count_parameters, list_presets, load_config

V = 64
IMPLICIT = dict(max_iter=4, tol=None, phantom_steps=1, damping=1.0)


def small_config(family: str, implicit=None, **kw):
    if family == "llama":
        return LMLlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, implicit=implicit, **kw)
    return LMMamba2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, d_state=8, headdim=8,
                          chunk_size=16, implicit=implicit, **kw)


FAMILIES = ["llama", "mamba2"]
VARIANTS = [(f, imp) for f in FAMILIES for imp in (None, IMPLICIT)]
IDS = [f"{f}-{'implicit' if imp else 'explicit'}" for f, imp in VARIANTS]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("implicit", [False, True])
def test_tiny_preset_forward_backward(family, implicit):
    cfg = load_config(f"lm_{family}-tiny", implicit=dict(IMPLICIT) if implicit else None)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    out = model(ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    if implicit:
        assert model.model.injection.proj.weight.grad.abs().sum() > 0
        assert out.fixed_point_stats["iterations"] == IMPLICIT["max_iter"]
    else:
        assert out.fixed_point_stats is None


@pytest.mark.parametrize("family,implicit", VARIANTS, ids=IDS)
def test_overfit_one_batch(family, implicit):
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(small_config(family, implicit))
    ids = torch.randint(0, V, (4, 16))
    losses = overfit_losses(model, ids)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("family,implicit", VARIANTS, ids=IDS)
def test_save_load_identical_logits(family, implicit, tmp_path):
    model = AutoModelForCausalLM.from_config(small_config(family, implicit)).eval()
    model.save_pretrained(tmp_path)
    cfg = AutoConfig.from_pretrained(tmp_path)
    assert cfg.model_type == model.config.model_type and cfg.implicit == model.config.implicit
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    ids = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)




@pytest.mark.parametrize("family,implicit", VARIANTS, ids=IDS)
def test_cached_greedy_generation_equals_full_forward(family, implicit):
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(small_config(family, implicit)).eval()
    prompt = torch.randint(0, V, (1, 7))
    out = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, prefill="sequential")
    ref = greedy_by_full_forward(model, prompt, 10, sequential=implicit is not None)
    assert torch.equal(out, ref), (out, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_matches_full_forward_logits(family):
    model = AutoModelForCausalLM.from_config(small_config(family)).eval()
    ids = torch.randint(0, V, (2, 21))
    with torch.no_grad():
        full = model(ids).logits
        cache = LMCache()
        a = model(ids[:, :13], cache=cache, use_cache=True).logits
        steps = [model(ids[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(13, 21)]
    got = torch.cat([a] + steps, dim=1)
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,implicit", VARIANTS, ids=IDS)
def test_packed_sequences_equal_separate(family, implicit):
    model = AutoModelForCausalLM.from_config(small_config(family, implicit)).eval()
    a, b = torch.randint(0, V, (1, 11)), torch.randint(0, V, (1, 17))
    packed = torch.cat([a, b], dim=1)
    cu = torch.tensor([0, 11, 28], dtype=torch.int32)
    with torch.no_grad():
        lp = model(packed, cu_seqlens=cu).logits
        if implicit:  # the solver runs per batch row: compare at a fixed iteration count
            assert model.config.implicit.tol is None
        la, lb = model(a).logits, model(b).logits
    torch.testing.assert_close(lp, torch.cat([la, lb], dim=1), rtol=1e-4, atol=1e-4)


# --- implicit specifics ------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_residual_below_tol_when_converged(family):
    cfg = small_config(family, dict(max_iter=40, tol=0.01, phantom_steps=1))
    model = AutoModelForCausalLM.from_config(cfg).train()
    ids = torch.randint(0, V, (3, 16))
    out = model(ids)
    st = out.fixed_point_stats
    assert st["converged"] == 1.0 and st["iterations"] < 40
    # re-solve by hand and check the residual of the returned fixed point with the model's own map
    emb = model.model.embed_tokens(ids)
    inj = model.model.injection(emb)
    f = model.model.fixed_point_map(inj)
    from lm.fixed_point import solve
    with torch.no_grad():
        z, stats = solve(f, torch.zeros_like(emb), max_iter=40, tol=0.01)
        r = relative_residual(f(z), z)
    assert bool(stats.converged.all())
    assert (r < 0.01).all(), r


@pytest.mark.parametrize("family", FAMILIES)
def test_phantom_gradient_k1_equals_one_application(family):
    torch.manual_seed(3)
    cfg = small_config(family, dict(max_iter=6, tol=None, phantom_steps=1, damping=1.0))
    model = AutoModelForCausalLM.from_config(cfg).train()
    ids = torch.randint(0, V, (2, 12))
    model(ids, labels=ids).loss.backward()
    g_model = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = copy.deepcopy(model)
    ref.zero_grad()
    inner = ref.model
    emb = inner.embed_tokens(ids)
    inj = inner.injection(emb)
    f = inner.fixed_point_map(inj)
    with torch.no_grad():
        z = torch.zeros_like(emb)
        for _ in range(6):
            z = f(z)
    logits = ref.lm_head(f(z.detach()))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    loss.backward()
    for n, p in ref.named_parameters():
        if n in g_model:
            torch.testing.assert_close(p.grad, g_model[n], rtol=1e-5, atol=1e-7, msg=n)


def _saved_activation_bytes(model, ids):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()
    return total[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_training_memory_does_not_grow_with_max_iter(family):
    ids = torch.randint(0, V, (2, 32))
    sizes = []
    for it in (4, 24):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(small_config(family, dict(max_iter=it, phantom_steps=1))).train()
        sizes.append(_saved_activation_bytes(model, ids))
    print(f"saved activations: 4 iters {sizes[0]} B, 24 iters {sizes[1]} B")
    assert abs(sizes[1] - sizes[0]) <= 0.10 * sizes[0]


def test_duality_sequential_vs_simultaneous():
    """Paper 003: sequential and simultaneous predictions of a trained implicit model agree (97.6%)."""
    torch.manual_seed(4)
    # free-phase training (tol-stopped), evaluation converged tightly in both modes
    cfg = small_config("mamba2", dict(max_iter=8, tol=0.02, phantom_steps=2, eval_tol=1e-3, eval_factor=16))
    model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    losses = overfit_losses(model, markov_tokens(64, 32, seed=0, vocab=V, p_rare=0.25), steps=60, lr=5e-3, batch=8)
    model.eval()
    test = markov_tokens(4, 24, seed=1, vocab=V, p_rare=0.25)
    with torch.no_grad():
        simultaneous = model(test).logits.argmax(-1)
        sequential = model(test, cache=LMCache(), use_cache=True, prefill="sequential").logits.argmax(-1)
    rate = (simultaneous == sequential).float().mean().item()
    print(f"duality token match rate: {rate:.4f} (paper: 0.976), final train loss {losses[-1]:.3f}")
    assert rate >= 0.97


# --- presets and bad input ---------------------------------------------------------------------------

def _size_to_params(size: str) -> float:
    s = size.lower()
    return float(s[:-1]) * (1e9 if s.endswith("b") else 1e6)


@pytest.mark.parametrize("name", [p for p in list_presets() if p.startswith(("lm_llama-", "lm_mamba2-"))
                                  and not p.endswith("-tiny")])
def test_preset_parameter_counts(name):
    size = name.split("-")[1]
    n = count_parameters(load_config(name))["total"]
    target = _size_to_params(size)
    assert abs(n - target) <= 0.15 * target, f"{name}: {n / 1e6:.1f}M"


def test_tiny_presets_are_small():
    for fam in FAMILIES:
        n = count_parameters(load_config(f"lm_{fam}-tiny"))["total"]
        assert 0.5e6 < n < 10e6


@pytest.mark.parametrize("bad,field", [
    (dict(hidden_sizee=32), "hidden_sizee"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_hidden_layers=-1), "num_hidden_layers"),
    (dict(implicit=dict(max_iter=0)), "max_iter"),
    (dict(implicit=dict(damping=1.5)), "damping"),
    (dict(implicit=dict(tol=2.0)), "tol"),
    (dict(implicit=dict(phantom_steps=-1)), "phantom_steps"),
    (dict(implicit=dict(max_iters=4)), "max_iters"),
    (dict(headdim=7), "headdim"),
])
def test_bad_config_raises_value_error_naming_field(bad, field):
    with pytest.raises(ValueError, match=field):
        LMMamba2Config(vocab_size=V, hidden_size=bad.pop("hidden_size", 32), d_state=8, headdim=bad.pop("headdim", 8),
                       **bad)


def test_llama_bad_heads():
    with pytest.raises(ValueError, match="num_attention_heads"):
        LMLlamaConfig(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        LMLlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=3)


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="lm_mamba2-tiny"):
        load_config("no-such-preset")


def test_transformers_kernels_package_not_shadowed():
    from transformers.utils import is_kernels_available

    import lm_kernels  # noqa: F401
    assert not is_kernels_available()


def test_fixed_point_engine_on_a_contraction():
    """solve() finds the fixed point of an affine contraction, freezes converged samples, and Anderson
    acceleration needs fewer iterations."""
    from lm.fixed_point import solve

    torch.manual_seed(0)
    n = 16
    W = torch.randn(n, n, dtype=torch.float64)
    W = 0.9 * W / torch.linalg.matrix_norm(W, 2)
    b = torch.randn(3, n, dtype=torch.float64)
    b[1] *= 1e-3  # a sample that converges at a different pace
    z_true = torch.linalg.solve(torch.eye(n, dtype=torch.float64) - W, b.T).T
    f = lambda z: z @ W.T + b  # noqa: E731
    iters = {}
    for anderson in (0, 5):
        z, st = solve(f, torch.zeros_like(b), max_iter=500, tol=1e-8, anderson=anderson)
        assert bool(st.converged.all()) and (st.residual < 1e-8).all()
        torch.testing.assert_close(z, z_true, rtol=1e-6, atol=1e-9)
        iters[anderson] = st.iterations
    print(f"iterations to 1e-8: plain {iters[0]}, Anderson(5) {iters[5]}")
    assert iters[5] < iters[0]
    for norm in ("l2", "inf", "inf_rows"):
        _, st = solve(f, torch.zeros_like(b), max_iter=500, tol=1e-6, norm=norm)
        assert bool(st.converged.all())


def test_implicit_setting_on_explicit_model_is_refused():
    model = AutoModelForCausalLM.from_config(small_config("mamba2"))
    model.config.implicit = dict(max_iter=2)
    with pytest.raises(ValueError, match="built explicit"):
        model(torch.randint(0, V, (1, 4)))


def test_llama_varlen_attention_equals_dense_block_mask():
    from lm.models.llama import varlen_causal_attention
    from lm.models.layers import position_in_document

    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 5, 12, 30, 31], dtype=torch.int32)  # includes an empty document
    n = 31
    q, k, v = (torch.randn(1, 3, n, 8, dtype=torch.float64) for _ in range(3))
    doc = torch.searchsorted(cu.long()[1:], torch.arange(n), right=True)
    mask = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = varlen_causal_attention(q, k, v, cu, position_in_document(n, cu, q.device))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
@pytest.mark.parametrize("packed", [False, True])
def test_llama_rotary_tables_once_per_forward_equal_per_layer(implicit, packed, monkeypatch):
    """Attention's rotary tables come from the model once per forward (Mixer.shared_inputs); the result
    must equal each layer computing its own (the path with a cache), with and without packing, and the
    tables must be computed once per forward, not per layer or per fixed-point iteration."""
    import lm.models.llama as llama_mod

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config("llama", dict(implicit) if implicit else None)).eval()
    ids = torch.randint(0, V, (1, 20))
    cu = torch.tensor([0, 7, 20]) if packed else None
    calls = []
    real = llama_mod.rotary_cos_sin

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(llama_mod, "rotary_cos_sin", counting)
    with torch.no_grad():
        shared = model(ids, cu_seqlens=cu).logits
        n_shared = len(calls)
        calls.clear()
        monkeypatch.setattr(llama_mod.Attention, "shared_inputs", lambda self, t, c, d, **kw: {})
        per_layer = model(ids, cu_seqlens=cu).logits
    assert n_shared == 1
    assert len(calls) >= 2  # every layer call computed its own tables
    assert torch.equal(shared, per_layer)
