"""lm_kernels.conv1d on a GPU (compiled Triton, autotuned): real shapes (Mamba2-350M's conv: b 8, t 2048,
c 2304, w 4, bf16, x a split view of the 4384-wide projection) against the float64 truth, forward and
backward, with the bf16 PyTorch path's error as the yardstick; conv state and packed documents at long
length; odd shapes crossing the tuned tiles; determinism; a tiny Mamba2 on CUDA against the reference; the
second input x_add (bitwise the conv of the materialised bf16 sum); the one-pass backward at T4096."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from lm_kernels.conv1d import causal_conv1d, causal_conv1d_reference  # noqa: E402


def inputs(b, t, c, w, *, width=None, off=0, bias=True, state=False, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = width or c
    proj = torch.randn(b, t, width, generator=g).to("cuda", dtype)
    wt = (torch.randn(c, w, generator=g) / w ** 0.5).to("cuda", dtype)
    bi = torch.randn(c, generator=g).to("cuda", dtype) if bias else None
    st = torch.randn(b, c, w - 1, generator=g).to("cuda", dtype) if state else None
    gy = torch.randn(b, t, c, generator=g).to("cuda", dtype)
    return proj[..., off:off + c], wt, bi, st, gy


def fwd_bwd(f, x, wt, bi, st, gy, cu=None, cast=None):
    leaves = [v.detach().to(cast or v.dtype).requires_grad_() if v is not None else None for v in (x, wt, bi, st)]
    y, ns = f(leaves[0], leaves[1], leaves[2], conv_state=leaves[3], cu_seqlens=cu)
    req = [v for v in leaves if v is not None]
    grads = torch.autograd.grad(y, req, gy.to(y.dtype))
    it = iter(grads)
    return [y, ns] + [next(it) if v is not None else None for v in leaves]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


NAMES = ["y", "new_state", "dx", "dweight", "dbias", "dstate"]


def compare_bf16(ours, ref_bf16, truth, tol=1e-2, names=NAMES):
    for name, a, r, tr in zip(names, ours, ref_bf16, truth):
        if tr is None:
            continue
        ea, er = rel(a, tr), rel(r, tr)
        assert ea < tol, f"{name}: ours {ea:.2e}"
        assert ea <= 1.5 * er + 1e-3, f"{name}: ours {ea:.2e} vs the bf16 PyTorch path {er:.2e}"


@pytest.mark.parametrize("state", [False, True])
def test_mamba2_350m_shape_bf16(state):
    x, wt, bi, st, gy = inputs(8, 2048, 2304, 4, width=4384, off=2048, state=state)
    assert x.stride(1) == 4384
    ours = fwd_bwd(lambda *a, **k: causal_conv1d(*a, **k, backend="triton"), x, wt, bi, st, gy)
    ref = fwd_bwd(causal_conv1d_reference, x, wt, bi, st, gy)
    truth = fwd_bwd(causal_conv1d_reference, x, wt, bi, st, gy, cast=torch.float64)
    assert ours[0].is_contiguous() and ours[0].dtype == torch.bfloat16
    compare_bf16(ours, ref, truth)


def test_fp32_real_shape_tight():
    x, wt, bi, st, gy = inputs(8, 2048, 2304, 4, width=4384, off=2048, state=True, dtype=torch.float32)
    ours = fwd_bwd(lambda *a, **k: causal_conv1d(*a, **k, backend="triton"), x, wt, bi, st, gy)
    truth = fwd_bwd(causal_conv1d_reference, x, wt, bi, st, gy, cast=torch.float64)
    for name, a, tr in zip(NAMES, ours, truth):
        assert rel(a, tr) < 1e-5, f"{name}: {rel(a, tr):.2e}"


def test_packed_long_bf16():
    t = 16384
    x, wt, bi, _, gy = inputs(1, t, 2304, 4, width=4384, off=2048)
    g = torch.Generator().manual_seed(3)
    cuts = torch.randperm(t - 1, generator=g)[:40].add(1).sort().values
    cu = torch.cat([torch.tensor([0, 1, 2]), cuts[cuts > 2], torch.tensor([t])]).to("cuda", torch.int32)
    ours = fwd_bwd(lambda *a, **k: causal_conv1d(*a, **k, backend="triton"), x, wt, bi, None, gy, cu)
    ref = fwd_bwd(causal_conv1d_reference, x, wt, bi, None, gy, cu)
    truth = fwd_bwd(causal_conv1d_reference, x, wt, bi, None, gy, cu, cast=torch.float64)
    compare_bf16(ours, ref, truth)


@pytest.mark.parametrize("b,t,c,w,bias,state,act", [
    (3, 1000, 1000, 4, True, True, "silu"),
    (2, 333, 5120, 4, False, False, "silu"),
    (1, 77, 96, 3, True, True, None),
    (2, 130, 260, 2, True, False, "silu"),
    (1, 2, 64, 4, True, True, "silu"),
])
def test_odd_shapes_fp32(b, t, c, w, bias, state, act):
    x, wt, bi, st, gy = inputs(b, t, c, w, width=c + 24, off=8, bias=bias, state=state, dtype=torch.float32)
    f = lambda *a, **k: causal_conv1d(*a, **k, activation=act, backend="triton")  # noqa: E731
    r = lambda *a, **k: causal_conv1d_reference(*a, **k, activation=act)  # noqa: E731
    ours = fwd_bwd(f, x, wt, bi, st, gy)
    truth = fwd_bwd(r, x, wt, bi, st, gy, cast=torch.float64)
    for name, a, tr in zip(NAMES, ours, truth):
        if tr is not None:
            assert rel(a, tr) < 1e-5, f"{name}: {rel(a, tr):.2e}"


def test_deterministic():
    x, wt, bi, st, gy = inputs(8, 2048, 2304, 4, width=4384, off=2048, state=True)
    f = lambda *a, **k: causal_conv1d(*a, **k, backend="triton")  # noqa: E731
    a, b = fwd_bwd(f, x, wt, bi, st, gy), fwd_bwd(f, x, wt, bi, st, gy)
    for name, u, v in zip(NAMES, a, b):
        assert torch.equal(u, v), name


def test_no_grad_equals_grad_forward():
    x, wt, bi, st, _ = inputs(8, 2048, 2304, 4, width=4384, off=2048, state=True)
    with torch.no_grad():
        y0, s0 = causal_conv1d(x, wt, bi, conv_state=st, backend="triton")
    y1, s1 = causal_conv1d(x, wt.requires_grad_(), bi, conv_state=st, backend="triton")
    assert torch.equal(y0, y1) and torch.equal(s0, s1)


def test_tiny_mamba2_cuda_triton_equals_reference(monkeypatch):
    import lm  # noqa: F401
    from lm.models import LMMamba2Config
    from lm.models.mamba2 import LMMamba2ForCausalLM

    torch.manual_seed(0)
    cfg = LMMamba2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, d_state=16, headdim=16, chunk_size=32)
    model = LMMamba2ForCausalLM(cfg).cuda()
    ids = torch.randint(0, 64, (2, 96), device="cuda")
    out = {}
    for backend in ("triton", "reference"):
        monkeypatch.setenv("LM_CONV1D_BACKEND", backend)
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        out[backend] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert abs(out["triton"][0] - out["reference"][0]) < 1e-5
    for n, g in out["reference"][1].items():
        assert rel(out["triton"][1][n], g) < 1e-4, n


def fwd_bwd_add(f, x, xa, wt, bi, st, gy, cu=None, cast=None):
    """fwd_bwd with x_add: [y, new state, dx, dx_add, dweight, dbias, dstate]."""
    leaves = [v.detach().to(cast or v.dtype).requires_grad_() if v is not None else None
              for v in (x, xa, wt, bi, st)]
    y, ns = f(leaves[0], leaves[2], leaves[3], x_add=leaves[1], conv_state=leaves[4], cu_seqlens=cu)
    req = [v for v in leaves if v is not None]
    grads = iter(torch.autograd.grad(y, req, gy.to(y.dtype)))
    return [y, ns] + [next(grads) if v is not None else None for v in leaves]


ADD_NAMES = ["y", "new_state", "dx", "dx_add", "dweight", "dbias", "dstate"]


@pytest.mark.parametrize("state", [False, True])
def test_x_add_mamba2_shape_bf16(state):
    """The implicit Mamba2's conv input x + injection at the Mamba2-350M shape (both split views of 4384-wide
    tensors): against the float64 truth of the bf16 sum with the bf16 reference as the yardstick, and bitwise our conv
    of the materialised bf16 sum (y, new state, dx: the kernel rounds the float32 sum to nearest even as PyTorch)."""
    x, wt, bi, st, gy = inputs(8, 2048, 2304, 4, width=4384, off=2048, state=state)
    xa = torch.randn(8, 2048, 4384, generator=torch.Generator().manual_seed(11)).to("cuda", torch.bfloat16)
    xa = xa[..., 2048:2048 + 2304]
    ours = fwd_bwd_add(lambda *a, **k: causal_conv1d(*a, **k, backend="triton"), x, xa, wt, bi, st, gy)
    ref = fwd_bwd_add(causal_conv1d_reference, x, xa, wt, bi, st, gy)
    s = x + xa
    truth = fwd_bwd(causal_conv1d_reference, s, wt, bi, st, gy, cast=torch.float64)
    truth = truth[:3] + [truth[2]] + truth[3:]
    compare_bf16(ours, ref, truth, names=ADD_NAMES)
    plain = fwd_bwd(lambda *a, **k: causal_conv1d(*a, **k, backend="triton"), s, wt, bi, st, gy)
    for name, a, b in zip(["y", "new_state", "dx"], ours, plain):
        assert torch.equal(a, b), name
    assert torch.equal(ours[3], plain[2]), "dx_add"
    for name, a, b in zip(ADD_NAMES[4:], ours[4:], plain[3:]):  # summation order may follow the tuned tile
        if b is not None:
            assert rel(a, b) < 1e-5, f"{name}: {rel(a, b):.2e}"


@pytest.mark.parametrize("packed", [False, True])
def test_one_pass_backward_t4096_against_float64(packed):
    """The one-pass backward at B2 T4096 C2304 W4 bf16 (several chunks per sequence): every gradient against the
    float64 truth, the bf16 PyTorch path as the yardstick; with a conv state, or packed documents (the same offsets
    for both batch rows, as the reference applies them) with borders at and inside tiles."""
    t = 4096
    x, wt, bi, st, gy = inputs(2, t, 2304, 4, width=4384, off=2048, state=not packed)
    cu = None
    if packed:
        g = torch.Generator().manual_seed(5)
        cuts = torch.randperm(t - 1, generator=g)[:30].add(1).sort().values
        cu = torch.cat([torch.tensor([0, 1, 3, 8, 16, 64, 65]), cuts[cuts > 65],
                        torch.tensor([t])]).to("cuda", torch.int32)
    ours = fwd_bwd(lambda *a, **k: causal_conv1d(*a, **k, backend="triton"), x, wt, bi, st, gy, cu)
    ref = fwd_bwd(causal_conv1d_reference, x, wt, bi, st, gy, cu)
    truth = fwd_bwd(causal_conv1d_reference, x, wt, bi, st, gy, cu, cast=torch.float64)
    compare_bf16(ours, ref, truth)
