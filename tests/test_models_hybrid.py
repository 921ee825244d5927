"""Hybrid stacks (`lm_hybrid`, issue 59), CPU, float32: a one-kind pattern is its pure family's model (the same
parameter names, logits and gradients bit for bit); mixed patterns (every kind at least once) generate what full
forwards give (eager and static decode), survive save / load, give separate sequences' logits when packed, run
implicit (the solve over the whole stack: duality, static decode, left padding) and cost per layer what their kinds
cost (FLOPs)."""
from __future__ import annotations

import json

import pytest
import torch
from model_checks import (assert_incremental_equals_full, greedy_by_full_forward, loss_and_grads, markov_tokens,
                          overfit_losses)
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.models import MODEL_TYPES, LMCache, LMHybridConfig
from lm.models import decode as D
from lm.models.presets import count_parameters, flops_per_token, list_presets, load_config

V = 64
SHARED = dict(vocab_size=V, hidden_size=32, intermediate_size=64, rms_norm_eps=1e-5)  # (lm_deltaproduct: 1e-6)
# each kind's settings in the hybrid, and the pure family config that has them
SETTINGS = {
    "attention": dict(num_attention_heads=4, num_key_value_heads=2),
    "mamba2": dict(d_state=8, headdim=8, chunk_size=16),
    "deltaproduct": dict(num_heads=2, head_dim=16, chunk_size=16, use_forget_gate=True),
    "lru": dict(chunk_size=8),
    "hlru": dict(num_states=12, block_size=3, chunk_size=8),
    "bdlru": dict(num_states=12, block_size=3, chunk_size=8),
}
PURE = {"attention": ("lm_llama", {}), "mamba2": ("lm_mamba2", {}), "deltaproduct": ("lm_deltaproduct", {}),
        "lru": ("lm_lru", dict(variant="lru")), "hlru": ("lm_lru", dict(variant="hlru")),
        "bdlru": ("lm_lru", dict(variant="bdlru"))}
LETTER = {"attention": "*", "mamba2": "M", "deltaproduct": "D", "lru": "L", "hlru": "H", "bdlru": "B"}
MIXED = "M*DLHB*M"  # every kind, attention twice (two layers share its shared inputs), a Mamba2 layer last
IMPLICIT = dict(max_iter=3, tol=None, phantom_steps=1)


def hybrid_config(pattern=MIXED, implicit=None, **over):
    kinds = {LETTER[k] for k in LETTER} & set(pattern) if isinstance(pattern, str) else set()
    settings = {k: SETTINGS[k] for k in SETTINGS if LETTER[k] in kinds}
    return LMHybridConfig(layer_pattern=pattern, implicit=implicit, **SHARED, **{**settings, **over})


def hybrid(pattern=MIXED, implicit=None, seed=0, **over):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hybrid_config(pattern, implicit, **over)).eval()


# --- one kind: the pure family ----------------------------------------------------------------------------------
@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
@pytest.mark.parametrize("kind", list(PURE))
def test_one_kind_pattern_is_the_pure_family(kind, implicit):
    """Three layers of one kind: the pure family's model with the hybrid's weights (loaded by name, strictly) gives the
    same logits and gradients, bit for bit (the same blocks, mixers, shared inputs and injection)."""
    model_type, fixed = PURE[kind]
    mlp = kind != "mamba2"  # the default mlp_kinds: the pure families' blocks
    pure_cfg = MODEL_TYPES[model_type][0](**{**SHARED, **({} if mlp else dict(intermediate_size=0))},
                                          num_hidden_layers=3, **SETTINGS[kind], **fixed, implicit=implicit)
    hyb = hybrid(LETTER[kind] * 3, implicit)
    pure = AutoModelForCausalLM.from_config(pure_cfg)
    hs, ps = hyb.state_dict(), pure.state_dict()
    assert hs.keys() == ps.keys()
    pure.load_state_dict(hs, strict=True)
    hyb.train(), pure.train()
    ids = torch.randint(0, V, (2, 21))
    cu = torch.tensor([0, 9, 21], dtype=torch.int32)
    for packed in (False, True):
        x = ids.reshape(1, -1)[:, :21] if packed else ids
        loss_h, grads_h = loss_and_grads(hyb, x, cu if packed else None)
        loss_p, grads_p = loss_and_grads(pure, x, cu if packed else None)
        assert torch.equal(loss_h, loss_p)
        assert grads_h.keys() == grads_p.keys()
        for n in grads_h:
            assert torch.equal(grads_h[n], grads_p[n]), n
    with torch.no_grad():
        assert torch.equal(hyb.eval()(ids).logits, pure.eval()(ids).logits)


