"""The block stack forms each block's successor norm inside the block (the residual add and the next pre-norm, or
norm_f after the last block, in one pass) and hands it on in the autocast dtype: without autograd (fixed-point
iterations, eval, generation) always, with autograd where every mixer reads its input through one projection
(Mixer.reads_input_once). The same model as blocks applied one by one, each norming its own input, then norm_f.
Checked in float64 on no-grad logits (explicit and implicit, with and without MLPs, with a generation cache), on
training steps (explicit, and implicit: its no-grad solve and its phantom step; plain and checkpointed: loss and
every gradient), and bit for bit under bf16 autocast, logits and a training step's gradients; a mixer that reads
its input twice (LRU's D x skip) keeps the plain stack under autograd."""
import pytest
import torch
from model_checks import assert_same_step_after
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.models import LMCache, LMLlamaConfig, LMLRUConfig, LMMamba2Config
from lm.models.modeling import LMModel

V = 64
IMPLICIT = dict(max_iter=3, tol=None, phantom_steps=1, damping=1.0)


def _one_by_one(self, h, inj=None, cache=None, cu_seqlens=None, shared=None):
    """The reference stack: each block norms its own input; norm_f at the end."""
    shared = shared or {}
    for layer in self.layers:
        h = layer(h, injection=inj, cache=cache, cu_seqlens=cu_seqlens, **shared)
    return self.norm_f(h)


def _model(family, implicit, dtype=torch.float64):
    imp = dict(implicit) if implicit else None
    if family == "llama":
        cfg = LMLlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                            intermediate_size=48, implicit=imp)
    elif family == "lru":
        cfg = LMLRUConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, intermediate_size=48, chunk_size=8,
                          implicit=imp)
    else:
        cfg = LMMamba2Config(vocab_size=V, hidden_size=32, num_hidden_layers=3, d_state=8, headdim=8, chunk_size=8,
                             implicit=imp)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    with torch.no_grad():  # norm weights away from 1, so that a weight used by the wrong block would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("cached", [False, True], ids=["full", "cache"])
@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_fused_successor_norm_without_autograd(family, implicit, cached, monkeypatch):
    model = _model(family, implicit).eval()
    ids = torch.randint(0, V, (2, 12))

    def logits():
        with torch.no_grad():
            if cached:  # a prompt then one more token through the generation cache
                cache = LMCache(model.config.num_hidden_layers)
                model(ids[:, :11], cache=cache, use_cache=True)
                return model(ids[:, 11:], cache=cache, use_cache=True).logits
            return model(ids).logits

    fused = logits()
    monkeypatch.setattr(LMModel, "_stack", _one_by_one)
    torch.testing.assert_close(fused, logits(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_training_step_with_the_fused_stack(family, implicit, ckpt, monkeypatch):
    model = _model(family, implicit).train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, V, (2, 12))
    assert_same_step_after(model, ids, None, lambda: monkeypatch.setattr(LMModel, "_stack", _one_by_one))


@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_fused_successor_norm_under_autocast(family, monkeypatch):
    """Under bf16 autocast without autograd the block hands its successor the norm already cast to bf16, as the
    successor's input projections would cast it: the same logits, bit for bit."""
    model = _model(family, None, torch.float32).eval()
    ids = torch.randint(0, V, (2, 12))

    def logits():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model(ids).logits

    fused = logits()
    monkeypatch.setattr(LMModel, "_stack", _one_by_one)
    assert torch.equal(fused, logits())


@pytest.mark.parametrize("family", ["llama", "mamba2", "lru"])
def test_training_step_under_autocast(family, monkeypatch):
    """With autograd under bf16 autocast: the norm handed on in bf16 (Llama, Mamba2) gives the loss and every
    gradient of blocks applied one by one, bit for bit (the projection's input gradient is bf16 either way). LRU
    reads its input twice (D x) and in its dtype: it keeps the plain stack, else its outputs would change."""
    model = _model(family, None, torch.float32).train()
    ids = torch.randint(0, V, (2, 12))
    if family == "lru":
        assert not model.model.layers[0].mixer.reads_input_once

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step()
    monkeypatch.setattr(LMModel, "_stack", _one_by_one)
    ref_loss, ref_grads = step()
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n
