"""Where the implicit solve may replay a captured CUDA graph of its map (lm.models.solve_graph.capturable); the
replay itself is checked on a GPU (tests/test_solve_graph_gpu.py)."""
from __future__ import annotations

import types

import pytest
import torch

from lm.models import solve_graph


def _model(preset):
    from transformers import AutoModelForCausalLM

    import lm  # noqa: F401  (registration)
    from lm.models.presets import load_config

    return AutoModelForCausalLM.from_config(load_config(preset, implicit={"max_iter": 2, "phantom_steps": 1}))


@pytest.mark.parametrize("preset,capturable", [("lm_mamba2-tiny", True), ("lm_llama-tiny", False),
                                                ("lm_fp_mamba-tiny", False), ("lm_deltaproduct-tiny", False)])
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
    monkeypatch.setenv("LM_SOLVE_CUDA_GRAPH", "0")
    assert not solve_graph.capturable(model, cuda_inj, None, None)


def test_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("LM_SOLVE_CUDA_GRAPH", "yes")
    with pytest.raises(ValueError, match="LM_SOLVE_CUDA_GRAPH"):
        solve_graph.enabled()
