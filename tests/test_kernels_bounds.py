"""Every Triton kernel stays inside its arguments' memory (tests/bounds_check.py under the interpreter):
forward and backward of the SSD, DeltaProduct (nh 1..4, gates, packed documents) and LRU block scans, the SSD
decode step and the RMSNorm forward at small ragged shapes. A GPU reports such a bug as an illegal address or a
silent wrong read."""
import os

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the bounds checker instruments the Triton interpreter (CPU)", allow_module_level=True)

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bounds_check import OutOfBounds, bounds_checked  # noqa: E402


@triton.jit
def _copy(x, y, N: tl.constexpr, LIMIT: tl.constexpr, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(y + o, tl.load(x + o, mask=o < LIMIT), mask=o < N)


def test_checker_catches_reads_and_writes_past_the_end():
    x, y = torch.randn(8), torch.empty(8)
    with bounds_checked():
        _copy[(1,)](x, y, N=8, LIMIT=8, B=16)  # in bounds: fine
        with pytest.raises(Exception, match="load out of bounds in _copy"):
            _copy[(1,)](x, y, N=8, LIMIT=9, B=16)
        with pytest.raises(Exception, match="store out of bounds in _copy"):
            _copy[(1,)](x, y, N=9, LIMIT=8, B=16)
    _copy[(1,)](x, y, N=8, LIMIT=9, B=16)  # outside the block nothing is checked
    assert issubclass(OutOfBounds, RuntimeError)


def _grads(out, leaves):
    loss = sum((o.float() * torch.randn_like(o.float())).sum() for o in out if o is not None)
    return torch.autograd.grad(loss, [x for x in leaves if x is not None])


@pytest.mark.parametrize("nh,chunk,gate,cu", [(4, 64, False, None), (1, 16, True, None), (3, 32, True, [0, 7, 8, 37]),
                                             (2, 16, False, [0, 19, 37])])
def test_deltaproduct_in_bounds(nh, chunk, gate, cu):
    from lm_kernels.deltaproduct import chunk_deltaproduct

    torch.manual_seed(0)
    B, T, H, K, V = (1, 37, 2, 32, 16) if cu else (2, 37, 2, 32, 16)
    q = torch.randn(B, T, H, K, requires_grad=True)
    k = F.normalize(torch.randn(B, T * nh, H, K), dim=-1).requires_grad_()
    v = torch.randn(B, T * nh, H, V, requires_grad=True)
    beta = (2 * torch.rand(B, T * nh, H)).requires_grad_()
    g = (-0.1 * torch.rand(B, T, H)).requires_grad_() if gate else None
    n0 = len(cu) - 1 if cu else B
    h0 = torch.randn(n0, H, K, V, requires_grad=True)
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu else None
    with bounds_checked():
        o, s = chunk_deltaproduct(q, k, v, beta, g, num_householder=nh, chunk_size=chunk, initial_state=h0,
                                  output_final_state=True, cu_seqlens=cu_t, backend="triton")
        _grads([o, s], [q, k, v, beta, g, h0])
        with torch.no_grad():
            chunk_deltaproduct(q, k, v, beta, g, num_householder=nh, chunk_size=chunk, cu_seqlens=cu_t,
                               backend="triton")


@pytest.mark.parametrize("cu", [None, [0, 5, 40, 45]])
def test_ssd_in_bounds(cu):
    from lm_kernels.ssd import ssd_scan

    torch.manual_seed(0)
    b, t, h, p, g, n = (1, 45, 4, 16, 2, 16) if cu else (2, 45, 4, 16, 2, 16)
    d = dict(x=torch.randn(b, t, h, p), dt=torch.randn(b, t, h) - 1.0, A=-(torch.rand(h) * 2 + 0.3),
             B=torch.randn(b, t, g, n), C=torch.randn(b, t, g, n), D=torch.randn(h), z=torch.randn(b, t, h, p),
             dt_bias=torch.randn(h) * 0.5, initial_state=torch.randn(len(cu) - 1 if cu else b, h, p, n))
    d = {k: v.requires_grad_() for k, v in d.items()}
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu else None
    with bounds_checked():
        y, f = ssd_scan(**d, chunk_size=16, cu_seqlens=cu_t, return_final_state=True, backend="triton")
        _grads([y, f], list(d.values()))
        with torch.no_grad():
            ssd_scan(**d, chunk_size=16, cu_seqlens=cu_t, backend="triton")


def test_ssd_step_in_bounds():
    """The decode step on strided views of one conv output (odd headdim / d_state, two headdim blocks), D per
    channel and z, the state updated in place."""
    from lm_kernels.ssd import ssd_step

    torch.manual_seed(0)
    b, h, p, g, n = 2, 4, 40, 2, 12
    xbc = torch.randn(b, h * p + 2 * g * n)
    x, B, C = xbc.split([h * p, g * n, g * n], dim=-1)
    state = torch.randn(b, h, p, n)
    with bounds_checked():
        ssd_step(state, x.view(b, h, p), torch.randn(b, h), -torch.rand(h), B.view(b, g, n), C.view(b, g, n),
                 D=torch.randn(h, p), z=torch.randn(b, h, p), dt_bias=torch.randn(h), dt_limit=(0.01, 2.0),
                 out_state=state, backend="triton")


def test_rmsnorm_in_bounds():
    from lm_kernels.rmsnorm import rms_norm_triton

    base = torch.randn(3, 2, 2 * 36)
    with bounds_checked():
        rms_norm_triton(base[..., :36], torch.randn(36), 1e-5, z=base[..., 36:], group_size=12)
        rms_norm_triton(torch.randn(5, 20), None, 1e-5)


@pytest.mark.parametrize("m", [2, 5])
def test_lru_block_scan_in_bounds(m):
    from lm_kernels.lru import block_scan

    torch.manual_seed(0)
    A = ((0.6 / m ** 0.5) * torch.randn(2, 13, 3, m, m)).requires_grad_()
    x = torch.randn(2, 13, 3, m, requires_grad=True)
    h0 = torch.randn(2, 3, m, requires_grad=True)
    with bounds_checked():
        h, f = block_scan(A, x, initial_state=h0, chunk_size=4, return_final_state=True, backend="triton")
        _grads([h, f], [A, x, h0])