def test_weights_move_between_pure_and_hybrid_layers():
    """A Mamba2 + attention hybrid's layers take a pure lm_mamba2's and a pure lm_llama's layer weights by name."""
    hyb = hybrid("M*")
    mamba = AutoModelForCausalLM.from_config(load_config("lm_mamba2", **{**SHARED, "intermediate_size": 0},
                                                         num_hidden_layers=1, **SETTINGS["mamba2"]))
    llama = AutoModelForCausalLM.from_config(load_config("lm_llama", **SHARED, num_hidden_layers=2,
                                                         **SETTINGS["attention"]))
    sd = {k: v for k, v in mamba.state_dict().items() if ".layers." in k}
    sd.update({k: v for k, v in llama.state_dict().items() if ".layers.1." in k})
    missing, unexpected = hyb.load_state_dict(sd, strict=False)
    assert not unexpected and all(".layers." not in k for k in missing), (missing, unexpected)
    for k, v in sd.items():
        assert torch.equal(hyb.state_dict()[k], v)


# --- mixed patterns ---------------------------------------------------------------------------------------------
def test_mixed_pattern_layers_and_parameter_names():
    model = hybrid()
    cfg = model.config
    assert cfg.num_hidden_layers == len(MIXED) and cfg.layer_kinds[1] == "attention"
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.mixer.A_log" in names and "model.layers.0.mlp.gate_proj.weight" not in names  # Mamba2
    assert {"model.layers.1.mixer.qkv_proj.weight", "model.layers.1.mlp.gate_proj.weight"} <= names  # attention
    assert "model.layers.2.mixer.o_norm.weight" in names  # DeltaProduct
    assert "model.layers.3.mixer.nu_log" in names and "model.layers.4.mixer.gate_bias" in names  # LRU, H-LRU
    # the list form is the same model
    same = LMHybridConfig(layer_pattern=cfg.layer_kinds, **SHARED, **{k: SETTINGS[k] for k in SETTINGS})
    assert same.layer_kinds == cfg.layer_kinds


@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
def test_mixed_incremental_equals_full_forward(implicit):
    """Prefill 9 tokens, then one at a time (the chunked paths across chunk boundaries, then each kind's step)."""
    model = hybrid(implicit=implicit)
    if implicit:  # cached implicit decoding is the sequential mode: compare with it from scratch
        ids = torch.randint(0, V, (2, 14))
        with torch.no_grad():
            full = model(ids, cache=LMCache(), use_cache=True, prefill="sequential").logits
            cache = LMCache()
            parts = [model(ids[:, :9], cache=cache, use_cache=True, prefill="sequential").logits]
            parts += [model(ids[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(9, 14)]
        torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)
    else:
        assert_incremental_equals_full(model, vocab=V, split=9, length=21)


@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
def test_mixed_generate_eager_and_static_equal_full_forwards(implicit):
    """Greedy `generate` with the mixed cache, eager and on the static decoder (each layer's own state kinds in
    static buffers), equals greedy decoding by full forwards (implicit: the sequential mode from scratch)."""
    model = hybrid(implicit=implicit)
    # (the implicit reference runs the sequential mode over the whole sequence once per new token: short here)
    prompt, new = torch.randint(1, V, (2, 7)), 10 if implicit is None else 6
    ref = greedy_by_full_forward(model, prompt, new, sequential=implicit is not None)
    for decode in ("eager", "static"):
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                                 pad_token_id=0, eos_token_id=None, prefill="sequential", decode=decode)
        assert torch.equal(out, ref), decode
    dec = next(iter(D._DECODERS[model].values()))
    kinds = {i: set(d) for i, d in dec.cache.layers.items()}
    assert kinds[0] == {"conv", "ssm"} and kinds[1] == {"k", "v"} and kinds[2] == {"conv", "state"}
    assert kinds[3] == kinds[4] == kinds[5] == {"h"}


