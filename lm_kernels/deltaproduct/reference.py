"""Chunkwise (WY/UT) PyTorch reference of (Gated) DeltaProduct; the CPU training path.

DeltaProduct with nh Householder sub-steps per token is a gated delta rule over the interleaved
sequence of length L = nh*T (paper sec. 5.1): row r = i*nh + j carries k_{i,j}, v_{i,j}, beta_{i,j}, the
log decay g_i on its first sub-step (0 on the others) and the query q_i on its last sub-step (0 on the
others). Over one chunk of C rows (cumulative log decay gamma, Gam_rs = exp(gamma_r - gamma_s),
M = lower-triangular mask with the diagonal, S = state entering the chunk):

    A    = strict_lower(diag(beta) (K K^T o Gam));  T = (I + A)^-1          (UT transform)
    W    = T diag(beta e^gamma) K;   U = T diag(beta) V                     (WY representation)
    Vn   = U - W S
    O    = diag(e^gamma) Q S + (Q K^T o Gam o M) Vn
    S'   = e^{gamma_C} S + (diag(e^{gamma_C - gamma}) K)^T Vn

Everything but the state passing is vectorised over chunks; autograd gives every gradient.
Accumulates in float32 (float64 for float64 inputs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import check_inputs, compute_dtype, l2norm


def interleave_query_gate(q, g, nh):
    """q (B,T,H,K) -> (B,T*nh,H,K) with q at each token's last sub-step and 0 elsewhere;
    g (B,T,H) -> (B,T*nh,H) with g at each token's first sub-step and 0 elsewhere (None stays None)."""
    B, T, H, K = q.shape
    zq = q.new_zeros(B, T, H, K)
    qf = torch.stack([zq] * (nh - 1) + [q], dim=2).reshape(B, T * nh, H, K)
    gf = None
    if g is not None:
        zg = g.new_zeros(B, T, H)
        gf = torch.stack([g] + [zg] * (nh - 1), dim=2).reshape(B, T * nh, H)
    return qf, gf


def chunk_gated_delta_rule_core(q, k, v, beta, g, h0, chunk_size):
    """Gated delta rule over rows, chunkwise. q,k (B,L,H,K), v (B,L,H,V), beta (B,L,H), g (B,L,H) log decay
    or None, h0 (B,H,K,V) or None; all already in the compute dtype and q already scaled.
    Returns o (B,L,H,V) and the final state (B,H,K,V)."""
    B, L, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (-L) % C
    # padded rows have beta = 0 and k = 0, so they leave the state unchanged
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    beta = F.pad(beta, (0, 0, 0, pad))
    NC = (L + pad) // C
    # (B,H,NC,C,*)
    qc, kc, vc = (x.transpose(1, 2).reshape(B, H, NC, C, x.shape[-1]) for x in (q, k, v))
    bc = beta.transpose(1, 2).reshape(B, H, NC, C)
    if g is not None:
        gc = F.pad(g, (0, 0, 0, pad)).transpose(1, 2).reshape(B, H, NC, C).cumsum(-1)
    else:
        gc = torch.zeros_like(bc)
    idx = torch.arange(C, device=k.device)
    causal = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    diff = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf"))
    gam = diff.exp()  # zero above the diagonal, no overflow there
    A = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * gam) * strict
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    IA = A + eye
    eg = gc.exp()
    W = torch.linalg.solve_triangular(IA, (bc * eg)[..., None] * kc, upper=False, unitriangular=True)
    U = torch.linalg.solve_triangular(IA, bc[..., None] * vc, upper=False, unitriangular=True)
    Aqk = (qc @ kc.transpose(-1, -2)) * gam
    qg = qc * eg[..., None]
    kd = kc * (gc[..., -1:] - gc).exp()[..., None]
    glast = gc[..., -1].exp()
    S = h0 if h0 is not None else k.new_zeros(B, H, K, V)
    outs = []
    for n in range(NC):
        vn = U[:, :, n] - W[:, :, n] @ S
        outs.append(qg[:, :, n] @ S + Aqk[:, :, n] @ vn)
        S = glast[:, :, n, None, None] * S + kd[:, :, n].transpose(-1, -2) @ vn
    o = torch.stack(outs, 2).reshape(B, H, NC * C, V)[:, :, :L].transpose(1, 2)
    return o, S


def _pack(x, cs, Tmax):
    """(1, total, ...) -> (N, Tmax, ...) zero-padded per sequence."""
    parts = [F.pad(x[0, a:b], [0, 0] * (x.dim() - 2) + [0, Tmax - (b - a)]) for a, b in zip(cs[:-1], cs[1:])]
    return torch.stack(parts, 0)


def chunk_deltaproduct_reference(q, k, v, beta, g=None, *, num_householder, scale=None, initial_state=None,
                                 output_final_state=False, use_qk_l2norm=False, cu_seqlens=None,
                                 chunk_size=64, backend=None, cu_seqlens_cpu=None):
    """Chunkwise reference with the contract of `chunk_deltaproduct` (see the package docstring)."""
    B, T, H, K, V, N, cs = check_inputs(q, k, v, beta, g, num_householder, initial_state, cu_seqlens,
                                        cu_seqlens_cpu)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    nh = num_householder
    cd = compute_dtype(q, k, v, beta, g, initial_state)
    scale = K ** -0.5 if scale is None else scale
    odt = v.dtype
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q.to(cd) * scale
    k, v, beta = k.to(cd), v.to(cd), beta.to(cd)
    g = g.to(cd) if g is not None else None
    h0 = initial_state.to(cd) if initial_state is not None else None
    if cu_seqlens is not None:
        lens = [b - a for a, b in zip(cs[:-1], cs[1:])]
        Tmax = max(lens) if lens else 0
        q = _pack(q, cs, Tmax)
        g = _pack(g, cs, Tmax) if g is not None else None
        csr = [c * nh for c in cs]
        k, v, beta = _pack(k, csr, Tmax * nh), _pack(v, csr, Tmax * nh), _pack(beta, csr, Tmax * nh)
    qf, gf = interleave_query_gate(q, g, nh)
    of, S = chunk_gated_delta_rule_core(qf, k, v, beta, gf, h0, chunk_size)
    o = of[:, nh - 1::nh]
    if cu_seqlens is not None:
        o = torch.cat([o[n, :ln] for n, ln in enumerate(lens)], 0)[None]
    return o.to(odt), (S if output_final_state else None)
