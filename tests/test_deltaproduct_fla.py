"""backend="fla" of the DeltaProduct op where fla cannot run (CPU): a ValueError that names the backend to use.
The comparison of fla's kernel with ours on the same inputs is tests/test_deltaproduct_fla_gpu.py."""
import pytest
import torch

from lm_kernels.deltaproduct import chunk_deltaproduct


def _inputs(B=1, T=8, H=2, K=16, V=16, nh=2):
    q = torch.randn(B, T, H, K)
    k, v = torch.randn(B, T * nh, H, K), torch.randn(B, T * nh, H, V)
    beta, g = torch.rand(B, T * nh, H), -torch.rand(B, T, H)
    return q, k, v, beta, g


def test_fla_on_cpu_says_use_reference(monkeypatch):
    pytest.importorskip("fla", reason="flash-linear-attention is not installed")
    q, k, v, beta, g = _inputs()
    with pytest.raises(ValueError, match="CUDA only; use backend='reference'"):
        chunk_deltaproduct(q, k, v, beta, g, num_householder=2, backend="fla")
    monkeypatch.setenv("LM_DELTAPRODUCT_BACKEND", "fla")  # the variable selects it too
    with pytest.raises(ValueError, match="use backend='reference'"):
        chunk_deltaproduct(q, k, v, beta, g, num_householder=2)


def test_fla_backend_checks_shapes_first():
    q, k, v, beta, g = _inputs()
    with pytest.raises(ValueError, match="beta"):
        chunk_deltaproduct(q, k, v, beta[:, :3], g, num_householder=2, backend="fla")


def test_fla_missing_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_product", None)  # import fails as if not installed
    q, k, v, beta, g = _inputs()
    with pytest.raises(ValueError, match=r"pip install 'lm\[fla\]'"):
        chunk_deltaproduct(q, k, v, beta, g, num_householder=2, backend="fla")