def test_mixed_save_load_round_trip(tmp_path):
    model = hybrid(implicit=IMPLICIT)
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "lm_hybrid" and saved["layer_pattern"] == MIXED
    assert saved["attention"] == SETTINGS["attention"] and saved["implicit"]["max_iter"] == 3
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is type(model) and back.config.layer_kinds == model.config.layer_kinds
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref)


@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
def test_mixed_packed_equals_separate(implicit):
    """Three documents packed with cu_seqlens (attention per document too) give the separate sequences' logits and,
    explicit, the same gradients as the batch (the loss over the same targets)."""
    model = hybrid(implicit=implicit)
    docs = torch.randint(0, V, (3, 23))
    cu = torch.tensor([0, 23, 46, 69], dtype=torch.int32)
    with torch.no_grad():
        batch = model(docs).logits
        packed = model(docs.reshape(1, -1), cu_seqlens=cu).logits
    torch.testing.assert_close(packed.reshape(3, 23, -1), batch, rtol=1e-4, atol=1e-5)


def test_implicit_injection_one_projection_per_kind():
    """The injection's columns are the kinds' input-projection widths side by side, in order of first appearance;
    each layer adds only its kind's columns (a change to one kind's columns changes no other kind's mixer input)."""
    model = hybrid(implicit=IMPLICIT)
    cfg = model.config
    cols = cfg.injection_columns()
    assert list(cols) == ["mamba2", "attention", "deltaproduct", "lru", "hlru", "bdlru"]
    widths = [hi - lo for lo, hi in cols.values()]
    assert model.model.injection.proj.out_features == sum(widths)
    for layer in model.model.layers:
        width = (layer.mixer.qkv_proj if layer.kind == "attention" else layer.mixer.in_proj).out_features
        assert width == cols[layer.kind][1] - cols[layer.kind][0]
    seen = {}

    def spy(layer):
        def hook(mod, args, kwargs):
            seen[layer.kind] = kwargs["injection"]
        return layer.mixer.register_forward_pre_hook(hook, with_kwargs=True)

    hooks = [spy(layer) for layer in model.model.layers]
    emb = model.model.embed_tokens(torch.randint(0, V, (1, 5)))
    inj = model.model.injection(emb)
    with torch.no_grad():
        model.model.fixed_point_map(inj, shared=model.model._shared(emb, None, None))(torch.zeros_like(emb))
    for h in hooks:
        h.remove()
    for kind, (lo, hi) in cols.items():
        assert torch.equal(seen[kind], inj[..., lo:hi])


@pytest.mark.slow  # (30 training steps)
def test_implicit_duality_where_the_solve_converges():
    """Paper 003's duality over the whole hybrid stack. A random tiny model's map is not contractive (its solve
    stalls), so the model first trains 30 implicit steps (bounded solves with a tolerance and 2 phantom steps), which
    make it contractive; then, solved to a relative residual of 1e-6, the sequential mode (token by token against the
    frozen cache), and the parallel prefill followed by cached decode steps, give the simultaneous forward's logits."""
    torch.manual_seed(4)
    imp = dict(max_iter=8, tol=0.02, phantom_steps=2, eval_tol=1e-6, eval_factor=25)
    model = hybrid("M*DLHB", implicit=imp).train()
    losses = overfit_losses(model, markov_tokens(32, 24, seed=0, vocab=V, p_rare=0.25), steps=30, lr=5e-3, batch=8)
    assert losses[-1] < 0.5 * losses[0]
    model.eval()
    ids = markov_tokens(2, 12, seed=1, vocab=V, p_rare=0.25)  # (each token of the sequential mode solves to 1e-6)
    with torch.no_grad():
        out = model(ids)
        sequential = model(ids, cache=LMCache(), use_cache=True, prefill="sequential")
        cache = LMCache()
        parts = [model(ids[:, :8], cache=cache, use_cache=True, prefill="parallel").logits]
        parts += [model(ids[:, i:i + 1], cache=cache, use_cache=True).logits for i in range(8, 12)]
    for st in (out.fixed_point_stats, sequential.fixed_point_stats):
        assert st["converged"] == 1.0 and st["residual_max"] < 1e-6, dict(st)
    torch.testing.assert_close(sequential.logits, out.logits, rtol=0, atol=5e-4)
    torch.testing.assert_close(torch.cat(parts, 1), out.logits, rtol=0, atol=5e-4)


