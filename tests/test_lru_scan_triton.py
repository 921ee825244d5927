"""Triton block_scan kernels (interpreter on CPU) against the PyTorch reference: forward, all gradients."""
import pytest
import torch

from lm_kernels.lru import block_scan, block_scan_reference, lru_lambda_blocks

pytest.importorskip("triton")
f64 = torch.float64
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_both(A, x, h0=None, cu=None, chunk=4, final=True, seed=1):
    """Outputs and grads of (A, x, h0) of both backends for the same random cotangents."""
    out = {}
    for backend in ("triton", "reference"):
        h, f = block_scan(A, x, initial_state=h0, cu_seqlens=cu, chunk_size=chunk, return_final_state=final,
                          backend=backend)
        g = torch.Generator().manual_seed(seed)
        loss = (h.double() * torch.randn(h.shape, generator=g, dtype=f64).to(DEV)).sum()
        if final:
            loss = loss + (f.double() * torch.randn(f.shape, generator=g, dtype=f64).to(DEV)).sum()
        ins = [v for v in (A, x, h0) if v is not None and v.requires_grad]
        out[backend] = (h, f, torch.autograd.grad(loss, ins))
    return out["triton"], out["reference"]


def inputs(b, t, nb, m, dtype=f64, h0=True, n0=None):
    A = ((0.6 / m ** 0.5) * torch.randn(b, t, nb, m, m, dtype=dtype, device=DEV)).requires_grad_()
    x = torch.randn(b, t, nb, m, dtype=dtype, device=DEV, requires_grad=True)
    s = torch.randn(n0 or b, nb, m, dtype=dtype, device=DEV, requires_grad=True) if h0 else None
    return A, x, s


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_triton_matches_reference_f64(m):
    A, x, h0 = inputs(2, 11, 3, m)
    tri, ref = run_both(A, x, h0)
    assert tri[0].dtype == f64 and tri[1].dtype == f64
    assert rel(tri[0], ref[0]) < 1e-12 and rel(tri[1], ref[1]) < 1e-12
    for gt, gr in zip(tri[2], ref[2]):
        assert rel(gt, gr) < 1e-12


@pytest.mark.parametrize("t,chunk", [(1, 4), (9, 16), (12, 4)])
def test_triton_lengths_no_initial_state(t, chunk):
    A, x, _ = inputs(1, t, 2, 2, h0=False)
    tri, ref = run_both(A, x, None, chunk=chunk)
    assert rel(tri[0], ref[0]) < 1e-12 and rel(tri[1], ref[1]) < 1e-12
    for gt, gr in zip(tri[2], ref[2]):
        assert rel(gt, gr) < 1e-12


@pytest.mark.parametrize("with_h0", [False, True])
def test_triton_varlen(with_h0):
    lens = [4, 0, 6, 2, 3]  # starts on chunk edges (4, 12) and inside chunks, one empty document
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    A, x, h0 = inputs(1, sum(lens), 2, 3, h0=with_h0, n0=len(lens))
    tri, ref = run_both(A, x, h0, cu=cu, chunk=4)
    assert rel(tri[0], ref[0]) < 1e-12 and rel(tri[1], ref[1]) < 1e-12
    for gt, gr in zip(tri[2], ref[2]):
        assert rel(gt, gr) < 1e-12


def test_triton_stride0_A_and_only_h_used():
    nb = 3
    nu = torch.randn(nb, dtype=f64, device=DEV, requires_grad=True)
    th = torch.randn(nb, dtype=f64, device=DEV, requires_grad=True)
    x = torch.randn(2, 10, nb, 2, dtype=f64, device=DEV, requires_grad=True)
    res = []
    for backend in ("triton", "reference"):
        A = lru_lambda_blocks(nu, th).expand(2, 10, nb, 2, 2)
        h, f = block_scan(A, x, chunk_size=4, backend=backend)
        assert f is None
        res.append((h, torch.autograd.grad((h * h).sum(), (nu, th, x))))
    assert rel(res[0][0], res[1][0]) < 1e-12
    for gt, gr in zip(res[0][1], res[1][1]):
        assert rel(gt, gr) < 1e-12


def test_triton_final_state_only_grad():
    A, x, h0 = inputs(2, 7, 2, 2)
    res = []
    for backend in ("triton", "reference"):
        _, f = block_scan(A, x, initial_state=h0, chunk_size=4, return_final_state=True, backend=backend)
        res.append((f, torch.autograd.grad(f.sum(), (A, x, h0))))
    assert rel(res[0][0], res[1][0]) < 1e-12
    for gt, gr in zip(res[0][1], res[1][1]):
        assert rel(gt, gr) < 1e-12


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_low_precision(dtype, tol):
    A, x, h0 = inputs(2, 9, 2, 3, dtype=f64)
    Al, xl, h0l = (v.detach().to(dtype).requires_grad_() for v in (A, x, h0))
    tri = block_scan(Al, xl, initial_state=h0l, chunk_size=4, return_final_state=True, backend="triton")
    assert tri[0].dtype == dtype and tri[1].dtype == torch.float32
    ref = block_scan_reference(Al.detach().double(), xl.detach().double(), initial_state=h0l.detach().double(),
                               chunk_size=4, return_final_state=True)
    assert rel(tri[0], ref[0]) < tol and rel(tri[1], ref[1]) < tol
    gt = torch.autograd.grad(tri[0].float().sum() + tri[1].sum(), (Al, xl, h0l))
    Ad, xd, hd = (v.detach().double().requires_grad_() for v in (Al, xl, h0l))
    r2 = block_scan_reference(Ad, xd, initial_state=hd, chunk_size=4, return_final_state=True)
    gr = torch.autograd.grad(r2[0].sum() + r2[1].sum(), (Ad, xd, hd))
    for a, b, v in zip(gt, gr, (Al, xl, h0l)):
        assert a.dtype == v.dtype and rel(a, b) < tol


def test_triton_no_grad_path():
    A, x, h0 = inputs(1, 6, 2, 2)
    with torch.no_grad():
        h, f = block_scan(A, x, initial_state=h0, chunk_size=4, return_final_state=True, backend="triton")
    assert not h.requires_grad and f is not None
    hr, fr = block_scan_reference(A.detach(), x.detach(), initial_state=h0.detach(), chunk_size=4,
                                  return_final_state=True)
    assert rel(h, hr) < 1e-12 and rel(f, fr) < 1e-12


def test_triton_strided_inputs_and_small_tiles(monkeypatch):
    """Non-row-major A (a transposed view), a strided x, and several programs over the blocks (BN < nb)."""
    from lm_kernels.lru import triton_scan
    monkeypatch.setitem(triton_scan.CONFIG_OVERRIDE, 3, (2, 1, 1))
    base = ((0.6 / 3 ** 0.5) * torch.randn(2, 9, 5, 3, 3, dtype=f64, device=DEV))
    A = base.transpose(-1, -2).requires_grad_()  # sAi = 1, sAj = 3
    xb = torch.randn(2, 9, 5, 6, dtype=f64, device=DEV)
    x = xb[..., ::2].requires_grad_()  # last-dim stride 2
    h0 = torch.randn(2, 5, 3, dtype=f64, device=DEV, requires_grad=True)
    tri, ref = run_both(A, x, h0)
    assert rel(tri[0], ref[0]) < 1e-12 and rel(tri[1], ref[1]) < 1e-12
    for gt, gr in zip(tri[2], ref[2]):
        assert rel(gt, gr) < 1e-12
