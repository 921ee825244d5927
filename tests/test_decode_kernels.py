"""The number of kernels a Mamba2 or Llama layer's one-token decode step launches (issue 29: inside a CUDA graph the
step is launch bound). Counted on CPU: every aten op that is not a view or an allocation is one kernel, every Triton
launch (SSD step, conv, RMSNorm, rotary + K/V write, SwiGLU's gate; run by the interpreter) one, a custom operator
(the gated norm) one, with the backends set
as CUDA's automatic choice sets them."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import lm  # noqa: F401
import lm.models.layers as layers
import lm_kernels.conv1d as conv1d
import lm_kernels.rope as rope
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


PRESETS = {
    "mamba2": ("lm_mamba2-tiny", dict(d_state=16, headdim=8, chunk_size=8)),
    "llama": ("lm_llama-tiny", dict(num_attention_heads=2, intermediate_size=64)),
}


def step_kernels(layers_n, monkeypatch, family="mamba2"):
    torch.manual_seed(0)
    preset, kw = PRESETS[family]
    cfg = load_config(preset, vocab_size=64, hidden_size=32, num_hidden_layers=layers_n, **kw)
    model = AutoModelForCausalLM.from_config(cfg).eval().to(torch.bfloat16)
    prompt = torch.randint(1, 64, (1, 4))
    with torch.no_grad():  # makes the decoder (its static buffers), through the PyTorch paths
        model.generate(prompt, attention_mask=torch.ones_like(prompt), decode="static", max_new_tokens=2,
                       do_sample=False, pad_token_id=0)
    dec = next(iter(Dec._DECODERS[model].values()))
    mode = _Count()
    with monkeypatch.context() as m:
        for op in ("ssd", "conv1d", "rmsnorm", "rope", "swiglu"):
            m.setenv(f"LM_{op.upper()}_BACKEND", "triton")
        m.setattr(ssd, "_step_triton", mode.launch("triton:ssd_step", ssd._step_triton))
        m.setattr(conv1d, "_run_triton", mode.launch("triton:conv1d", conv1d._run_triton))
        m.setattr(layers, "rms_norm_triton", mode.launch("triton:rmsnorm", layers.rms_norm_triton))
        m.setattr(rope, "_triton", mode.launch("triton:rope", rope._triton))
        m.setattr(layers, "silu_mul_triton", mode.launch("triton:silu_mul", layers.silu_mul_triton))
        with torch.no_grad(), mode:
            dec._run()
    Dec.release_decoders(model)
    return mode.counts


def test_mamba2_decode_layer_kernels(monkeypatch):
    """7 per layer: in_proj (one product for z | xBC | dt), conv, its state copy, the SSD step (A = -exp(A_log) inside
    it, the cache's state written in place), gated norm (its custom operator: one Triton kernel), out_proj, and the
    residual add fused with the next norm (one kernel). The PyTorch step and norms, three in_proj products and A formed
    by three kernels of its own made it 54; a separate residual add and pre-norm 8."""
    one, two = step_kernels(1, monkeypatch), step_kernels(2, monkeypatch)
    layer = two - one
    assert layer["triton:ssd_step"] == 1 and layer["triton:conv1d"] == 1
    assert layer["triton:rmsnorm"] == 1 and layer["gated_rms_norm_fwd"] == 1
    assert sum(layer.values()) <= 7, dict(layer)


def test_llama_decode_layer_kernels(monkeypatch):
    """10 per layer: qkv_proj, the rotary embedding of q and k with the K/V cache write (one kernel), SDPA under the
    step's additive mask (made once per step, not per layer), o_proj, the residual add fused into the MLP norm, gate
    and up products, silu(gate) * up (one kernel), down_proj, and the residual add fused with the next norm. The
    PyTorch rotation (casts, mul/neg/cat/add), two index_copy_, SDPA's conversion of a bool mask (scalar_tensor x2,
    where), silu and mul, and the separate adds made it 29."""
    one, two = step_kernels(1, monkeypatch, "llama"), step_kernels(2, monkeypatch, "llama")
    layer = two - one
    assert layer["triton:rope"] == 1 and layer["triton:rmsnorm"] == 2 and layer["triton:silu_mul"] == 1
    assert layer["mm"] == 5
    assert sum(layer.values()) <= 10, dict(layer)
