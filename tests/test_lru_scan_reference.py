"""block_scan reference (chunked PyTorch scan) against the sequential definition, and the helpers."""
import pytest
import torch

from lm_kernels.lru import (block_scan, block_scan_naive, block_scan_reference, block_scan_step, companion,
                            lru_lambda_blocks)

f64 = torch.float64


def rand_inputs(b, t, nb, m, scale=0.6, dtype=f64, requires_grad=True):
    A = (scale / m ** 0.5) * torch.randn(b, t, nb, m, m, dtype=dtype)
    x = torch.randn(b, t, nb, m, dtype=dtype)
    return A.requires_grad_(requires_grad), x.requires_grad_(requires_grad)


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = 0
    for o in out:
        if o is not None:
            loss = loss + (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum()
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
def test_reference_matches_naive_f64(m):
    A, x = rand_inputs(2, 37, 3, m)
    h0 = torch.randn(2, 3, m, dtype=f64, requires_grad=True)
    ref = block_scan_reference(A, x, initial_state=h0, chunk_size=8, return_final_state=True)
    nav = block_scan_naive(A, x, initial_state=h0, return_final_state=True)
    assert ref[0].dtype == f64 and ref[1].dtype == f64
    assert rel(ref[0], nav[0]) < 1e-10 and rel(ref[1], nav[1]) < 1e-10
    assert torch.equal(ref[1], ref[0][:, -1])
    for gr, gn in zip(grads(ref, (A, x, h0)), grads(nav, (A, x, h0))):
        assert rel(gr, gn) < 1e-10


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_reference_chunk_sizes(chunk):
    A, x = rand_inputs(1, 21, 2, 3, requires_grad=False)
    ref, _ = block_scan_reference(A, x, chunk_size=chunk)
    nav, _ = block_scan_naive(A, x)
    assert rel(ref, nav) < 1e-12


def test_no_initial_state_and_return_flag():
    A, x = rand_inputs(2, 10, 2, 2, requires_grad=False)
    h, fin = block_scan(A, x, backend="reference")
    assert fin is None and h.shape == x.shape and h.dtype == x.dtype
    h2, fin2 = block_scan(A, x, backend="reference", return_final_state=True)
    assert torch.equal(h, h2) and fin2.shape == (2, 2, 2)


def test_float32_and_bf16_dtypes():
    A, x = rand_inputs(1, 12, 2, 2, dtype=torch.float32, requires_grad=False)
    h, fin = block_scan_reference(A.bfloat16(), x.bfloat16(), return_final_state=True)
    assert h.dtype == torch.bfloat16 and fin.dtype == torch.float32
    ref, _ = block_scan_naive(A.double(), x.double())
    assert rel(h.double(), ref) < 1e-2


@pytest.mark.parametrize("with_h0", [False, True])
def test_varlen_packed_equals_separate(with_h0):
    m, nb = 3, 2
    lens = [7, 0, 12, 1, 9]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    A, x = rand_inputs(1, sum(lens), nb, m)
    h0 = torch.randn(len(lens), nb, m, dtype=f64, requires_grad=True) if with_h0 else None
    out = block_scan_reference(A, x, initial_state=h0, cu_seqlens=cu, chunk_size=4, return_final_state=True)
    sep_h, sep_f = [], []
    for k, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e > s:
            hk, fk = block_scan_naive(A[:, s:e], x[:, s:e], return_final_state=True,
                                      initial_state=None if h0 is None else h0[k:k + 1])
            sep_h.append(hk)
        else:
            fk = h0[k:k + 1] if h0 is not None else torch.zeros(1, nb, m, dtype=f64)
        sep_f.append(fk)
    sep = (torch.cat(sep_h, 1), torch.cat(sep_f, 0))
    assert rel(out[0], sep[0]) < 1e-10 and rel(out[1], sep[1]) < 1e-10
    nav = block_scan_naive(A, x, initial_state=h0, cu_seqlens=cu, return_final_state=True)
    assert rel(nav[0], sep[0]) < 1e-12 and rel(nav[1], sep[1]) < 1e-12
    inputs = (A, x) + ((h0,) if with_h0 else ())
    for gr, gs in zip(grads(out, inputs), grads(sep, inputs)):
        assert rel(gr, gs) < 1e-10


def test_stride0_A_time_invariant():
    nb = 4
    nu = torch.randn(nb, dtype=f64, requires_grad=True)
    th = torch.randn(nb, dtype=f64, requires_grad=True)
    x = torch.randn(2, 19, nb, 2, dtype=f64, requires_grad=True)

    def expanded():
        A = lru_lambda_blocks(nu, th).expand(2, 19, nb, 2, 2)
        assert A.stride(0) == 0 and A.stride(1) == 0
        return A

    ref = block_scan_reference(expanded(), x, chunk_size=4, return_final_state=True)
    nav = block_scan_naive(expanded(), x, return_final_state=True)
    assert rel(ref[0], nav[0]) < 1e-10
    for gr, gn in zip(grads(ref, (nu, th, x)), grads(nav, (nu, th, x))):
        assert rel(gr, gn) < 1e-10
    # the 2x2 blocks multiply (Re, Im) pairs by the complex lambda
    hc = torch.zeros(2, nb, dtype=torch.complex128)
    lam_c = torch.exp(-torch.exp(nu) + 1j * torch.exp(th)).detach()
    xc = torch.complex(x[..., 0], x[..., 1]).detach()
    for t in range(19):
        hc = lam_c * hc + xc[:, t]
    assert torch.allclose(ref[1][..., 0], hc.real) and torch.allclose(ref[1][..., 1], hc.imag)


def test_lru_lambda_blocks_values():
    nu = torch.tensor([0.3, -2.0], dtype=f64)
    th = torch.tensor([-1.0, 0.5], dtype=f64)
    Lb = lru_lambda_blocks(nu, th)
    lam = torch.exp(-torch.exp(nu) + 1j * torch.exp(th))
    assert Lb.shape == (2, 2, 2)
    assert torch.allclose(Lb[:, 0, 0], lam.real) and torch.allclose(Lb[:, 1, 0], lam.imag)
    assert torch.allclose(Lb[:, 0, 1], -lam.imag) and torch.allclose(Lb[:, 1, 1], lam.real)
    # |lambda| < 1: spectral radius of every block
    assert (torch.linalg.eigvals(Lb).abs() < 1).all()
    with pytest.raises(ValueError, match="same shape"):
        lru_lambda_blocks(nu, th[:1])


def test_companion_structure():
    a = torch.arange(1, 7, dtype=f64).view(2, 3)
    C = companion(a)
    assert C.shape == (2, 3, 3)
    assert torch.equal(C[1], torch.tensor([[4., 5., 6.], [1., 0., 0.], [0., 1., 0.]], dtype=f64))
    assert torch.equal(companion(torch.tensor([[0.5]])), torch.tensor([[[0.5]]]))
    # characteristic polynomial lambda^m - a1 lambda^(m-1) - ... - am
    ev = torch.linalg.eigvals(C[0])
    poly = ev ** 3 - 1 * ev ** 2 - 2 * ev - 3
    assert poly.abs().max() < 1e-9


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_hlru_companion_equals_direct_recurrence(m):
    b, t, n = 2, 23, 3
    gates = torch.softmax(torch.randn(b, t, n, m + 1, dtype=f64), -1)  # [a_1..a_m, a_0]
    v = torch.randn(b, t, n, dtype=f64)
    a, a0 = gates[..., :m], gates[..., m]
    A = companion(a)  # (b, t, n, m, m)
    x = torch.zeros(b, t, n, m, dtype=f64)
    x[..., 0] = a0 * v
    h, _ = block_scan_reference(A, x, chunk_size=8)
    hist = [torch.zeros(b, n, dtype=f64) for _ in range(m)]  # h_{t-1}, ..., h_{t-m}
    direct = []
    for s in range(t):
        hs = sum(a[:, s, :, i] * hist[i] for i in range(m)) + a0[:, s] * v[:, s]
        hist = [hs] + hist[:-1]
        direct.append(hs)
    direct = torch.stack(direct, 1)
    assert rel(h[..., 0], direct) < 1e-12
    if m > 1:  # the rest of the state holds the delayed outputs
        assert torch.allclose(h[:, 1:, :, 1], direct[:, :-1])
    assert h[..., 0].abs().max() <= v.abs().max() + 1e-12  # Prop. 1 holds for Eq. 3


@pytest.mark.parametrize("m", [2, 3, 5])
def test_bdlru_prop1_bound(m):
    b, t, nb = 3, 200, 8
    gates = torch.softmax(3 * torch.randn(b, t, nb, m, m + 1, dtype=f64), -1)  # rows L1 = 1
    A, a0 = gates[..., :m], gates[..., m]
    v = 5 * torch.randn(b, t, nb, m, dtype=f64)
    h, _ = block_scan_reference(A, a0 * v, chunk_size=16)
    bound = v.abs().amax(dim=(1, 3))  # max over time of ||v_t||_inf per (batch, block)
    assert (h.abs().amax(dim=(1, 3)) <= bound + 1e-12).all()
    # the bound is not vacuous: unnormalised rows break it
    h2, _ = block_scan_reference(1.5 * A, a0 * v, chunk_size=16)
    assert h2.abs().max() > v.abs().max()


@pytest.mark.parametrize("cu", [None, [0, 5, 6, 14]])
def test_chained_step_equals_scan(cu):
    m, nb = 3, 2
    b = 2 if cu is None else 1
    A, x = rand_inputs(b, 14, nb, m, requires_grad=False)
    cu_t = None if cu is None else torch.tensor(cu)
    n = b if cu is None else len(cu) - 1
    h0 = torch.randn(n, nb, m, dtype=f64)
    h, fin = block_scan_reference(A, x, initial_state=h0, cu_seqlens=cu_t, chunk_size=4, return_final_state=True)
    bounds = [(0, 14)] if cu is None else list(zip(cu[:-1], cu[1:]))
    for k, (s, e) in enumerate(bounds):
        st = h0 if cu is None else h0[k:k + 1]
        rows = slice(None) if cu is None else slice(0, 1)
        for i in range(s, e):
            st = block_scan_step(st, A[rows, i], x[rows, i])
            assert torch.allclose(st, h[rows, i], rtol=1e-12, atol=1e-12)
        assert torch.allclose(st, fin[k:k + 1] if cu is not None else fin, rtol=1e-12, atol=1e-12)


def test_step_dtype():
    s = torch.zeros(1, 2, 2)
    out = block_scan_step(s, torch.eye(2).expand(1, 2, 2, 2).bfloat16(), torch.ones(1, 2, 2, dtype=torch.bfloat16))
    assert out.dtype == torch.float32 and torch.equal(out, torch.ones(1, 2, 2))


def test_errors_name_the_field(monkeypatch):
    A, x = rand_inputs(2, 5, 2, 2, requires_grad=False)
    with pytest.raises(ValueError, match="A must be"):
        block_scan(A[..., :1, :], x, backend="reference")
    with pytest.raises(ValueError, match="initial_state"):
        block_scan(A, x, initial_state=torch.zeros(3, 2, 2, dtype=f64), backend="reference")
    with pytest.raises(ValueError, match="cu_seqlens"):
        block_scan(A, x, cu_seqlens=torch.tensor([0, 5]), backend="reference")
    with pytest.raises(ValueError, match="block size"):
        block_scan(torch.zeros(1, 2, 1, 9, 9), torch.zeros(1, 2, 1, 9), backend="reference")
    with pytest.raises(ValueError, match="backend"):
        block_scan(A, x, backend="cuda")
    monkeypatch.setenv("LM_LRU_BACKEND", "fast")
    with pytest.raises(ValueError, match="LM_LRU_BACKEND"):
        block_scan(A, x)
    monkeypatch.setenv("LM_LRU_BACKEND", "reference")
    h, _ = block_scan(A, x)
    assert torch.allclose(h, block_scan_naive(A, x)[0])


def test_reference_and_step_ignore_autocast():
    A, x = rand_inputs(1, 20, 2, 3, dtype=torch.float32, requires_grad=False)
    h0 = torch.randn(1, 2, 3)
    plain = block_scan_reference(A, x, initial_state=h0, chunk_size=4, return_final_state=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = block_scan_reference(A, x, initial_state=h0, chunk_size=4, return_final_state=True)
        step = block_scan_step(h0, A[:, 0], x[:, 0])
    assert auto[0].dtype == torch.float32 and torch.allclose(auto[0], plain[0], rtol=1e-6, atol=1e-6)
    assert step.dtype == torch.float32 and torch.allclose(step, plain[0][:, 0], rtol=1e-6, atol=1e-6)
