"""DeltaProduct op: chunkwise reference vs the per-sub-step recurrence (float64), step, dispatch, spectrum."""
import pytest
import torch
import torch.nn.functional as F

from lm_kernels.backend import resolve_backend
from lm_kernels.deltaproduct import (chunk_deltaproduct, chunk_deltaproduct_reference, deltaproduct_step,
                                     naive_deltaproduct)

D = torch.float64


def make_inputs(B, T, H, K, V, nh, gate=True, h0=True, n_states=None, dtype=D, unit_k=True):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T * nh, H, K, dtype=dtype)
    if unit_k:
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T * nh, H, V, dtype=dtype)
    beta = torch.rand(B, T * nh, H, dtype=dtype) * 2  # [0, 2]: negative eigenvalues allowed
    g = -torch.rand(B, T, H, dtype=dtype) * 0.5 if gate else None
    s0 = torch.randn(n_states or B, H, K, V, dtype=dtype) if h0 else None
    return q, k, v, beta, g, s0


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def run_and_grads(fn, inputs, wo, ws, **kw):
    leaves = [x.clone().requires_grad_(True) if x is not None else None for x in inputs]
    q, k, v, beta, g, s0 = leaves
    o, s = fn(q, k, v, beta, g, initial_state=s0, output_final_state=True, **kw)
    loss = (o * wo).sum() + (s * ws).sum()
    loss.backward()
    return o.detach(), s.detach(), [x.grad if x is not None else None for x in leaves]


def compare(inputs, nh, chunk_size, cu_seqlens=None, use_qk_l2norm=False, tol=1e-10):
    q, v = inputs[0], inputs[2]
    B, T, H, K = q.shape
    n_states = B if cu_seqlens is None else cu_seqlens.numel() - 1
    wo = torch.randn(B, T, H, v.shape[-1], dtype=D)
    ws = torch.randn(n_states, H, K, v.shape[-1], dtype=D)
    kw = dict(num_householder=nh, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    o1, s1, g1 = run_and_grads(naive_deltaproduct, inputs, wo, ws, **kw)
    o2, s2, g2 = run_and_grads(chunk_deltaproduct_reference, inputs, wo, ws, chunk_size=chunk_size, **kw)
    assert rel(o2, o1) < tol
    assert rel(s2, s1) < tol
    for name, a, b in zip(["q", "k", "v", "beta", "g", "initial_state"], g2, g1):
        if b is None:
            assert a is None
            continue
        assert rel(a, b) < tol, f"grad {name}: {rel(a, b)}"


@pytest.mark.parametrize("nh", [1, 2, 3])
@pytest.mark.parametrize("gate", [False, True])
def test_reference_matches_naive(nh, gate):
    inputs = make_inputs(2, 37, 2, 8, 6, nh, gate=gate)
    compare(inputs, nh, chunk_size=16)


def test_reference_matches_naive_chunk64_no_initial_state():
    inputs = make_inputs(1, 50, 2, 8, 4, 3, gate=True, h0=False)  # L = 150: 3 chunks, the last partial
    compare(inputs, 3, chunk_size=64)


def test_reference_matches_naive_varlen():
    cu = torch.tensor([0, 5, 23, 24, 40])
    inputs = make_inputs(1, 40, 2, 8, 6, 2, gate=True, n_states=4)
    compare(inputs, 2, chunk_size=16, cu_seqlens=cu)


def test_reference_matches_naive_l2norm():
    inputs = make_inputs(1, 21, 2, 8, 6, 2, gate=True, unit_k=False)
    compare(inputs, 2, chunk_size=16, use_qk_l2norm=True)


def test_varlen_equals_separate_sequences():
    cu = torch.tensor([0, 9, 30])
    q, k, v, beta, g, s0 = make_inputs(1, 30, 2, 8, 4, 3, gate=True, n_states=2)
    o, s = chunk_deltaproduct_reference(q, k, v, beta, g, num_householder=3, initial_state=s0,
                                        output_final_state=True, cu_seqlens=cu, chunk_size=16)
    for n, (a, b) in enumerate([(0, 9), (9, 30)]):
        on, sn = chunk_deltaproduct_reference(q[:, a:b], k[:, 3 * a:3 * b], v[:, 3 * a:3 * b], beta[:, 3 * a:3 * b],
                                              g[:, a:b], num_householder=3, initial_state=s0[n:n + 1],
                                              output_final_state=True, chunk_size=16)
        assert rel(o[:, a:b], on) < 1e-12
        assert rel(s[n:n + 1], sn) < 1e-12


def test_nh1_is_delta_rule():
    """nh = 1 is (gated) DeltaNet: S <- e^g S; S <- S + beta k (v - S^T k)^T; o = scale S^T q."""
    B, T, H, K, V = 2, 30, 2, 8, 6
    q, k, v, beta, g, s0 = make_inputs(B, T, H, K, V, 1, gate=True)
    S = s0.clone()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        err = vt - torch.einsum("bhkv,bhk->bhv", S, kt)
        S = S + bt[..., None, None] * kt[..., :, None] * err[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]) * K ** -0.5)
    o_ref = torch.stack(outs, 1)
    o, s = chunk_deltaproduct(q, k, v, beta, g, num_householder=1, initial_state=s0, output_final_state=True,
                              chunk_size=16, backend="reference")
    assert rel(o, o_ref) < 1e-12 and rel(s, S) < 1e-12


