"""The implicit solve's map replayed as a captured CUDA graph (lm.models.solve_graph) trains as the plain map does:
two copies of a tiny implicit model, one solving through the plain map, take the same optimizer steps on new batches
(the injection changes, the parameters move in place), bounded and free phase, eager and compiled blocks; and
evaluation (its own graph) matches too."""
from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu


def _models(preset, implicit, compiled):
    from transformers import AutoModelForCausalLM

    import lm  # noqa: F401  (registration)
    from lm.models.presets import load_config

    torch._dynamo.reset()  # (each test's compiled blocks within dynamo's recompile limit)
    torch.manual_seed(0)
    graphed = AutoModelForCausalLM.from_config(load_config(preset, implicit=implicit)).cuda()
    plain = copy.deepcopy(graphed)
    if compiled:
        for m in (graphed, plain):
            for layer in m.model.layers:
                layer.compile()
    return graphed, plain


def _graphs(monkeypatch, on):
    """Let the solve capture (the shipped check) or not (the plain map, the reference)."""
    from lm.models import modeling, solve_graph

    monkeypatch.setattr(modeling, "capturable", solve_graph.capturable if on else (lambda *a: False))


def _step(model, opt, ids, amp, monkeypatch, graph):
    _graphs(monkeypatch, graph)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        out = model(ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss.detach(), out.fixed_point_stats["residual_max"]


_BOUNDED, _FREE = None, 0.2  # the solver's tol: a fixed iteration count, or a free phase that stops rows early
_EAGER_FP32, _COMPILED_BF16 = (False, False), (True, True)
# Mamba2 in every mode; the other capturable mixers (Mixer.capturable) in the two that differ most
_CASES = [("lm_mamba2-tiny", tol, mode) for tol in (_BOUNDED, _FREE) for mode in (_EAGER_FP32, _COMPILED_BF16)] + [
    (preset, tol, mode) for preset in ("lm_llama-tiny", "lm_deltaproduct-tiny", "lm_lru-tiny", "lm_lru-tiny-hlru")
    for tol, mode in ((_BOUNDED, _EAGER_FP32), (_FREE, _COMPILED_BF16))] + [
    ("lm_lru-tiny-bdlru", _FREE, _COMPILED_BF16)]


@pytest.mark.parametrize("preset,tol,mode", _CASES, ids=[
    f"{p}-{'bounded' if t is None else 'free'}-{'compiled-bf16' if m[0] else 'eager-fp32'}" for p, t, m in _CASES])
def test_graphed_solve_trains_as_the_plain_map(preset, tol, mode, monkeypatch):
    from lm.models import solve_graph

    compiled, amp = mode
    graphed, plain = _models(preset, {"max_iter": 4, "tol": tol, "phantom_steps": 1}, compiled)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (graphed, plain)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    # fp32: the same kernels in the same order, so equal up to the GEMMs' algorithm choice inside a capture
    tol_loss = dict(rtol=1e-5, atol=1e-5) if not amp else dict(rtol=2e-2, atol=2e-2)
    for step in range(4):
        ids = torch.randint(1, graphed.config.vocab_size, (2, 96), device="cuda", generator=gen)
        lg, rg = _step(graphed, opts[0], ids, amp, monkeypatch, True)
        lp, rp = _step(plain, opts[1], ids, amp, monkeypatch, False)
        torch.testing.assert_close(lg, lp, **tol_loss, msg=f"step {step}")
        torch.testing.assert_close(torch.tensor(rg), torch.tensor(rp), **tol_loss)
    assert graphed.model not in solve_graph._FAILED, "the capture failed (see the warning)"
    graphs, _ = solve_graph._GRAPHS[graphed.model]
    assert len(graphs) == 1, "the training shape was not captured"
    assert plain.model not in solve_graph._GRAPHS or not solve_graph._GRAPHS[plain.model][0]
    # bf16 steps leave the copies' parameters apart by rounding (AdamW's normalised updates amplify it): evaluate the
    # same parameters (copied in place, so the graphed model's storage stays where it was captured)
    plain.load_state_dict(graphed.state_dict())
    for m in (graphed, plain):
        m.eval()
    with torch.no_grad():
        for _ in range(2):  # the second forward of the evaluation shape replays its graph
            ids = torch.randint(1, graphed.config.vocab_size, (3, 64), device="cuda", generator=gen)
            _graphs(monkeypatch, True)
            a = graphed(ids).logits
            _graphs(monkeypatch, False)
            b = plain(ids).logits
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert len(graphs) == 2


def test_parameters_that_move_are_captured_again(monkeypatch):
    """A parameter replaced (not updated in place) gives a new key: the stale graph is not replayed."""
    from lm.models import solve_graph

    graphed, plain = _models("lm_mamba2-tiny", {"max_iter": 3, "phantom_steps": 1}, False)
    _graphs(monkeypatch, True)
    ids = torch.randint(1, graphed.config.vocab_size, (2, 64), device="cuda")
    with torch.no_grad():
        for _ in range(2):
            graphed(ids)
        w = graphed.model.layers[0].mixer.in_proj.weight
        graphed.model.layers[0].mixer.in_proj.weight = torch.nn.Parameter(w * 0.5)
        plain.model.layers[0].mixer.in_proj.weight = torch.nn.Parameter(w.detach().clone() * 0.5)
        for _ in range(2):
            a = graphed(ids).logits
        _graphs(monkeypatch, False)
        b = plain(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(solve_graph._GRAPHS[graphed.model][0]) == 2


@pytest.mark.parametrize("preset", ["lm_mamba2-tiny", "lm_llama-tiny", "lm_deltaproduct-tiny", "lm_lru-tiny",
                                    "lm_lru-tiny-hlru", "lm_lru-tiny-bdlru"])
def test_prefill_through_the_captured_solve_and_commit_generates_as_the_plain_prefill(preset, monkeypatch):
    """The parallel prefill on an empty cache replays the captured solve and the captured committing pass (from the
    second prompt of a shape on): the prompt's logits and the tokens generated after it equal the plain prefill's."""
    from lm.models import solve_graph

    graphed, plain = _models(preset, {"max_iter": 4, "phantom_steps": 1}, False)
    for m in (graphed, plain):
        m.eval()
    gen = torch.Generator(device="cuda").manual_seed(2)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(1, graphed.config.vocab_size, (2, 40), device="cuda", generator=gen)
            outs = []
            for model, on in ((graphed, True), (plain, False)):
                _graphs(monkeypatch, on)
                logits = model(ids, use_cache=True).logits
                seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                     pad_token_id=0, eos_token_id=None)
                outs.append((logits, seq))
            torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-4, atol=1e-4)
            assert torch.equal(outs[0][1], outs[1][1])
    assert graphed.model not in solve_graph._FAILED_COMMIT, "the committing pass failed to capture (see the warning)"
    graphs, _ = solve_graph._GRAPHS[graphed.model]
    assert any(k[0] for k in graphs), "the committing pass was not captured"
