"""The gated RMSNorm's Triton custom operators on a GPU (compiled, autotuned) at Mamba2-350M's shape (16 x 2048 rows,
d_inner 2048, one group; bf16 activations, float32 weight), with and without the injection's z_add, and at two groups:
y and the gradients of x, z, z_add and the weight against the float64 formula, with the bf16 PyTorch formula's own
error as the yardstick; z_add equal to the materialised bf16 sum z + z_add bit for bit."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from lm.models.layers import _rms_norm_math  # noqa: E402
from lm_kernels.rmsnorm import gated_rms_norm_triton  # noqa: E402

EPS = 1e-5


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _draw(rows, d, seed, add):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, d, generator=g) * 2).to("cuda", torch.bfloat16)
    z = (torch.randn(rows, d, generator=g) * 2).to("cuda", torch.bfloat16)
    za = torch.randn(rows, d, generator=g).to("cuda", torch.bfloat16) if add else None
    w = (1 + 0.1 * torch.randn(d, generator=g)).to("cuda")
    dy = torch.randn(rows, d, generator=g).to("cuda", torch.bfloat16)
    return x, z, za, w, dy


def _grads(fn, tensors, dy):
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    y = fn(*leaves)
    req = [t for t in leaves if t is not None]
    return [y] + list(torch.autograd.grad(y, req, dy.to(y.dtype)))


@pytest.mark.parametrize("add", [False, True], ids=["plain", "z_add"])
@pytest.mark.parametrize("groups", [1, 2])
def test_gated_norm_ops_match_float64(add, groups):
    rows, d = 16 * 2048, 2048
    group = d // groups
    x, z, za, w, dy = _draw(rows, d, seed=groups + 2 * add, add=add)

    def formula(x, z, za, w):
        zz = z + za if za is not None else z
        return _rms_norm_math(x, zz, w, group, EPS)[0]

    ours = _grads(lambda x, z, za, w: gated_rms_norm_triton(x, z, w, EPS, group_size=group, z_add=za), (x, z, za, w),
                  dy)
    bf16 = _grads(formula, (x, z, za, w), dy)
    truth = _grads(formula, tuple(t.double() if t is not None else None for t in (x, z, za, w)), dy)
    names = ["y", "dx", "dz"] + (["dz_add"] if add else []) + ["dw"]
    for name, o, b, t in zip(names, ours, bf16, truth):
        eo, eb = rel(o, t), rel(b, t)
        assert eo <= 2.0 * eb + 2e-3, (name, eo, eb)
    if add:  # the sum in z's dtype, as PyTorch's add rounds it: the op of (z + z_add) equals the op with z_add
        y_sum = gated_rms_norm_triton(x, z + za, w, EPS, group_size=group)
        y_add = gated_rms_norm_triton(x, z, w, EPS, group_size=group, z_add=za)
        assert torch.equal(y_sum, y_add)
