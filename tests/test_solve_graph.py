"""Where the implicit solve may replay a captured CUDA graph of its map (lm.models.solve_graph.capturable), and
solve_map's bookkeeping with a stand-in capture: a key is captured at its second forward, each forward's injection
is copied in, a moved parameter makes a new key, old keys are dropped, a failed capture warns and turns capture off
for the model; the parallel prefill through the captured solve and committing pass (commit_map) fills the cache as
the plain prefill does. The replay itself is checked on a GPU (tests/test_solve_graph_gpu.py)."""
from __future__ import annotations

import contextlib
import types

import pytest
import torch

from lm.models import solve_graph


def _model(preset):
    from transformers import AutoModelForCausalLM

    import lm  # noqa: F401  (registration)
    from lm.models.presets import load_config

    return AutoModelForCausalLM.from_config(load_config(preset, implicit={"max_iter": 2, "phantom_steps": 1}))


@pytest.mark.parametrize("preset,capturable", [("lm_mamba2-tiny", True), ("lm_llama-tiny", True),
                                                ("lm_lru-tiny", True), ("lm_deltaproduct-tiny", True),
                                                ("lm_fp_mamba-tiny", False)])
def test_capturable_needs_cuda_and_capturable_mixers(preset, capturable, monkeypatch):
    model = _model(preset).model
    assert all(layer.mixer.capturable == capturable for layer in model.layers)
    inj = torch.zeros(1, 4, 8)
    assert not solve_graph.capturable(model, inj, None, None)  # CPU: the plain map
    cuda_inj = types.SimpleNamespace(device=torch.device("cuda", 0))  # (the check reads the device only)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert solve_graph.capturable(model, cuda_inj, None, None) == capturable
    assert not solve_graph.capturable(model, cuda_inj, torch.tensor([0, 4]), None)  # packed documents
    assert not solve_graph.capturable(model, cuda_inj, None, object())  # a generation cache


def _stand_in_capture(monkeypatch):
    """solve_map's bookkeeping on CPU: the 'capture' records the entry and a 'replay' runs its map on the static
    copies (so a stale copy of the injection would show); no CUDA context."""
    captured = []

    def run(self):
        self.out, self.states = self._run()

    monkeypatch.setattr(solve_graph._Entry, "capture", lambda self: (captured.append(self), run(self)))
    monkeypatch.setattr(solve_graph._Entry, "replay", run)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    return captured


def test_solve_map_captures_a_key_at_its_second_forward_and_reads_new_inputs(monkeypatch):
    captured = _stand_in_capture(monkeypatch)
    model = _model("lm_mamba2-tiny").model.eval()
    gen = torch.Generator().manual_seed(0)
    width = model.injection.proj.out_features
    z = torch.randn(2, 16, model.config.hidden_size, generator=gen)
    with torch.no_grad():
        for step in range(3):
            inj = torch.randn(2, 16, width, generator=gen)
            f = solve_graph.solve_map(model, model.fixed_point_map(inj), inj, {}, torch.zeros_like(z))
            assert isinstance(f, solve_graph._Entry) == (step > 0)
            assert len(captured) == (step > 0)
            torch.testing.assert_close(f(z), model.fixed_point_map(inj)(z), rtol=0, atol=0)
        # a parameter that moves makes a new key (captured at its second forward); at most MAX_GRAPHS are kept. (The
        # old weights stay alive: a new one at a freed one's address would be that key again, which replays correctly.)
        old = []
        for i in range(2 * solve_graph.MAX_GRAPHS):
            w = model.layers[0].mixer.in_proj.weight
            old.append(w)
            model.layers[0].mixer.in_proj.weight = torch.nn.Parameter(w.detach() * 0.9)
            for _ in range(2):
                f = solve_graph.solve_map(model, model.fixed_point_map(inj), inj, {}, torch.zeros_like(z))
            torch.testing.assert_close(f(z), model.fixed_point_map(inj)(z), rtol=0, atol=0)
        assert len(captured) == 1 + 2 * solve_graph.MAX_GRAPHS
        assert len(solve_graph._GRAPHS[model][0]) == solve_graph.MAX_GRAPHS


def test_a_failed_capture_warns_and_the_model_solves_uncaptured(monkeypatch):
    _stand_in_capture(monkeypatch)

    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(solve_graph._Entry, "capture", fail)
    model = _model("lm_mamba2-tiny").model.eval()
    inj = torch.randn(1, 8, model.injection.proj.out_features)
    z = torch.zeros(1, 8, model.config.hidden_size)
    with torch.no_grad():
        solve_graph.solve_map(model, model.fixed_point_map(inj), inj, {}, z)
        with pytest.warns(UserWarning, match="could not be captured"):
            f = solve_graph.solve_map(model, model.fixed_point_map(inj), inj, {}, z)
    assert not isinstance(f, solve_graph._Entry)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not solve_graph.capturable(model, types.SimpleNamespace(device=torch.device("cuda", 0)), None, None)


@pytest.mark.parametrize("preset", ["lm_mamba2-tiny", "lm_llama-tiny"])
def test_prefill_through_the_captured_commit_fills_the_cache_as_the_plain_prefill(preset, monkeypatch):
    from lm.models import LMCache, modeling

    captured = _stand_in_capture(monkeypatch)
    model = _model(preset).eval()
    ids = torch.randint(1, model.config.vocab_size, (2, 12))
    nxt = torch.randint(1, model.config.vocab_size, (2, 1))

    def prefill_and_step(graphs):
        monkeypatch.setattr(modeling, "capturable", lambda *a: graphs)
        cache = LMCache(model.config.num_hidden_layers)
        with torch.no_grad():
            h = model(ids, cache=cache, use_cache=True).logits
            step = model(nxt, cache=cache, use_cache=True).logits  # reads the committed states
        return h, step, cache

    ref_h, ref_step, ref_cache = prefill_and_step(False)
    for call in range(3):  # the second call with this shape captures the solve's map and the committing pass
        h, step, cache = prefill_and_step(True)
        kinds = sorted(e.commit for e in captured)
        assert kinds == ([] if call == 0 else [False, True])
        torch.testing.assert_close(h, ref_h, rtol=0, atol=0)
        torch.testing.assert_close(step, ref_step, rtol=0, atol=0)
        assert cache.seen_tokens == ref_cache.seen_tokens == 13
    commit = next(e for e in captured if e.commit)
    # the states handed back are copies: the next replay does not overwrite a cache already handed out
    for layer, d in cache.layers.items():
        for k, v in d.items():
            assert v.data_ptr() != commit.states[layer][k].data_ptr()
