"""SSD Triton kernels on a GPU at real shapes vs the float64 PyTorch reference (and mamba_ssm if present)."""
import pytest
import torch

from lm_kernels.ssd import ssd_scan

pytestmark = pytest.mark.gpu

F64 = torch.float64


def make(b, t, h, p, g, n, *, ns=None, z=True, init=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0, shift=0.0):
        return (torch.randn(*s, generator=gen) * scale + shift).cuda()

    d = dict(x=r(b, t, h, p), dt=r(b, t, h, scale=0.5), A=-torch.exp(r(h, scale=0.5)), B=r(b, t, g, n),
             C=r(b, t, g, n), D=r(h), dt_bias=r(h, scale=0.5, shift=-2.0))
    if z:
        d["z"] = r(b, t, h, p)
    if init:
        d["initial_state"] = r(b if ns is None else ns, h, p, n, scale=0.3)
    return d


LOW = ("x", "dt", "B", "C", "z")  # activations: cast to the tested dtype; parameters/states stay float32


def run(backend, d, dtype, **kw):
    dd = {k: (v.to(dtype) if k in LOW else (v.double() if dtype == F64 else v)).detach().requires_grad_()
          for k, v in d.items()}
    y, f = ssd_scan(**dd, return_final_state=True, backend=backend, **kw)
    gen = torch.Generator().manual_seed(7)
    gy = torch.randn(y.shape, generator=gen).cuda().to(y.dtype)
    gf = torch.randn(f.shape, generator=gen).cuda().to(f.dtype)
    ((y.float() * gy.float()).sum() + (f * gf).sum()).backward()
    return y, f, {k: v.grad for k, v in dd.items()}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


REDUCED = ("dA", "ddt_bias")  # sums over every token with cancellation: low-precision error grows with length


def check(d, dtype, tol, **kw):
    yt, ft, gt = run("triton", d, dtype, **kw)
    yr, fr, gr = run("reference", d, F64, **kw)
    errs = {"y": rel(yt, yr), "final": rel(ft, fr), **{f"d{k}": rel(gt[k], gr[k]) for k in gr}}
    print(dtype, {k: f"{v:.1e}" for k, v in errs.items()})
    lim = {k: (tol * 5 if k in REDUCED and dtype != torch.float32 else tol) for k in errs}
    bad = {k: v for k, v in errs.items() if not v < lim[k]}
    assert not bad, f"{dtype}: errors above {tol}: {bad}"


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 1e-2), (torch.float32, 5e-3)])
def test_gpu_real_shape_vs_float64_reference(dtype, tol):
    # 1100 tokens: not a multiple of the chunk; 2 groups of 8 heads; all options on
    check(make(2, 1100, 16, 64, 2, 128), dtype, tol, chunk_size=256, dt_limit=(0.0, 4.0))


@pytest.mark.parametrize("chunk", [64, 128])
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_smaller_chunks_bf16(chunk, packed):
    # the model's chunk_size at 64 / 128 (one / two row blocks per chunk): the same function of the inputs
    if packed:
        lens = [300, 0, 513, 1, 211]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        check(make(1, sum(lens), 8, 64, 1, 128, ns=len(lens)), torch.bfloat16, 3e-2, chunk_size=chunk, cu_seqlens=cu)
    else:
        check(make(2, 1100, 16, 64, 2, 128), torch.bfloat16, 3e-2, chunk_size=chunk, dt_limit=(0.0, 4.0))


@pytest.mark.parametrize("packed", [False, True])
def test_gpu_xbc_input_equals_separate_views(packed):
    """ssd_scan_xbc (x | B | C as one tensor, one gradient written by the kernels) is bit-equal to ssd_scan on views of
    it, forward and backward, at Mamba2-350M's layer widths (bf16, chunk 128)."""
    from lm_kernels.ssd import ssd_scan_xbc
    h, p, g, n = 32, 64, 1, 128
    lens = [700, 0, 1100, 248] if packed else None
    b, t = (1, sum(lens)) if packed else (2, 1024)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda") if packed else None
    gen = torch.Generator().manual_seed(5)
    base = (torch.randn(b, t, h * p + 2 * g * n, generator=gen) * 0.5).cuda().bfloat16()
    dt = torch.randn(b, t, h, generator=gen).cuda().bfloat16()
    A, D, bias = -torch.rand(h, generator=gen).cuda() - 0.5, torch.randn(h, generator=gen).cuda(), torch.zeros(h).cuda()
    gy = torch.randn(b, t, h, p, generator=gen).cuda().bfloat16()
    outs = []
    for fused in (True, False):
        xbc, dtl = base.clone().requires_grad_(), dt.clone().requires_grad_()
        kw = dict(chunk_size=128, D=D, dt_bias=bias, cu_seqlens=cu)
        if fused:
            y, _ = ssd_scan_xbc(xbc, dtl, A, headdim=p, ngroups=g, dstate=n, **kw)
        else:
            x, B, C = xbc.split([h * p, g * n, g * n], -1)
            y, _ = ssd_scan(x.unflatten(-1, (h, p)), dtl, A, B.unflatten(-1, (g, n)), C.unflatten(-1, (g, n)), **kw)
        (y.float() * gy.float()).sum().backward()
        outs.append((y, xbc.grad, dtl.grad))
    for a, r in zip(*outs):
        assert torch.equal(a, r)


def test_gpu_float32_highest_precision():
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        check(make(1, 700, 4, 64, 1, 128), torch.float32, 1e-4, chunk_size=128)
    finally:
        torch.set_float32_matmul_precision(prev)


