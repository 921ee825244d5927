"""lm_kernels.conv1d: the Triton depthwise causal conv1d (under TRITON_INTERPRET=1 on CPU) against the
PyTorch reference and a float64 per-token loop, forward and every gradient (x, weight, bias, conv_state,
and through the returned conv state), at shapes crossing the interpreter's 8-row / 16-channel tiles and
16-row backward chunks; packed documents shorter than the width; non-contiguous x; bf16 and fp32;
backend dispatch and argument errors."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lm_kernels.backend import resolve_backend  # noqa: E402
from lm_kernels.conv1d import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_naive,
    causal_conv1d_reference,
)


def make_inputs(b, t, c, w, *, bias=True, state=False, dtype=torch.float32, pad=(3, 5), seed=0):
    """x as a split view of a wider projection (stride(1) != c), weight (c, w) as the slice of a
    Conv1d weight (c, 1, w), optional bias / conv state; float32 draws cast to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(b, t, pad[0] + c + pad[1], generator=g).to(dtype)
    w3 = (torch.randn(c, 1, w, generator=g) / w ** 0.5).to(dtype)
    bi = torch.randn(c, generator=g).to(dtype) if bias else None
    st = torch.randn(b, c, w - 1, generator=g).to(dtype) if state else None
    return proj, w3, bi, st


def run(fn, proj, w3, bias, state, c, pad0=3, grads=True, **kw):
    """Forward and backward of a loss touching y and the new conv state; returns the outputs and the
    gradients of proj (i.e. x), weight, bias and conv state (None where not given)."""
    leaves = [v.detach().clone().requires_grad_(grads) if v is not None else None for v in (proj, w3, bias, state)]
    p, w3_, bi, st = leaves
    x = p[..., pad0: pad0 + c]
    y, ns = fn(x, w3_[:, 0, :], bi, conv_state=st, **kw)
    out = [y, ns]
    if grads:
        g = torch.Generator().manual_seed(1)
        gy = torch.randn(y.shape, generator=g).to(y.dtype)
        gs = torch.randn(ns.shape, generator=g).to(ns.dtype)
        ((y.double() * gy.double()).sum() + (ns.double() * gs.double()).sum()).backward()
        out += [v.grad if v is not None else None for v in leaves]
    return out


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


NAMES = ["y", "new_state", "dx", "dweight", "dbias", "dstate"]


def check(ours, ref, tol, names=NAMES):
    for name, a, r in zip(names, ours, ref):
        if r is None:
            assert a is None, name
            continue
        assert a.shape == r.shape, name
        assert rel(a, r) < tol, f"{name}: rel err {rel(a, r):.2e} >= {tol}"


SHAPES = [  # (b, t, c, w, bias, state, activation)
    (2, 21, 24, 4, True, True, "silu"),
    (2, 21, 24, 4, False, False, "silu"),
    (1, 19, 40, 3, True, True, None),
    (2, 9, 17, 2, True, False, "silu"),
    (1, 2, 16, 4, True, True, "silu"),   # t < w-1: the new state still holds part of the old one
    (1, 11, 16, 1, True, False, "silu"),
    (1, 17, 16, 8, False, True, "silu"),
]


@pytest.mark.parametrize("b,t,c,w,bias,state,act", SHAPES, ids=[f"b{s[0]}t{s[1]}c{s[2]}w{s[3]}" +
                                                                   ("-bias" if s[4] else "") + ("-state" if s[5] else "") +
                                                                   f"-{s[6]}" for s in SHAPES])
def test_fp32_matches_naive_and_reference(b, t, c, w, bias, state, act):
    proj, w3, bi, st = make_inputs(b, t, c, w, bias=bias, state=state)
    ours = run(causal_conv1d, proj, w3, bi, st, c, activation=act, backend="triton")
    naive = run(causal_conv1d_naive, proj.double(), w3.double(), bi.double() if bias else None,
                st.double() if state else None, c, activation=act)
    ref = run(causal_conv1d_reference, proj, w3, bi, st, c, activation=act)
    check(ours, naive, 2e-6)
    check(ours, ref, 2e-6)
    assert ours[0].is_contiguous() and ours[0].dtype == torch.float32


@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("cu,w", [([0, 1, 3, 4, 10, 21], 4),      # documents of 1, 2, 1 tokens: shorter than w
                                  ([0, 0, 5, 6, 6, 19, 21], 3),    # empty documents
                                  ([0, 21], 2)])
