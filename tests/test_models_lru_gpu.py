"""lm_lru on CUDA: each variant on the Triton scan against the same model on the PyTorch reference
(logits and gradients), bf16 training steps, cached generation and packing on the GPU path."""
from __future__ import annotations

import pytest
import torch
from model_checks import assert_generation_and_packing

from lm.models.lru import LMLRUConfig, LMLRUForCausalLM

pytestmark = pytest.mark.gpu

VARIANTS = ["lru", "hlru", "bdlru"]


def make(variant, implicit=None, **over):
    torch.manual_seed(0)
    kw = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, intermediate_size=256, variant=variant,
              chunk_size=32, implicit=implicit)
    if variant != "lru":
        kw.update(block_size=4, num_states=32)
    kw.update(over)
    return LMLRUForCausalLM(LMLRUConfig(**kw)).cuda()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def logits_and_grads(model, ids, cu=None):
    model.zero_grad()
    out = model(ids, labels=ids, cu_seqlens=cu)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("variant", VARIANTS)
def test_triton_model_matches_reference_model(variant, monkeypatch):
    model = make(variant)
    ids = torch.randint(0, 256, (2, 100), device="cuda")
    monkeypatch.setenv("LM_LRU_BACKEND", "reference")
    ref_l, ref_g = logits_and_grads(model, ids)
    monkeypatch.setenv("LM_LRU_BACKEND", "triton")
    tri_l, tri_g = logits_and_grads(model, ids)
    assert rel(tri_l, ref_l) < 1e-4
    for n in ref_g:
        assert rel(tri_g[n], ref_g[n]) < 1e-3, n


@pytest.mark.parametrize("variant,implicit", [("lru", None), ("bdlru", None), ("hlru", {"max_iter": 4})],
                         ids=["lru", "bdlru", "implicit_hlru"])
def test_bf16_training_steps(variant, implicit):
    model = make(variant, implicit).to(torch.bfloat16).train()
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


@pytest.mark.parametrize("variant,implicit", [("bdlru", None), ("lru", None),
                                              ("bdlru", {"max_iter": 3, "eval_factor": 1.0})],
                         ids=["bdlru", "lru", "implicit_bdlru"])
def test_cached_generation_and_packing_on_gpu(variant, implicit):
    model = make(variant, implicit).eval()
    assert_generation_and_packing(model, implicit is not None)
