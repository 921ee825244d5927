"""The fused (gated, grouped) RMSNorm against its plain formula, and what it saves for backward."""
import pytest
import torch
import torch.nn.functional as F

from lm.models.layers import rms_norm


def plain(x, weight, eps, z=None, group=None):
    u = x * F.silu(z) if z is not None else x
    group = group or x.shape[-1]
    ug = u.reshape(*u.shape[:-1], u.shape[-1] // group, group)
    y = (ug * torch.rsqrt(ug.pow(2).mean(-1, keepdim=True) + eps)).reshape(u.shape)
    return y * weight if weight is not None else y


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("group", [None, 4])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_formula_forward_and_backward_float64(gated, group, with_weight):
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    z = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True) if gated else None
    w = (torch.rand(12, dtype=torch.float64) + 0.5).requires_grad_(True) if with_weight else None
    ins = [t for t in (x, z, w) if t is not None]
    ref = plain(x, w, 1e-5, z, group)
    out = rms_norm(x, w, 1e-5, z=z, group_size=group)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, ins, dy)
    g_out = torch.autograd.grad(out, ins, dy)
    for a, b in zip(g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_rms_norm_bf16_close_and_saves_only_inputs():
    x = torch.randn(4, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    z = torch.randn(4, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = rms_norm(x, w, 1e-5, z=z, group_size=128)
    ref = plain(x.float(), w, 1e-5, z.float(), 128)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    # x and z in bf16, the weight, and one float32 rstd per (row, group): not float32 activations
    act = x.numel() * 2
    assert sum(saved) <= 2 * act + 256 * 4 + 4 * 64 * 2 * 4
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and z.grad is not None and w.grad is not None
