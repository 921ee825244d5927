"""DeltaProduct's short convs as one call per q / k / v (separate output buffers, training path): the same model as
one conv over [q|k|v] split into views, forward and backward, explicit and implicit, packed sequences included."""
import pytest
import torch
from model_checks import assert_same_step_after
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.models.deltaproduct import DeltaProductMixer, LMDeltaProductConfig
from lm.models.layers import causal_conv1d

V = 64


def _one_conv(self, qkv, cu_seqlens):
    """The reference: one conv over the whole [q|k|v] block, split into views."""
    y, _ = causal_conv1d(qkv, self.conv1d.weight[:, 0, :], None, cu_seqlens=cu_seqlens, activation="silu")
    return y.split(self.split[:3], dim=-1)


def _config(implicit, gated):
    return LMDeltaProductConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8,
                                num_householder=2, intermediate_size=48, chunk_size=16, use_forget_gate=gated,
                                use_output_gate=gated,
                                implicit=dict(max_iter=2, tol=None, phantom_steps=1) if implicit else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("implicit", [False, True], ids=["explicit", "implicit"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_separate_convs_equal_one_conv(dtype, implicit, packed, gated, monkeypatch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(implicit, gated)).to(dtype).train()
    if packed:
        ids, cu = torch.randint(0, V, (1, 27)), torch.tensor([0, 10, 19, 27], dtype=torch.int32)
    else:
        ids, cu = torch.randint(0, V, (2, 13)), None
    assert_same_step_after(model, ids, cu, lambda: monkeypatch.setattr(DeltaProductMixer, "_short_convs", _one_conv))


def test_separate_convs_save_less(monkeypatch):
    """k and v reach the op without reshape copies, so the step saves less (counted once per storage)."""
    from dev_tools import load

    saved_tensors, summarize = load("saved").saved_tensors, load("saved").summarize

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(False, False)).train()
    ids = torch.randint(0, V, (2, 32))
    sep = summarize(saved_tensors(model, ids))["per_layer"]
    monkeypatch.setattr(DeltaProductMixer, "_short_convs", _one_conv)
    one = summarize(saved_tensors(model, ids))["per_layer"]
    # at least the two copies of k and v: 2 x (2 * 32 tokens) x n_h H d floats
    assert one - sep >= 2 * 64 * 2 * 2 * 8 * 4, (one, sep)