def test_gpu_varlen_vs_reference():
    lens = [300, 0, 513, 1, 211]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    check(make(1, sum(lens), 8, 64, 1, 128, ns=len(lens)), torch.bfloat16, 3e-2, chunk_size=256, cu_seqlens=cu)


def test_gpu_nograd_equals_grad_path_and_headdim_128():
    d = make(1, 600, 4, 128, 1, 64, z=False, init=False)
    x = {k: (v.bfloat16() if k in LOW else v) for k, v in d.items()}
    with torch.no_grad():
        y0, _ = ssd_scan(**x, chunk_size=256, backend="triton")
    xg = {k: v.clone().requires_grad_() for k, v in x.items()}
    y1, _ = ssd_scan(**xg, chunk_size=256, backend="triton")
    assert torch.equal(y0, y1.detach())
    yr, _ = ssd_scan(**{k: v.double() for k, v in d.items()}, chunk_size=256, backend="reference")
    assert rel(y0, yr) < 3e-2


def test_gpu_accuracy_parity_with_mamba_ssm_if_available():
    """bf16: our forward and every gradient are about as close to float64 as mamba_ssm's."""
    mc = pytest.importorskip("mamba_ssm.ops.triton.ssd_combined")
    d = make(2, 2048, 16, 64, 1, 128, z=False, init=False)
    gy = torch.randn(2, 2048, 16, 64, generator=torch.Generator().manual_seed(3)).cuda()

    def grads(fn, dtype):
        xx = {k: (v.to(dtype) if k in LOW else (v.double() if dtype == F64 else v)).detach().requires_grad_()
              for k, v in d.items()}
        y = fn(xx)
        (y.double() * gy.double()).sum().backward()
        return {"y": y.detach(), **{f"d{k}": v.grad for k, v in xx.items()}}

    ours = grads(lambda a: ssd_scan(**a, chunk_size=256, backend="triton")[0], torch.bfloat16)
    theirs = grads(lambda a: mc.mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 256, D=a["D"],
                                                          dt_bias=a["dt_bias"], dt_softplus=True), torch.bfloat16)
    ref = grads(lambda a: ssd_scan(**a, chunk_size=256, backend="reference")[0], F64)
    errs = {k: (rel(ours[k], ref[k]), rel(theirs[k], ref[k])) for k in ref}
    print("vs float64 (ours, mamba_ssm):", {k: f"{a:.1e}/{b:.1e}" for k, (a, b) in errs.items()})
    bad = {k: v for k, v in errs.items() if not v[0] < 2 * v[1] + 2e-3}
    assert not bad, f"less accurate than mamba_ssm: {bad}"


def test_gpu_repeat_calls_and_strided_inputs():
    """bf16: a repeated call (launched through launch's kept config) gives the same output and gradients as the
    first; x, B and C as strided views (same shapes, other strides) give the same output."""
    d = make(2, 1100, 16, 64, 2, 128)
    kw = dict(chunk_size=256, dt_limit=(0.0, 4.0))
    y0, f0, g0 = run("triton", d, torch.bfloat16, **kw)
    y1, f1, g1 = run("triton", d, torch.bfloat16, **kw)
    assert torch.equal(y0, y1) and torch.equal(f0, f1) and all(torch.equal(g0[k], g1[k]) for k in g0)
    xs = {k: (v.bfloat16() if k in LOW else v) for k, v in d.items()}
    wide = {k: torch.cat([xs[k], torch.zeros_like(xs[k])], -1)[..., :xs[k].shape[-1]] for k in ("x", "B", "C")}
    assert wide["x"].stride() != xs["x"].stride()
    with torch.no_grad():
        ya, _ = ssd_scan(**xs, **kw, backend="triton")
        yb, _ = ssd_scan(**{**xs, **wide}, **kw, backend="triton")
    assert rel(yb, ya) < 1e-5, rel(yb, ya)


@pytest.mark.parametrize("b", [1, 4])
def test_gpu_decode_step_vs_reference(b):
    """The one-kernel decode step (step.py) at Mamba2-350M's shapes (32 heads of 64, d_state 128, bf16 activations)
    against the float64 PyTorch step, three steps chained with the state updated in place (out_state=state, as the
    static decode cache does), x / B / C as strided views of one conv output; auto picks the kernel on CUDA."""
    from lm_kernels.ssd import ssd_step, ssd_step_reference
    h, p, g, n = 32, 64, 1, 128
    gen = torch.Generator().manual_seed(b)
    r = lambda *s: torch.randn(*s, generator=gen).cuda()  # noqa: E731
    A, D, dt_bias = -torch.exp(r(h) * 0.5), r(h), r(h) * 0.5 - 2.0
    state = r(b, h, p, n) * 0.3
    ref = state.double()
    for _ in range(3):
        xbc = r(b, h * p + 2 * g * n).bfloat16()
        x, B, C = xbc.split([h * p, g * n, g * n], dim=-1)
        x, B, C = x.view(b, h, p), B.view(b, g, n), C.view(b, g, n)
        dt = (r(b, h) * 0.5).bfloat16()
        kw = dict(D=D, dt_bias=dt_bias, dt_limit=(0.0, 4.0))
        y_ref, ref = ssd_step_reference(ref, x.double(), dt.double(), A.double(), B.double(), C.double(),
                                        **{**kw, "D": D.double(), "dt_bias": dt_bias.double()})
        with torch.no_grad():
            y, s = ssd_step(state, x, dt, A, B, C, out_state=state, **kw)
        assert s is state and y.dtype == torch.bfloat16
        assert rel(y, y_ref) < 1e-2, rel(y, y_ref)
        assert rel(state, ref) < 1e-5, rel(state, ref)
