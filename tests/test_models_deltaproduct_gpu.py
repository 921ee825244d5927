"""lm_deltaproduct on CUDA: the model on the Triton op against the same model on the PyTorch reference
(logits and gradients), bf16 training steps, cached generation and packing on the GPU path."""
from __future__ import annotations

import pytest
import torch
from model_checks import assert_generation_and_packing

from lm.models.deltaproduct import LMDeltaProductConfig, LMDeltaProductForCausalLM

pytestmark = pytest.mark.gpu

OPTIONS = {
    "gated_nh2": dict(num_householder=2, use_forget_gate=True, use_output_gate=True),
    "plain_nh3_noconv": dict(num_householder=3, use_short_conv=False),
    "nh1_01": dict(num_householder=1, allow_neg_eigval=False),
}


def make(name, implicit=None, **over):
    torch.manual_seed(0)
    kw = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_heads=2,
              head_dim=64, chunk_size=32, implicit=implicit, **OPTIONS[name])
    kw.update(over)
    return LMDeltaProductForCausalLM(LMDeltaProductConfig(**kw)).cuda()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def logits_and_grads(model, ids, cu=None):
    model.zero_grad()
    out = model(ids, labels=ids, cu_seqlens=cu)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("name", list(OPTIONS))
def test_triton_model_matches_reference_model(name, monkeypatch):
    model = make(name)
    ids = torch.randint(0, 256, (2, 100), device="cuda")
    monkeypatch.setenv("LM_DELTAPRODUCT_BACKEND", "reference")
    ref_l, ref_g = logits_and_grads(model, ids)
    monkeypatch.setenv("LM_DELTAPRODUCT_BACKEND", "triton")
    tri_l, tri_g = logits_and_grads(model, ids)
    assert rel(tri_l, ref_l) < 1e-4
    for n in ref_g:
        assert rel(tri_g[n], ref_g[n]) < 1e-3, n


@pytest.mark.parametrize("implicit", [None, {"max_iter": 4, "phantom_steps": 1}], ids=["explicit", "implicit"])
def test_bf16_training_steps(implicit):
    model = make("gated_nh2", implicit).to(torch.bfloat16).train()
    ids = torch.randint(0, 256, (4, 256), device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("implicit", [None, {"max_iter": 3, "phantom_steps": 1, "eval_factor": 1.0}],
                         ids=["explicit", "implicit"])
def test_cached_generation_and_packing_on_gpu(implicit):
    model = make("gated_nh2", implicit).eval()
    assert_generation_and_packing(model, implicit is not None)
