"""Hybrid stacks on CUDA (issue 59): the Triton paths of every kind in one model (Mamba2's fused operator reading its
kind's columns of the implicit injection through their row stride, the DeltaProduct and LRU kernels, SDPA attention,
the decode-step kernels) give the CPU reference model's loss and gradients; the CUDA-graph decode gives the eager
path's tokens with a mixed cache (also sliding-window attention); compiled blocks (inductor) and the captured implicit
solve (lm.models.solve_graph) give the plain model's losses."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.models import LMHybridConfig
from lm.models import decode as D

pytestmark = pytest.mark.gpu

V = 256
SETTINGS = dict(attention=dict(num_attention_heads=4, num_key_value_heads=2),
                mamba2=dict(d_state=32, headdim=32, chunk_size=32),
                deltaproduct=dict(num_heads=2, head_dim=64, chunk_size=32, use_forget_gate=True),
                lru=dict(chunk_size=32), hlru=dict(num_states=32, block_size=3, chunk_size=32),
                bdlru=dict(num_states=32, block_size=4, chunk_size=32))
MIXED = "M*DLHB*M"


def make(pattern=MIXED, implicit=None, **over):
    torch.manual_seed(0)
    kw = {**SETTINGS, **over}
    cfg = LMHybridConfig(vocab_size=V, hidden_size=128, intermediate_size=256, layer_pattern=pattern,
                         implicit=implicit, **kw)
    return AutoModelForCausalLM.from_config(cfg)


def _loss_grads(model, ids, cu=None):
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, cu_seqlens=cu).loss
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("implicit", [None, dict(max_iter=4, tol=None, phantom_steps=1)], ids=["explicit", "implicit"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_cuda_kernels_equal_cpu_reference(implicit, packed):
    cpu = make(implicit=implicit).train()
    gpu = copy.deepcopy(cpu).cuda()
    if packed:
        ids, cu = torch.randint(0, V, (1, 150)), torch.tensor([0, 37, 100, 150], dtype=torch.int32)
    else:
        ids, cu = torch.randint(0, V, (2, 90)), None
    ref_loss, ref = _loss_grads(cpu, ids, cu)
    loss, got = _loss_grads(gpu, ids.cuda(), cu.cuda() if cu is not None else None)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-4)
    assert got.keys() == ref.keys()
    for n in ref:
        err = ((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)).item()
        assert err < 2e-3, f"{n}: relative error {err:.2e}"


@pytest.mark.parametrize("implicit", [None, dict(max_iter=3, tol=None, eval_factor=2)], ids=["explicit", "implicit"])
@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
def test_graph_decode_equals_eager(implicit, window):
    model = make(implicit=implicit, attention=dict(num_attention_heads=4, num_key_value_heads=2,
                                                   sliding_window=window)).cuda().eval()
    prompt = torch.randint(1, V, (3, 20), device="cuda")

    def gen(decode):
        with torch.no_grad():
            return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                  min_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None,
                                  decode=decode)

    eager = gen("eager")
    assert torch.equal(gen("graph"), eager)
    assert torch.equal(gen("static"), eager)
    assert any(d.graph is not None for d in D._DECODERS[model].values()), "no graph was captured"


def test_compiled_blocks_and_captured_solve_train_as_plain(monkeypatch):
    """Two copies of an implicit Mamba2 + attention hybrid, blocks compiled, bf16 autocast: one solving through the
    captured map (the shipped path), one through the plain map, take the same steps."""
    from lm.models import modeling, solve_graph

    torch._dynamo.reset()
    graphed = make("MM*M*", implicit=dict(max_iter=4, tol=None, phantom_steps=1)).cuda()
    plain = copy.deepcopy(graphed)
    for m in (graphed, plain):
        for layer in m.model.layers:
            layer.compile()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (graphed, plain)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(4):
        ids = torch.randint(1, V, (2, 96), device="cuda", generator=gen)
        losses = []
        for model, opt, on in ((graphed, opts[0], True), (plain, opts[1], False)):
            monkeypatch.setattr(modeling, "capturable", solve_graph.capturable if on else (lambda *a: False))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=2e-2, msg=f"step {step}")
    assert graphed.model not in solve_graph._FAILED, "the capture failed (see the warning)"
    assert len(solve_graph._GRAPHS[graphed.model][0]) == 1, "the training shape was not captured"
    torch._dynamo.reset()
