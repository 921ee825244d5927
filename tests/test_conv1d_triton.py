"""lm_kernels.conv1d: the Triton depthwise causal conv1d (under TRITON_INTERPRET=1 on CPU) against the PyTorch
reference and a float64 per-token loop, forward and every gradient (x, weight, bias, conv_state, and through the
returned conv state), at shapes crossing the interpreter's 8-row / 16-channel forward tiles and its backward's
32-channel blocks and 16-row chunks; packed documents shorter than the width; non-contiguous x; bf16 and fp32; the
second input x_add (conv of x + x_add, gradients of both); the one-pass backward across its 4-row loop steps and
its chunks (packed documents whose borders fall inside and at step / chunk borders, the conv state's gradient,
chunks that end inside a step); backend dispatch and argument errors."""
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
    xa = torch.randn(1, 19, 20)
    with bounds_checked():
        run(causal_conv1d, proj, w3, bi, st, 20, backend="triton")
        run(causal_conv1d, proj, w3, bi, None, 20, cu_seqlens=torch.tensor([0, 2, 19]), backend="triton")
        run_add(causal_conv1d, proj, xa, w3, bi, st, 20, backend="triton")


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
    (dict(x_add=torch.randn(1, 4, 7)), "x_add"),
    (dict(x_add=torch.randn(4, 8)), "x_add"),
    (dict(x_add=torch.randn(1, 4, 8, dtype=torch.float64)), "x_add"),
])
def test_bad_arguments_raise(kw, match):
    args = dict(weight=torch.randn(8, 4), bias=None)
    args.update(kw)
    x = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match=match):
        causal_conv1d(x, args.pop("weight"), args.pop("bias"), backend="triton", **args)


@pytest.mark.parametrize("x_add", [torch.randn(1, 4, 7), torch.randn(1, 1, 8), torch.randn(1, 4, 8).double()],
                         ids=["channels", "broadcast", "dtype"])
def test_x_add_checked_by_every_path(x_add):
    """x_add of another shape (also a broadcastable one) or dtype: ValueError from the reference and the loop too."""
    x, w = torch.randn(1, 4, 8), torch.randn(8, 4)
    for fn in (causal_conv1d_reference, causal_conv1d_naive):
        with pytest.raises(ValueError, match="x_add"):
            fn(x, w, x_add=x_add)


def test_float64_matches_naive_to_rounding():
    """float64 inputs accumulate in float64: outputs and every gradient equal the loop to ~1e-15."""
    proj, w3, bi, st = make_inputs(2, 19, 20, 3, state=True, dtype=torch.float64)
    ours = run(causal_conv1d, proj, w3, bi, st, 20, backend="triton")
    naive = run(causal_conv1d_naive, proj, w3, bi, st, 20)
    check(ours, naive, 1e-13)


# --- x_add: the conv of x + x_add without the sum -------------------------------------------------------------------
def run_add(fn, proj, xa, w3, bias, state, c, pad0=3, **kw):
    """run() with the second input: y, new state and the gradients of x, x_add, weight, bias, conv state for a loss
    on y and the new state. x is a split view of proj, x_add a split view of xa when xa is wider than c."""
    leaves = [v.detach().clone().requires_grad_() if v is not None else None for v in (proj, xa, w3, bias, state)]
    p, a, w3_, bi, st = leaves
    x = p[..., pad0: pad0 + c]
    x_add = a[..., a.shape[-1] - c:]
    y, ns = fn(x, w3_[:, 0, :], bi, x_add=x_add, conv_state=st, **kw)
    g = torch.Generator().manual_seed(1)
    gy = torch.randn(y.shape, generator=g).to(y.dtype)
    gs = torch.randn(ns.shape, generator=g).to(ns.dtype)
    ((y.double() * gy.double()).sum() + (ns.double() * gs.double()).sum()).backward()
    grads = [v.grad if v is not None else None for v in leaves]
    grads[0] = grads[0][..., pad0: pad0 + c]  # x's gradient (proj's pads get none)
    grads[1] = grads[1][..., a.shape[-1] - c:]
    return [y, ns] + grads