def test_implicit_training_step_reaches_every_kind_and_the_injection():
    model = hybrid(implicit=IMPLICIT).train()
    ids = torch.randint(0, V, (2, 12))
    _, grads = loss_and_grads(model, ids)
    for i, layer in enumerate(model.model.layers):
        assert any(n.startswith(f"model.layers.{i}.mixer.") and g.abs().sum() > 0 for n, g in grads.items()), i
    assert grads["model.injection.proj.weight"].abs().sum() > 0


def test_left_padded_batch_generates_each_prompt_alone():
    """attention_mask with left padding: each row of a padded batch generates what its prompt generates alone (every
    kind's pads are identity steps, attention masks them)."""
    model = hybrid(initializer_range=0.2)
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(1, V, (n,), generator=g) for n in (5, 1, 19, 11)]
    T = max(len(p) for p in ps)
    ids = torch.zeros(len(ps), T, dtype=torch.long)
    mask = torch.zeros(len(ps), T, dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    args = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    for decode in ("eager", "static"):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, decode=decode, **args)[:, T:]
            for i, p in enumerate(ps):
                alone = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                       decode=decode, **args)[:, len(p):]
                assert torch.equal(out[i], alone[0]), (decode, i)


# --- FLOPs, presets, config errors ------------------------------------------------------------------------------
def test_flops_are_the_sum_of_the_layers_kinds():
    """`lm info`'s stack FLOPs of a hybrid are those of its kinds' pure stacks with the same layer counts."""
    hyb = flops_per_token(hybrid_config("MM**"), seq_len=512)
    mamba = flops_per_token(load_config("lm_mamba2", **{**SHARED, "intermediate_size": 0}, num_hidden_layers=2,
                                        **SETTINGS["mamba2"]), 512)
    llama = flops_per_token(load_config("lm_llama", **SHARED, num_hidden_layers=2, **SETTINGS["attention"]), 512)
    assert hyb["forward_stack"] == mamba["forward_stack"] + llama["forward_stack"]
    assert hyb["forward_head"] == llama["forward_head"]


HYBRID_PRESETS = [p for p in list_presets() if p.startswith("lm_hybrid-") and not p.endswith("-tiny")]


@pytest.mark.parametrize("name", HYBRID_PRESETS)
def test_hybrid_preset_sizes(name):
    size = name.split("-")[-1].lower()
    target = float(size[:-1]) * (1e9 if size.endswith("b") else 1e6)
    n = count_parameters(load_config(name))["total"]
    assert abs(n - target) <= 0.15 * target, f"{name}: {n / 1e6:.1f}M"
    cfg = load_config(name)
    attn = cfg.layer_kinds.count("attention") / cfg.num_hidden_layers
    assert 0.1 <= attn <= 0.25, attn  # about 1 attention layer in 6 (Mamba2) or 1 in 4 (DeltaProduct 3:1)


def test_tiny_preset_runs_implicit():
    cfg = load_config("lm_hybrid-tiny", implicit=IMPLICIT, vocab_size=V)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, V, (1, 10))
    model(ids, labels=ids).loss.backward()
    assert 0.5e6 < count_parameters(load_config("lm_hybrid-tiny"))["total"] < 10e6


@pytest.mark.parametrize("over,field", [
    (dict(layer_pattern="MM-*"), "layer_pattern"),
    (dict(layer_pattern="MMX"), "layer_pattern"),
    (dict(layer_pattern=""), "layer_pattern"),
    (dict(layer_pattern=["mamba2", "attn"]), "layer_pattern"),
    (dict(layer_pattern="MM*", num_hidden_layers=4), "num_hidden_layers"),
    (dict(mlp_kinds=["mlp"]), "mlp_kinds"),
    (dict(attention=dict(num_attention_heads=5)), "attention.num_attention_heads"),
    (dict(attention=dict(hidden_size=64)), "attention.hidden_size"),
    (dict(mamba2=dict(d_stat=8)), "mamba2"),
    (dict(layer_pattern="L", lru=dict(variant="hlru")), "lru.variant"),
    (dict(attention=[4]), "attention"),
])
def test_bad_hybrid_config_names_the_field(over, field):
    kw = {**SHARED, "layer_pattern": "M*", **over}
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LMHybridConfig(**kw)
