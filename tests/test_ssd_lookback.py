"""The look-back SSD forward experiment (kernels/ssd/triton_lookback.py) against the PyTorch reference: CPU under
TRITON_INTERPRET=1 (programs run one after another, so the look-back never waits), GPU with the gpu marker."""
import pytest
import torch

from lm_kernels.ssd.reference import ssd_scan_reference
from lm_kernels.ssd.triton_lookback import prepare, ssd_forward_lookback


def _inputs(b, T, H, P, G, N, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = r(b, T, H, P).to(device, dtype)
    dt = (r(b, T, H) * 0.5 - 1.0).to(device, dtype)
    A = -torch.rand(H, generator=g).mul(4).add(0.5).to(device)
    B = (r(b, T, G, N) * 0.5).to(device, dtype)
    C = (r(b, T, G, N) * 0.5).to(device, dtype)
    D = r(H).to(device)
    bias = (r(H) * 0.1).to(device)
    return x, dt, A, B, C, D, bias


def _check(b, T, H, P, G, N, chunk, dtype, device, tol):
    x, dt, A, B, C, D, bias = _inputs(b, T, H, P, G, N, dtype, device)
    ref = ssd_scan_reference(x.double(), dt.double(), A.double(), B.double(), C.double(), chunk_size=chunk,
                             D=D.double(), dt_bias=bias.double())
    ref = ref[0] if isinstance(ref, tuple) else ref
    dtp, cs, CB = prepare(x, dt, A, B, C, dt_bias=bias, chunk_size=chunk)
    y = ssd_forward_lookback(x, B, C, D, dtp, cs, CB, chunk_size=chunk)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.3e}"


@pytest.mark.parametrize("b,T,H,P,G,N", [(2, 64, 2, 16, 1, 16), (1, 96, 4, 32, 2, 16)])
def test_lookback_forward_matches_reference_cpu(b, T, H, P, G, N):
    if torch.cuda.is_available():
        pytest.skip("CPU interpreter test")
    # chunk 32 = 4 row blocks of 8 rows; 2-3 chunks per sequence, so states pass between programs
    _check(b, T, H, P, G, N, 32, torch.bfloat16, "cpu", 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("b,T,H,P,G,N", [(2, 2048, 16, 64, 1, 128), (1, 8192, 8, 64, 2, 128), (3, 1024, 12, 128, 3, 64)])
def test_gpu_lookback_forward_matches_reference(b, T, H, P, G, N):
    _check(b, T, H, P, G, N, 256, torch.bfloat16, "cuda", 1e-2)