def test_packed_documents(cu, w, state):
    c = 20
    proj, w3, bi, st = make_inputs(1, 21, c, w, state=state)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    ours = run(causal_conv1d, proj, w3, bi, st, c, cu_seqlens=cu_t, backend="triton")
    naive = run(causal_conv1d_naive, proj.double(), w3.double(), bi.double(), st.double() if state else None, c,
                cu_seqlens=cu_t)
    ref = run(causal_conv1d_reference, proj, w3, bi, st, c, cu_seqlens=cu_t)
    check(ours, naive, 2e-6)
    check(ours, ref, 2e-6)
    if state:  # a packed batch starts a document at 0: no tap reaches the conv state
        assert ours[-1].abs().max().item() == 0.0


def _conv_grads(x, weight, bias, gy, cu_seqlens=None):
    """y and the gradients of x, weight, bias for the loss sum(y * gy) (Triton path)."""
    x, weight, bias = (v.detach().clone().requires_grad_() for v in (x, weight, bias))
    y, _ = causal_conv1d(x, weight, bias, cu_seqlens=cu_seqlens, backend="triton")
    (y * gy).sum().backward()
    return y, x.grad, weight.grad, bias.grad


def test_packed_equals_documents_run_alone():
    """Each packed document gives the outputs and input gradients of a run of that document alone, and
    the packed weight / bias gradients are the sums over the documents."""
    c, w, cu = 16, 4, [0, 2, 13, 19]
    proj, w3, bi, _ = make_inputs(1, 19, c, w)
    x, gy = proj[..., 3:3 + c], torch.randn(1, 19, c)
    y, dx, dw, db = _conv_grads(x, w3[:, 0], bi, gy, torch.tensor(cu))
    sw, sb = 0, 0
    for a, e in zip(cu[:-1], cu[1:]):
        ya, dxa, dwa, dba = _conv_grads(x[:, a:e], w3[:, 0], bi, gy[:, a:e])
        torch.testing.assert_close(y[:, a:e], ya, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dx[:, a:e], dxa, rtol=1e-6, atol=1e-6)
        sw, sb = sw + dwa, sb + dba
    torch.testing.assert_close(dw, sw, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, sb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("state", [False, True])
def test_bf16_against_float64(state):
    """bf16 inputs: our fp32-accumulated outputs and gradients are at least as close to the float64 truth
    (from the same bf16 inputs) as the PyTorch reference computed in bf16."""
    b, t, c, w = 2, 21, 24, 4
    proj, w3, bi, st = make_inputs(b, t, c, w, state=state, dtype=torch.bfloat16)
    ours = run(causal_conv1d, proj, w3, bi, st, c, backend="triton")
    ref = run(causal_conv1d_reference, proj, w3, bi, st, c)
    truth = run(causal_conv1d_naive, proj.double(), w3.double(), bi.double(), st.double() if state else None, c)
    assert ours[0].dtype == torch.bfloat16 and ours[1].dtype == torch.bfloat16
    for name, a, r, tr in zip(NAMES, ours, ref, truth):
        if tr is None:
            continue
        assert a.dtype == r.dtype, name
        assert rel(a, tr) < 1e-2, f"{name}: {rel(a, tr):.2e}"
        assert rel(a, tr) <= 1.5 * rel(r, tr) + 1e-3, f"{name}: ours {rel(a, tr):.2e} vs reference {rel(r, tr):.2e}"


def test_mixed_dtypes_fp32_weight_bf16_x():
    """fp32 parameters with bf16 activations (autocast-style): weight/bias rounded to bf16 like the
    reference, gradients in the parameters' dtype."""
    b, t, c, w = 1, 13, 16, 4
    proj, w3, bi, st = make_inputs(b, t, c, w, state=True)
    proj = proj.bfloat16()
    ours = run(causal_conv1d, proj, w3, bi, st, c, backend="triton")
    ref = run(causal_conv1d_reference, proj, w3, bi, st, c)
    for name, a, r in zip(NAMES, ours, ref):
        assert a.dtype == r.dtype, name
        assert rel(a, r) < 2e-2, f"{name}: {rel(a, r):.2e}"


def test_x_with_strided_channels_and_partial_grads():
    """x whose channels are not contiguous (copied once by the wrapper); only weight requires grad."""
    b, t, c, w = 1, 10, 16, 3
    base = torch.randn(b, c, t)
    x = base.transpose(1, 2)  # stride(2) == t
    wt = torch.randn(c, w, requires_grad=True)
    y, _ = causal_conv1d(x, wt, None, backend="triton")
    y.sum().backward()
    wr = wt.detach().clone().requires_grad_()
    yr, _ = causal_conv1d_reference(x, wr, None)
    yr.sum().backward()
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wt.grad, wr.grad, rtol=1e-5, atol=1e-5)


