"""SwiGLU's silu(g) * u as one Triton kernel (lm_kernels/swiglu, under TRITON_INTERPRET=1 on CPU) against the PyTorch
formula in float64 (rows of one token and of several, widths not a power of two and wider than one block, strided
inputs, float32 and bfloat16), and the choice `lm.models.layers.silu_mul` makes."""
import pytest
import torch
import torch.nn.functional as F

import lm.models.layers as layers
from lm_kernels.swiglu import silu_mul_triton

pytest.importorskip("triton")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(1, 1, 64), (3, 2, 100), (2, 1, 2816)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(shape, dtype):
    gu = torch.randn(*shape[:-1], 2 * shape[-1], dtype=torch.float64) * 3
    g, u = gu[..., ::2].to(dtype), gu[..., 1::2].to(dtype)  # strided, as views of one tensor
    y = silu_mul_triton(g, u)
    assert y.shape == g.shape and y.dtype == dtype
    assert rel(y, F.silu(g.double()) * u.double()) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_choice(monkeypatch):
    calls = []
    monkeypatch.setattr(layers, "silu_mul_triton", lambda g, u: calls.append(1) or silu_mul_triton(g, u))
    g, u = torch.randn(2, 8), torch.randn(2, 8)
    layers.silu_mul(g, u)
    assert not calls  # automatic on CPU: the PyTorch formula
    monkeypatch.setenv("LM_SWIGLU_BACKEND", "triton")
    y = layers.silu_mul(g, u)
    assert calls and torch.allclose(y, F.silu(g) * u, atol=1e-6)
    g.requires_grad_(True)
    assert layers.silu_mul(g, u).requires_grad and len(calls) == 1  # autograd: the formula
    layers.silu_mul(g.detach().double(), u.double())
    assert len(calls) == 1  # float64: the formula