ADD_NAMES = ["y", "new_state", "dx", "dx_add", "dweight", "dbias", "dstate"]

ADD_SHAPES = [  # (b, t, c, w, bias, state, activation, cu_seqlens)
    (2, 21, 24, 4, True, True, "silu", None),
    (1, 37, 17, 3, False, False, "silu", None),      # odd c, t not a multiple of the 8-row tile
    (2, 9, 40, 2, True, True, None, None),
    (1, 2, 16, 4, True, True, "silu", None),         # t < w-1: the new state holds part of the old one
    (1, 29, 20, 4, True, False, "silu", [0, 3, 8, 9, 21, 29]),
    (1, 29, 19, 3, False, False, None, [0, 16, 17, 29]),
]


@pytest.mark.parametrize("b,t,c,w,bias,state,act,cu", ADD_SHAPES,
                         ids=[f"b{s[0]}t{s[1]}c{s[2]}w{s[3]}" + ("-bias" if s[4] else "") + ("-state" if s[5] else "")
                              + f"-{s[6]}" + ("-packed" if s[7] else "") for s in ADD_SHAPES])
def test_x_add_fp32_matches_reference_of_sum(b, t, c, w, bias, state, act, cu):
    """causal_conv1d(x, x_add=a) equals the reference and the float64 loop on x + a: outputs, the new state (of
    x + a), and the gradients of x, a (both d(x + a)), weight, bias and conv state."""
    proj, w3, bi, st = make_inputs(b, t, c, w, bias=bias, state=state)
    xa = torch.randn(b, t, c + 6, generator=torch.Generator().manual_seed(5))  # x_add a split view as well
    kw = dict(activation=act, cu_seqlens=torch.tensor(cu, dtype=torch.int32) if cu else None)
    ours = run_add(causal_conv1d, proj, xa, w3, bi, st, c, backend="triton", **kw)
    ref = run_add(causal_conv1d_reference, proj, xa, w3, bi, st, c, **kw)
    naive = run_add(causal_conv1d_naive, proj.double(), xa.double(), w3.double(), bi.double() if bias else None,
                    st.double() if state else None, c, **kw)
    check(ours, ref, 2e-6, ADD_NAMES)
    check(ours, naive, 2e-6, ADD_NAMES)
    torch.testing.assert_close(ours[2], ours[3], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_x_add_equals_conv_of_materialised_sum(dtype, packed):
    """The add happens in x's dtype as PyTorch's does (float32 sum rounded to x's dtype): our conv of (x, a) is
    bitwise our conv of the tensor x + a, forward, new state and every gradient. Not bf16 here: the interpreter
    truncates float32 -> bf16 casts where the GPU rounds to nearest even (tests/test_conv1d_gpu.py checks bf16)."""
    b, t, c, w = (1, 27, 24, 4) if packed else (2, 19, 24, 4)
    proj, w3, bi, st = make_inputs(b, t, c, w, state=not packed, dtype=dtype)
    xa = (3 * torch.randn(b, t, c, generator=torch.Generator().manual_seed(7))).to(dtype)
    kw = dict(cu_seqlens=torch.tensor([0, 5, 6, 16, 27]) if packed else None, backend="triton")
    ours = run_add(causal_conv1d, proj, xa, w3, bi, st, c, **kw)
    summed = proj.clone()
    summed[..., 3:3 + c] += xa
    plain = run(causal_conv1d, summed, w3, bi, st, c, **kw)
    plain = plain[:2] + [plain[2][..., 3:3 + c]] + plain[2:]  # dx is also d x_add
    plain[3] = plain[3][..., 3:3 + c]
    for name, a, r in zip(ADD_NAMES, ours, plain):
        if r is not None:
            assert a.dtype == r.dtype and torch.equal(a, r), name


def test_x_add_bf16_against_float64():
    """bf16 x and x_add: ours at least as close to the float64 truth (of the bf16 sum) as the bf16 reference. The
    new state is the bf16 sum itself, exact in the reference; the interpreter truncates the float32 sum to bf16
    where the GPU rounds it (bitwise equal there, tests/test_conv1d_gpu.py), so here it gets the 1e-2 bound only."""
    b, t, c, w = 2, 21, 24, 4
    proj, w3, bi, st = make_inputs(b, t, c, w, state=True, dtype=torch.bfloat16)
    xa = torch.randn(b, t, c, generator=torch.Generator().manual_seed(9)).bfloat16()
    ours = run_add(causal_conv1d, proj, xa, w3, bi, st, c, backend="triton")
    ref = run_add(causal_conv1d_reference, proj, xa, w3, bi, st, c)
    x_sum = proj[..., 3:3 + c] + xa  # the bf16 sum, as the conv input
    truth = run_add(causal_conv1d_naive, x_sum.double(), torch.zeros(b, t, c, dtype=torch.float64), w3.double(),
                    bi.double(), st.double(), c, pad0=0)
    truth[3] = truth[2]
    for name, a, r, tr in zip(ADD_NAMES, ours, ref, truth):
        assert a.dtype == r.dtype, name
        assert rel(a, tr) < 1e-2, f"{name}: {rel(a, tr):.2e}"
        if name != "new_state":
            assert rel(a, tr) <= 1.5 * rel(r, tr) + 1e-3, f"{name}: ours {rel(a, tr):.2e} vs reference {rel(r, tr):.2e}"


def test_x_add_gradients_are_separate_and_accumulate():
    """The autograd formula hands one tensor to x and x_add: two backward passes accumulate each gradient on its
    own (no shared .grad), also when x_add is x itself (gradient 2 dx) or only x_add requires grad."""
    c, w = 16, 4
    x = torch.randn(1, 13, c)
    a = torch.randn(1, 13, c)
    wt = torch.randn(c, w)
    gy = torch.randn(1, 13, c)
    xr, ar = x.clone().requires_grad_(), a.clone().requires_grad_()
    (causal_conv1d_reference(xr, wt, x_add=ar)[0] * gy).sum().backward()
    expect = xr.grad
    torch.testing.assert_close(ar.grad, expect)

    xl, al = x.clone().requires_grad_(), a.clone().requires_grad_()
    for _ in range(2):
        (causal_conv1d(xl, wt, x_add=al, backend="triton")[0] * gy).sum().backward()
    assert xl.grad is not al.grad and xl.grad.data_ptr() != al.grad.data_ptr()
    torch.testing.assert_close(xl.grad, 2 * expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(al.grad, 2 * expect, rtol=1e-5, atol=1e-5)

    only = a.clone().requires_grad_()
    (causal_conv1d(x, wt, x_add=only, backend="triton")[0] * gy).sum().backward()
    torch.testing.assert_close(only.grad, expect, rtol=1e-5, atol=1e-5)

    xs, xsr = x.clone().requires_grad_(), x.clone().requires_grad_()
    (causal_conv1d(xs, wt, x_add=xs, backend="triton")[0] * gy).sum().backward()
    (causal_conv1d_reference(xsr, wt, x_add=xsr)[0] * gy).sum().backward()
    torch.testing.assert_close(xs.grad, xsr.grad, rtol=1e-5, atol=1e-5)


def test_x_add_no_grad_and_generation_step():
    """No-grad forward with x_add equals the reference; a prefill then one-token steps with x_add reproduce the
    full run (t == 1 steps read the state written from x + x_add)."""
    c, w = 16, 4
    proj, w3, bi, st = make_inputs(1, 12, c, w, state=True)
    x, a = proj[..., 3:3 + c], torch.randn(1, 12, c)
    with torch.no_grad():
        y, ns = causal_conv1d(x, w3[:, 0], bi, x_add=a, conv_state=st, backend="triton")
    yr, nsr = causal_conv1d_reference(x, w3[:, 0], bi, x_add=a, conv_state=st)
    torch.testing.assert_close(y, yr, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ns, nsr)
    parts, s = [], st
    yp, s = causal_conv1d(x[:, :7], w3[:, 0], bi, x_add=a[:, :7], conv_state=s, backend="triton")
    parts.append(yp)
    for i in range(7, 12):
        yp, s = causal_conv1d(x[:, i:i + 1], w3[:, 0], bi, x_add=a[:, i:i + 1], conv_state=s, backend="triton")
        parts.append(yp)
    torch.testing.assert_close(torch.cat(parts, 1), y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, ns)


def test_x_add_opcheck():
    """torch.library.opcheck on both ops with x_add (schema, fakes, autograd registration, AOT dispatch)."""
    from torch.library import opcheck

    import lm_kernels.conv1d.triton_conv1d  # noqa: F401  (registers the ops)

    ops = torch.ops.lm
    proj, w3, bi, st = make_inputs(1, 20, 24, 4, state=True)
    x, a = proj[..., 3:27].detach(), torch.randn(1, 20, 24)
    leaves = [v.clone().requires_grad_() for v in (x, w3[:, 0], bi, st, a)]
    opcheck(ops.causal_conv1d_fwd.default, (*leaves[:4], None, True, leaves[4]))
    opcheck(ops.causal_conv1d_bwd.default, (torch.randn(1, 20, 24), torch.randn(1, 24, 3), x, w3[:, 0], bi, st, None,
                                            True, True, a))


# --- the one-pass backward across its loop steps and chunks ---------------------------------------------------------
# The interpreter's config: 16-row chunks (four 4-row loop steps per program); a program walks its rows forwards and
# W-1 past its last (the next chunk's first rows, whose g completes its last rows' dx). 40-row chunks span ten steps;
# 18-row chunks end inside a step (and so do the next chunk's first rows).
BORDER_CASES = [  # (t, w, state, cu_seqlens, x_add, activation)
    (53, 4, True, None, True, "silu"),                          # 4 chunks, the last partial; the state's gradient
    (48, 3, True, None, False, None),                           # t a multiple of the chunk
    (41, 2, False, None, True, None),
    (57, 4, False, [0, 8, 16, 19, 32, 45, 46, 57], False, "silu"),  # borders at tile / chunk starts, inside tiles
    (50, 3, False, [0, 7, 15, 17, 31, 33, 50], True, "silu"),   # borders one row before tile / chunk starts
    (40, 4, True, [0, 1, 2, 3, 24, 40], False, None),           # documents shorter than the width at the start
    (45, 8, True, None, True, "silu"),                          # the widest tap: 7 rows past the chunk
]


@pytest.mark.parametrize("chunk", [16, 18, 40])
@pytest.mark.parametrize("t,w,state,cu,add,act", BORDER_CASES,
                         ids=[f"t{s[0]}w{s[1]}" + ("-state" if s[2] else "") + ("-packed" if s[3] else "")
                              + ("-add" if s[4] else "") + f"-{s[5]}" for s in BORDER_CASES])
def test_one_pass_backward_crosses_steps_and_chunks(t, w, state, cu, add, act, chunk, monkeypatch):
    """float64 through the one-pass backward equals the float64 loop to rounding, every gradient, at lengths of
    several chunks."""
    from lm_kernels.conv1d import triton_conv1d as T

    monkeypatch.setattr(T, "_bwd_chunk", lambda *a: chunk)
    c = 20
    proj, w3, bi, st = make_inputs(1, t, c, w, state=state, dtype=torch.float64)
    kw = dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32) if cu else None, activation=act)
    if add:
        xa = torch.randn(1, t, c, dtype=torch.float64)
        ours = run_add(causal_conv1d, proj, xa, w3, bi, st, c, backend="triton", **kw)
        naive = run_add(causal_conv1d_naive, proj, xa, w3, bi, st, c, **kw)
        check(ours, naive, 1e-13, ADD_NAMES)
    else:
        ours = run(causal_conv1d, proj, w3, None, st, c, backend="triton", **kw)
        naive = run(causal_conv1d_naive, proj, w3, None, st, c, **kw)
        check(ours, naive, 1e-13)
