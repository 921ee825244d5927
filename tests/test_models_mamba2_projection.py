"""Mamba2's in_proj as three products (z / xBC / dt in separate buffers): the same model as the one fused
projection split into views, forward and backward, explicit and implicit, packed sequences included; and the
saved-tensor memory that the separate buffers exist for."""
import pytest
import torch
from model_checks import assert_same_step_after
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.models import LMMamba2Config
from lm.models.mamba2 import Mamba2Mixer

V = 64
IMPLICIT = dict(max_iter=3, tol=None, phantom_steps=1, damping=1.0)


def _fused_project(self, x, injection, part):
    """The reference: one in_proj output (+ the injection as one tensor), split into views."""
    zxbcdt = self.in_proj(x)
    if injection is not None:
        zxbcdt = zxbcdt + torch.cat(injection, dim=-1)
    z, xbc, dt = zxbcdt.split([self.d_inner, self.conv_dim, self.nheads], dim=-1)
    return {"z": z, "xbc": xbc, "dt": dt}[part]


def _config(implicit):
    return LMMamba2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, d_state=8, headdim=8, ngroups=2,
                          chunk_size=8, implicit=dict(implicit) if implicit else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_split_projection_equals_fused(dtype, implicit, packed, monkeypatch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(implicit)).to(dtype).train()
    if packed:
        ids, cu = torch.randint(0, V, (1, 29)), torch.tensor([0, 11, 20, 29], dtype=torch.int32)
    else:
        ids, cu = torch.randint(0, V, (3, 13)), None
    assert_same_step_after(model, ids, cu, lambda: monkeypatch.setattr(Mamba2Mixer, "project", _fused_project))


def test_parameter_names_unchanged():
    names = {n for n, _ in AutoModelForCausalLM.from_config(_config(None)).named_parameters()}
    assert "model.layers.0.mixer.in_proj.weight" in names
    assert not any("z_proj" in n or "xbc_proj" in n for n in names)


def _saved_unique_bytes(model, ids):
    """Bytes of the tensors autograd saves, counted once per storage (views of one buffer share it)."""
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[(s.data_ptr(), t.device)] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
def test_split_projection_saves_no_more(implicit, monkeypatch):
    """The separate buffers never save more than the fused projection (eager)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(implicit)).train()
    ids = torch.randint(0, V, (2, 32))
    split = _saved_unique_bytes(model, ids)
    monkeypatch.setattr(Mamba2Mixer, "project", _fused_project)
    fused = _saved_unique_bytes(model, ids)
    assert split <= fused, (split, fused)
