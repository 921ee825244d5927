"""The number of kernels a Mamba2 layer's one-token decode step launches (issue 29: inside a CUDA graph the step is
launch bound). Counted on CPU: every aten op that is not a view or an allocation is one kernel, every Triton launch
(SSD step, conv, RMSNorm; run by the interpreter) one, with the backends set as CUDA's automatic choice sets them."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import lm  # noqa: F401
import lm.models.layers as layers
import lm_kernels.conv1d as conv1d
import lm_kernels.ssd as ssd
from lm.models import decode as Dec
from lm.models.presets import load_config

pytest.importorskip("triton")

NOT_KERNELS = {"empty", "empty_like", "empty_strided", "detach", "lift_fresh", "promote_types", "_unsafe_view",
               "_local_scalar_dense"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.inside = 0  # > 0 while a Triton launch runs (the interpreter's own tensor ops are not kernels)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.inside and not func.is_view and name not in NOT_KERNELS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def launch(self, label, fn):
        def run(*a, **k):
            if not self.inside:
                self.counts[label] += 1
            self.inside += 1
            try:
                return fn(*a, **k)
            finally:
                self.inside -= 1
        return run


def step_kernels(layers_n, monkeypatch):
    torch.manual_seed(0)
    cfg = load_config("lm_mamba2-tiny", vocab_size=64, hidden_size=32, num_hidden_layers=layers_n, d_state=16,
                      headdim=8, chunk_size=8)
    model = AutoModelForCausalLM.from_config(cfg).eval().to(torch.bfloat16)
    prompt = torch.randint(1, 64, (1, 4))
    with torch.no_grad():  # makes the decoder (its static buffers), through the PyTorch paths
        model.generate(prompt, attention_mask=torch.ones_like(prompt), decode="static", max_new_tokens=2,
                       do_sample=False, pad_token_id=0)
    dec = next(iter(Dec._DECODERS[model].values()))
    mode = _Count()
    with monkeypatch.context() as m:
        for op in ("ssd", "conv1d", "rmsnorm"):
            m.setenv(f"LM_{op.upper()}_BACKEND", "triton")
        m.setattr(ssd, "_step_triton", mode.launch("triton:ssd_step", ssd._step_triton))
        m.setattr(conv1d, "_run_triton", mode.launch("triton:conv1d", conv1d._run_triton))
        m.setattr(layers, "rms_norm_triton", mode.launch("triton:rmsnorm", layers.rms_norm_triton))
        with torch.no_grad(), mode:
            dec._run()
    Dec.release_decoders(model)
    return mode.counts


def test_mamba2_decode_layer_kernels(monkeypatch):
    """8 per layer: pre-norm, in_proj (one product for z | xBC | dt), conv, its state copy, the SSD step (A = -exp(A_log)
    inside it, the cache's state written in place), gated norm, out_proj, residual add. The PyTorch step and norms,
    three in_proj products and A formed by three kernels of its own made it 54."""
    one, two = step_kernels(1, monkeypatch), step_kernels(2, monkeypatch)
    layer = two - one
    assert layer["triton:ssd_step"] == 1 and layer["triton:rmsnorm"] == 2 and layer["triton:conv1d"] == 1
    assert sum(layer.values()) <= 8, dict(layer)
