"""block_scan Triton kernels on a CUDA GPU: bf16 / float32 against the float64 reference."""
import pytest
import torch

from lm_kernels.lru import block_scan, block_scan_reference, lru_lambda_blocks

pytestmark = pytest.mark.gpu


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def bdlru_inputs(b, t, nb, m, dtype, n0=None):
    g = torch.softmax(2 * torch.randn(b, t, nb, m, m + 1, device="cuda"), -1)
    A = g[..., :m].to(dtype)
    x = (g[..., m] * torch.randn(b, t, nb, m, device="cuda")).to(dtype)
    h0 = torch.randn(n0 or b, nb, m, device="cuda")
    return A, x, h0


def check(A, x, h0, cu, tol, chunk=64):
    leaves = [v.detach().clone().requires_grad_() for v in (A, x, h0)]
    h, f = block_scan(*leaves[:2], initial_state=leaves[2], cu_seqlens=cu, chunk_size=chunk,
                      return_final_state=True, backend="triton")
    dh = torch.randn_like(h, dtype=torch.float32)
    df = torch.randn_like(f)
    gt = torch.autograd.grad((h.float() * dh).sum() + (f * df).sum(), leaves)
    ref_leaves = [v.detach().double().requires_grad_() for v in leaves]
    hr, fr = block_scan_reference(*ref_leaves[:2], initial_state=ref_leaves[2], cu_seqlens=cu, chunk_size=chunk,
                                  return_final_state=True)
    gr = torch.autograd.grad((hr * dh.double()).sum() + (fr * df.double()).sum(), ref_leaves)
    errs = [rel(h, hr), rel(f, fr)] + [rel(a, b) for a, b in zip(gt, gr)]
    assert h.dtype == x.dtype and f.dtype == torch.float32
    assert all(e < tol for e in errs), errs
    for a, v in zip(gt, leaves):
        assert a.dtype == v.dtype and torch.isfinite(a).all()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_gpu_bdlru_vs_f64(m, dtype, tol):
    A, x, h0 = bdlru_inputs(2, 333, 40, m, dtype)
    check(A, x, h0, None, tol)


def test_gpu_varlen_bf16():
    lens = [100, 0, 64, 1, 250, 97]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    A, x, h0 = bdlru_inputs(1, sum(lens), 24, 4, torch.bfloat16, n0=len(lens))
    check(A, x, h0, cu, 1e-2)


def test_gpu_stride0_lru_bf16():
    nb = 64
    nu = torch.randn(nb, device="cuda") - 2
    th = torch.randn(nb, device="cuda")
    A = lru_lambda_blocks(nu, th).to(torch.bfloat16).expand(2, 500, nb, 2, 2)
    x = torch.randn(2, 500, nb, 2, device="cuda", dtype=torch.bfloat16)
    h, _ = block_scan(A, x, backend="triton")
    hr, _ = block_scan_reference(A.double(), x.double())
    assert rel(h, hr) < 1e-2


def test_gpu_large_offsets_no_overflow():
    """More than 2**31 elements of A: 64-bit offsets (checked on the last tokens only)."""
    free = torch.cuda.mem_get_info()[0]
    if free < 12 * 2 ** 30:
        pytest.skip("needs ~12 GiB free")
    b, t, nb, m = 2, 4096, 16384, 4  # A: 2**31 elements of bf16 = 4 GiB
    A = torch.full((b, t, nb, m, m), 0.2, dtype=torch.bfloat16, device="cuda")
    x = torch.ones(b, t, nb, m, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        h, f = block_scan(A, x, backend="triton", return_final_state=True)
    # rows sum to 0.8: the state converges to 1 / (1 - 0.8) = 5 in every entry
    assert torch.allclose(f, torch.full_like(f, 5.0), rtol=2e-2)
    assert torch.allclose(h[-1, -1].float(), torch.full((nb, m), 5.0, device="cuda"), rtol=2e-2)
