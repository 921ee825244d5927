"""Without autograd (fixed-point iterations, eval, generation) the block stack forms each block's successor norm
inside the block (the residual add and the next pre-norm, or norm_f after the last block, in one pass) and hands it
on in the autocast dtype: the same model as blocks applied one by one, each norming its own input, then norm_f.
Checked in float64 on no-grad logits (explicit and implicit, with and without MLPs, with a generation cache), on an
implicit training step (its no-grad solve takes the fused stack, its phantom step the plain one: loss and every
gradient), and bit for bit under bf16 autocast."""
import pytest
import torch
from model_checks import assert_same_step_after
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.models import LMCache, LMLlamaConfig, LMMamba2Config
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
@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_implicit_training_step_with_the_fused_solve(family, ckpt, monkeypatch):
    model = _model(family, IMPLICIT).train()
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
