"""The one-kernel RMSNorm forward (lm_kernels/rmsnorm, under TRITON_INTERPRET=1 on CPU) vs the PyTorch formula
(lm.models.layers._RMSNormFn), the fused residual add (RMSNorm.add_forward), rms_norm's choice between them, and
generation with it."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import lm  # noqa: F401
import lm.models.layers as layers
from lm.models import decode as Dec
from lm.models.presets import load_config
from lm_kernels.rmsnorm import rms_norm_triton

triton = pytest.importorskip("triton")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,group,gate,weight", [((3, 5, 64), None, False, True),
                                                     ((2, 1, 48), 12, True, True),
                                                     ((4, 40), 20, True, False),
                                                     ((1, 1, 96), None, True, True)],
                         ids=["plain", "gated-groups12", "gated-noweight", "gated-onegroup-96"])
def test_matches_pytorch_formula(shape, group, gate, weight, dtype):
    d = shape[-1]
    x = torch.randn(shape).to(dtype) * 3
    z = torch.randn(shape).to(dtype) if gate else None
    w = torch.randn(d).to(dtype) if weight else None
    ref = layers._RMSNormFn.apply(x, z, w, group or d, 1e-5)
    y = rms_norm_triton(x, w, 1e-5, z=z, group_size=group)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel(y, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_strided_input():
    base = torch.randn(4, 2 * 32)
    x = base[:, :32]  # row stride 64
    z = base[:, 32:]
    w = torch.randn(32)
    assert torch.allclose(rms_norm_triton(x, w, 1e-6, z=z), layers._RMSNormFn.apply(x.contiguous(), z.contiguous(),
                                                                                    w, 32, 1e-6), atol=1e-5)
    xt = torch.randn(32, 4).t()  # channel stride 4
    assert torch.allclose(rms_norm_triton(xt, w, 1e-6), layers._RMSNormFn.apply(xt, None, w, 32, 1e-6), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(3, 1, 64), (2, 4, 40)])
def test_residual_add_fused(shape, dtype, monkeypatch):
    """y, s = rms_norm_triton(x, w, eps, residual=h): s is the add x + h in x's dtype, y the norm of s;
    RMSNorm.add_forward runs it where rms_norm runs the kernel without autograd, the custom operators (the same
    forward kernel) with it, and the add and the module otherwise. (s is the add bit
    for bit where the kernel's cast to bfloat16 rounds to nearest as PyTorch's does; the interpreter's truncates.)"""
    x, h = (torch.randn(shape).to(dtype) * 3 for _ in range(2))
    norm = layers.RMSNorm(shape[-1]).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
    y, s = rms_norm_triton(x, norm.weight, 1e-5, residual=h)
    if dtype == torch.float32 or torch.cuda.is_available():
        assert torch.equal(s, x + h)
    assert rel(s, x.double() + h.double()) < (1e-7 if dtype == torch.float32 else 1e-2)
    assert torch.equal(y, rms_norm_triton(s, norm.weight, 1e-5))
    assert rel(y, layers._RMSNormFn.apply(s, None, norm.weight, shape[-1], 1e-5)) < (
        1e-6 if dtype == torch.float32 else 1e-2)
    calls = []
    real = layers.rms_norm_triton
    monkeypatch.setattr(layers, "rms_norm_triton", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "triton")
    with torch.no_grad():
        s2, y2 = norm.add_forward(x, h)
    assert torch.equal(s2, s) and torch.equal(y2, y) and "residual" in calls[-1]
    calls.clear()
    ops = []
    real_ops = layers.rms_norm_autograd_triton
    monkeypatch.setattr(layers, "rms_norm_autograd_triton", lambda *a, **k: ops.append(k) or real_ops(*a, **k))
    s3, y3 = norm.add_forward(x, h)  # the weight needs a gradient: the custom operators (lm::rms_norm_fwd / _bwd)
    assert not calls and ops and y3.requires_grad and torch.equal(s3, s) and torch.equal(y3.detach(), y)
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "reference")
    with torch.no_grad():
        s4, y4 = norm.add_forward(x, h.float() if dtype != torch.float32 else h)
    assert not calls and s4.dtype == torch.float32


def test_rms_norm_dispatch(monkeypatch):
    """rms_norm runs the kernel only where no gradient is needed and the backend is triton (auto: CUDA)."""
    calls = []
    real = layers.rms_norm_triton
    monkeypatch.setattr(layers, "rms_norm_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w = torch.randn(2, 16), torch.randn(16, requires_grad=True)
    monkeypatch.delenv("LM_RMSNORM_BACKEND", raising=False)
    with torch.no_grad():
        layers.rms_norm(x, w, 1e-5)
    assert calls == [] or torch.cuda.is_available()
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "triton")
    calls.clear()
    y = layers.rms_norm(x, w, 1e-5)  # w needs a gradient: the autograd formula
    assert calls == [] and y.requires_grad
    with torch.no_grad():
        y2 = layers.rms_norm(x, w, 1e-5)
        layers.rms_norm(x.double(), w.double(), 1e-5)  # float64: the formula
    assert calls == [1] and torch.allclose(y2, y.detach(), atol=1e-6)


@pytest.mark.parametrize("family", ["mamba2", "llama"])
def test_generation_with_the_kernel_equals_formula(family, monkeypatch):
    """Greedy static-decoder generation with the norm kernel (and, for Mamba2, the SSD step kernel) gives the
    eager PyTorch path's tokens."""
    import lm.models.mamba2 as mamba2
    from lm_kernels.ssd import ssd_step
    presets = {"mamba2": ("lm_mamba2-tiny", dict(d_state=16, headdim=8, ngroups=2, chunk_size=8)),
               "llama": ("lm_llama-tiny", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64))}
    preset, kw = presets[family]
    torch.manual_seed(0)
    cfg = load_config(preset, vocab_size=64, hidden_size=32, num_hidden_layers=2, **kw)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    prompt = torch.randint(1, 64, (2, 5))
    args = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    monkeypatch.delenv("LM_RMSNORM_BACKEND", raising=False)
    with torch.no_grad():
        eager = model.generate(prompt, attention_mask=torch.ones_like(prompt), decode="eager", **args)
    calls = []
    real = layers.rms_norm_triton
    monkeypatch.setattr(layers, "rms_norm_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "triton")
    monkeypatch.setattr(mamba2, "ssd_step", lambda *a, **k: ssd_step(*a, **k, backend="triton"))
    with torch.no_grad():
        static = model.generate(prompt, attention_mask=torch.ones_like(prompt), decode="static", **args)
    Dec.release_decoders(model)
    assert calls and torch.equal(static, eager)
