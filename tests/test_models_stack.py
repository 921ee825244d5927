"""The block stack forms each block's successor norm inside the block (the residual add and the next pre-norm, or
norm_f after the last block, in one pass): the same model as blocks applied one by one, each norming its own input,
then norm_f; loss and every parameter gradient (the pre-norm weights included, now used by the previous block's
graph) in float64, explicit and implicit, with and without MLPs and activation checkpointing."""
import pytest
import torch
from model_checks import assert_same_step_after
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.models import LMLlamaConfig, LMMamba2Config
from lm.models.modeling import LMModel

V = 64
IMPLICIT = dict(max_iter=3, tol=None, phantom_steps=1, damping=1.0)


def _one_by_one(self, h, inj=None, cache=None, cu_seqlens=None, shared=None):
    """The reference stack: each block norms its own input; norm_f at the end."""
    shared = shared or {}
    for layer in self.layers:
        h = layer(h, injection=inj, cache=cache, cu_seqlens=cu_seqlens, **shared)
    return self.norm_f(h)


def _config(family, implicit):
    imp = dict(implicit) if implicit else None
    if family == "llama":
        return LMLlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                             intermediate_size=48, implicit=imp)
    return LMMamba2Config(vocab_size=V, hidden_size=32, num_hidden_layers=3, d_state=8, headdim=8, chunk_size=8,
                          implicit=imp)


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_fused_successor_norm_is_the_same_model(family, implicit, ckpt, monkeypatch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, implicit)).double().train()
    with torch.no_grad():  # norm weights away from 1, so that a weight used by the wrong block would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, V, (2, 12))
    assert_same_step_after(model, ids, None, lambda: monkeypatch.setattr(LMModel, "_stack", _one_by_one))


@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_fused_successor_norm_under_autocast(family, monkeypatch):
    """Under bf16 autocast: with autograd the same loss and gradients as the one-by-one stack (the successor's norm
    stays float32, its gradient from several projections summed in float32); without autograd (fixed-point iterations,
    eval) the block hands its successor the norm already cast to bf16, as the successor's projections would cast it:
    the same logits, bit for bit."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, None)).train()
    ids = torch.randint(0, V, (2, 12))

    def step():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids).loss
            with torch.no_grad():
                logits = model(ids).logits
        loss.backward()
        return loss.detach(), logits, {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, logits, grads = step()
    monkeypatch.setattr(LMModel, "_stack", _one_by_one)
    ref_loss, ref_logits, ref_grads = step()
    assert torch.equal(logits, ref_logits)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)
