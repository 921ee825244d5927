"""Models through lm.models.layers.causal_conv1d: tiny Mamba2 and DeltaProduct, explicit and implicit, give the same
loss and parameter gradients with LM_CONV1D_BACKEND=triton (the Triton conv under the interpreter on CPU) as with the
PyTorch reference, packed documents included. Hidden size 16: the interpreter's cost grows with the conv's channels
(Mamba2 48, DeltaProduct 80: still several channel blocks)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("fast_interpreter")  # (tiny shapes: the index math is bounded)

import lm  # noqa: F401,E402  (registration)
import lm_kernels.conv1d as conv1d  # noqa: E402
from lm.models import LMMamba2Config  # noqa: E402
from lm.models.deltaproduct import LMDeltaProductConfig, LMDeltaProductForCausalLM  # noqa: E402
from lm.models.mamba2 import LMMamba2ForCausalLM  # noqa: E402

V = 64


def mamba2(implicit=None):
    torch.manual_seed(0)
    cfg = LMMamba2Config(vocab_size=V, hidden_size=16, num_hidden_layers=2, d_state=8, headdim=8, chunk_size=16,
                         implicit=implicit)
    return LMMamba2ForCausalLM(cfg)


def deltaproduct(implicit=None):
    torch.manual_seed(0)
    cfg = LMDeltaProductConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, intermediate_size=32, num_heads=2,
                               chunk_size=16, num_householder=2, use_forget_gate=True, use_output_gate=True,
                               allow_neg_eigval=True, implicit=implicit)
    return LMDeltaProductForCausalLM(cfg)


MODELS = {
    "mamba2": mamba2,
    "mamba2_implicit": lambda: mamba2(dict(max_iter=2, tol=None, phantom_steps=1, damping=1.0)),
    "deltaproduct": deltaproduct,
    "deltaproduct_implicit": lambda: deltaproduct(dict(max_iter=2, tol=None, phantom_steps=1, damping=1.0)),
}


def loss_and_grads(model, ids, backend, monkeypatch, cu_seqlens=None):
    monkeypatch.setenv("LM_CONV1D_BACKEND", backend)
    model.zero_grad()
    kw = {} if cu_seqlens is None else dict(cu_seqlens=cu_seqlens)
    loss = model(ids, labels=ids, **kw).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_loss_and_grads_triton_equals_reference(name, monkeypatch):
    model = MODELS[name]().train()
    calls = []
    run_triton = conv1d._run_triton
    monkeypatch.setattr(conv1d, "_run_triton", lambda *a: calls.append(1) or run_triton(*a))
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(0))
    cu = None
    if name == "mamba2":  # packed: three documents, one shorter than the conv width
        ids, cu = ids.reshape(1, 40), torch.tensor([0, 2, 23, 40], dtype=torch.int32)
    loss_t, grads_t = loss_and_grads(model, ids, "triton", monkeypatch, cu)
    n_triton = len(calls)
    loss_r, grads_r = loss_and_grads(model, ids, "reference", monkeypatch, cu)
    assert n_triton >= 2 and len(calls) == n_triton  # every layer's conv ran Triton, then none did
    torch.testing.assert_close(loss_t, loss_r, rtol=1e-5, atol=1e-6)
    assert grads_t.keys() == grads_r.keys()
    conv_grads = [n for n in grads_r if "conv1d" in n]
    assert conv_grads, "the model has no conv to compare"
    for n in grads_r:
        err = (grads_t[n] - grads_r[n]).norm() / grads_r[n].norm().clamp_min(1e-12)
        assert err.item() < 1e-4, f"{name} {n}: rel err {err.item():.2e}"