def test_no_grad_path_saves_nothing_and_matches():
    proj, w3, bi, st = make_inputs(1, 12, 16, 4, state=True)
    x = proj[..., 3:19].requires_grad_(False)
    with torch.no_grad():
        y, ns = causal_conv1d(x, w3[:, 0], bi, conv_state=st, backend="triton")
    assert y.grad_fn is None and ns.grad_fn is None
    yr, nsr = causal_conv1d_reference(x, w3[:, 0], bi, conv_state=st)
    torch.testing.assert_close(y, yr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ns, nsr)


def test_generation_step_equals_full_sequence():
    """Prefill then one token at a time with the returned state reproduces the full run (t == 1 steps)."""
    c, w = 16, 4
    proj, w3, bi, _ = make_inputs(1, 12, c, w)
    x = proj[..., 3:3 + c]
    full, _ = causal_conv1d(x, w3[:, 0], bi, backend="triton")
    y, st = causal_conv1d(x[:, :7], w3[:, 0], bi, backend="triton")
    parts = [y]
    for i in range(7, 12):
        y, st = causal_conv1d(x[:, i:i + 1], w3[:, 0], bi, conv_state=st, backend="triton")
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-6, atol=1e-6)


def test_bounds_checked_fwd_bwd():
    from bounds_check import bounds_checked

    proj, w3, bi, st = make_inputs(1, 19, 20, 4, state=True)
    with bounds_checked():
        run(causal_conv1d, proj, w3, bi, st, 20, backend="triton")
        run(causal_conv1d, proj, w3, bi, None, 20, cu_seqlens=torch.tensor([0, 2, 19]), backend="triton")


def test_backend_dispatch(monkeypatch):
    """causal_conv1d's backend goes through lm_kernels.backend.resolve_backend with LM_CONV1D_BACKEND."""
    x, w = torch.randn(1, 4, 8), torch.randn(8, 4)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.delenv("LM_CONV1D_BACKEND", raising=False)
    assert resolve_backend("conv1d", None, dev) == ("triton" if dev.type == "cuda" else "reference")
    assert resolve_backend("conv1d", None, dev, fits=False) == "reference"  # e.g. width > 8
    monkeypatch.setenv("LM_CONV1D_BACKEND", "triton")
    assert resolve_backend("conv1d", None, dev) == "triton"
    monkeypatch.setenv("LM_CONV1D_BACKEND", "cuda")
    with pytest.raises(ValueError, match="LM_CONV1D_BACKEND"):
        causal_conv1d(x, w)
    monkeypatch.delenv("LM_CONV1D_BACKEND")
    with pytest.raises(ValueError, match="backend"):
        causal_conv1d(x, w, backend="fast")


@pytest.mark.parametrize("kw,match", [
    (dict(weight=torch.randn(7, 4)), "weight"),
    (dict(weight=torch.randn(8, 9)), "widths"),
    (dict(bias=torch.randn(7)), "bias"),
    (dict(conv_state=torch.randn(1, 8, 2)), "conv_state"),
    (dict(activation="gelu"), "activation"),
    (dict(cu_seqlens=torch.tensor([[0, 4]])), "cu_seqlens"),
])
def test_bad_arguments_raise(kw, match):
    args = dict(weight=torch.randn(8, 4), bias=None)
    args.update(kw)
    x = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match=match):
        causal_conv1d(x, args.pop("weight"), args.pop("bias"), backend="triton", **args)


def test_float64_matches_naive_to_rounding():
    """float64 inputs accumulate in float64: outputs and every gradient equal the loop to ~1e-15."""
    proj, w3, bi, st = make_inputs(2, 19, 20, 3, state=True, dtype=torch.float64)
    ours = run(causal_conv1d, proj, w3, bi, st, 20, backend="triton")
    naive = run(causal_conv1d_naive, proj, w3, bi, st, 20)
    check(ours, naive, 1e-13)