def test_transition_spectral_norm_at_most_one():
    """A(x) = exp(g) prod_j (I - beta_j k_j k_j^T), unit k_j, beta_j in [0,2]: ||A||_2 <= 1."""
    gen = torch.Generator().manual_seed(1)
    for nh in (1, 2, 3, 5):
        for K in (2, 4, 16):
            n = 200
            k = F.normalize(torch.randn(n, nh, K, dtype=D, generator=gen), dim=-1)
            beta = torch.rand(n, nh, dtype=D, generator=gen) * 2
            beta[:10] = 2.0  # pure reflections
            beta[10:20] = 0.0
            g = -torch.rand(n, dtype=D, generator=gen)
            g[:30] = 0.0
            A = torch.eye(K, dtype=D).expand(n, K, K)
            for j in range(nh):
                P = torch.eye(K, dtype=D) - beta[:, j, None, None] * k[:, j, :, None] * k[:, j, None, :]
                A = P @ A
            A = g.exp()[:, None, None] * A
            norms = torch.linalg.matrix_norm(A, ord=2)
            assert (norms <= 1 + 1e-12).all(), norms.max()
            # reflections (beta = 2, g = 0) are orthogonal: norm exactly 1
            assert torch.allclose(norms[:10], torch.ones(10, dtype=D))
            # and the transition through the op equals A on a zero-value input
            if K == 4:
                i = 15
                S0 = torch.randn(1, 1, K, 3, dtype=D, generator=gen)
                q = torch.zeros(1, 1, 1, K, dtype=D)
                _, S1 = naive_deltaproduct(q, k[i].reshape(1, nh, 1, K), torch.zeros(1, nh, 1, 3, dtype=D),
                                           beta[i].reshape(1, nh, 1), g[i].reshape(1, 1, 1), num_householder=nh,
                                           initial_state=S0, output_final_state=True)
                assert torch.allclose(S1[0, 0], A[i] @ S0[0, 0])


@pytest.mark.parametrize("gate", [False, True])
def test_step_chain_equals_scan(gate):
    B, T, H, K, V, nh = 2, 12, 3, 8, 5, 3
    q, k, v, beta, g, s0 = make_inputs(B, T, H, K, V, nh, gate=gate, unit_k=False)
    o_scan, s_scan = chunk_deltaproduct(q, k, v, beta, g, num_householder=nh, initial_state=s0,
                                        output_final_state=True, use_qk_l2norm=True, chunk_size=16,
                                        backend="reference")
    S = s0.clone()
    s_before = S.clone()
    outs = []
    for t in range(T):
        sl = slice(t * nh, (t + 1) * nh)
        o_t, S_new = deltaproduct_step(S, q[:, t], k[:, sl], v[:, sl], beta[:, sl],
                                       g[:, t] if g is not None else None, use_qk_l2norm=True)
        assert torch.equal(S, s_before), "deltaproduct_step modified the state in place"
        S = S_new
        s_before = S.clone()
        outs.append(o_t)
    assert rel(torch.stack(outs, 1), o_scan) < 1e-12
    assert rel(S, s_scan) < 1e-12


def test_dtypes_and_outputs():
    q, k, v, beta, g, _ = make_inputs(1, 10, 2, 8, 4, 2, dtype=torch.bfloat16)
    o, s = chunk_deltaproduct(q, k, v, beta, g, num_householder=2, backend="reference", chunk_size=16)
    assert o.dtype == torch.bfloat16 and s is None and o.shape == (1, 10, 2, 4)
    o, s = chunk_deltaproduct(q, k, v, beta, g, num_householder=2, backend="reference", output_final_state=True)
    assert s.dtype == torch.float32 and s.shape == (1, 2, 8, 4)
    o32, _ = chunk_deltaproduct(q.double(), k.double(), v.double(), beta.double(), g.double(),
                                num_householder=2, backend="reference")
    assert rel(o.double(), o32) < 2e-2


def test_errors_and_dispatch(monkeypatch):
    q, k, v, beta, g, s0 = make_inputs(1, 10, 2, 8, 4, 2)
    with pytest.raises(ValueError, match="num_householder"):
        chunk_deltaproduct(q, k, v, beta, g, num_householder=3, backend="reference")
    with pytest.raises(ValueError, match="g"):
        chunk_deltaproduct(q, k, v, beta, g[:, :5], num_householder=2, backend="reference")
    with pytest.raises(ValueError, match="initial_state"):
        chunk_deltaproduct(q, k, v, beta, g, num_householder=2, initial_state=s0[..., :3], backend="reference")
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_deltaproduct(q, k, v, beta, g, num_householder=2, cu_seqlens=torch.tensor([0, 4, 9]),
                           backend="reference")
    with pytest.raises(ValueError, match="backend"):
        chunk_deltaproduct(q, k, v, beta, g, num_householder=2, backend="cuda")
    monkeypatch.setenv("LM_DELTAPRODUCT_BACKEND", "reference")
    assert resolve_backend("deltaproduct", None, torch.device("cpu")) == "reference"
    monkeypatch.setenv("LM_DELTAPRODUCT_BACKEND", "nope")
    with pytest.raises(ValueError, match="LM_DELTAPRODUCT_BACKEND"):
        resolve_backend("deltaproduct", None, torch.device("cpu"))
    monkeypatch.delenv("LM_DELTAPRODUCT_BACKEND")
    assert resolve_backend("deltaproduct", None, torch.device("cpu")) == "reference"
