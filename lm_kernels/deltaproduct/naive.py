"""Per-sub-step recurrence of (Gated) DeltaProduct: the plainest statement of the op (slow; tests only).

For token i with sub-steps j = 1..nh (interleaved at index i*nh + j - 1):
    H_{i,0} = exp(g_i) H_{i-1}
    H_{i,j} = (I - beta_{i,j} k k^T) H_{i,j-1} + beta_{i,j} k v^T        (k = k_{i,j}, v = v_{i,j})
    o_i     = scale * H_{i,nh}^T q_i
"""
from __future__ import annotations

import torch

from ._common import check_inputs, check_step_inputs, compute_dtype, l2norm


def _step_rows(H, k, v, beta):
    """One delta-rule sub-step for a batch of states. H (n,K,V), k (n,K), v (n,V), beta (n,)."""
    kH = torch.einsum("nk,nkv->nv", k, H)
    return H + beta[:, None, None] * k[:, :, None] * (v - kH)[:, None, :]


def naive_deltaproduct(q, k, v, beta, g=None, *, num_householder, scale=None, initial_state=None,
                       output_final_state=False, use_qk_l2norm=False, cu_seqlens=None, chunk_size=64,
                       backend=None, cu_seqlens_cpu=None):
    """Same contract as `chunk_deltaproduct`; `chunk_size` and `backend` are accepted and ignored."""
    B, T, H, K, V, N, cs = check_inputs(q, k, v, beta, g, num_householder, initial_state, cu_seqlens,
                                        cu_seqlens_cpu)
    nh = num_householder
    cd = compute_dtype(q, k, v, beta, g, initial_state)
    scale = K ** -0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    odt = v.dtype
    q, k, v, beta = q.to(cd), k.to(cd), v.to(cd), beta.to(cd)
    g = g.to(cd) if g is not None else None
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        spans = [(0, cs[n], cs[n + 1]) for n in range(N)]
    outs, finals = [], []
    for n, (b, t0, t1) in enumerate(spans):
        S = (initial_state[n].to(cd) if initial_state is not None
             else torch.zeros(H, K, V, dtype=cd, device=q.device))
        o_seq = []
        for t in range(t0, t1):
            if g is not None:
                S = S * g[b, t].exp()[:, None, None]
            for j in range(nh):
                r = t * nh + j
                S = _step_rows(S, k[b, r], v[b, r], beta[b, r])
            o_seq.append(torch.einsum("hk,hkv->hv", q[b, t] * scale, S))
        outs.append(torch.stack(o_seq, 0) if o_seq else q.new_zeros(0, H, V))
        finals.append(S)
    if cu_seqlens is None:
        o = torch.stack(outs, 0)
    else:
        o = torch.cat(outs, 0)[None]
    final = torch.stack(finals, 0) if output_final_state else None
    return o.to(odt), final


def deltaproduct_step(state, q, k, v, beta, g=None, *, scale=None, use_qk_l2norm=False):
    """One token of generation (the PyTorch reference; `lm_kernels.deltaproduct.deltaproduct_step` dispatches).
    state (b,h,K,V); q (b,h,K); k (b,nh,h,K); v (b,nh,h,V); beta (b,nh,h); g (b,h) log decay. Returns
    (o (b,h,V) in v's dtype, new_state float32 (float64 for float64 inputs)). The input state is not modified."""
    b, h, K, V, nh = check_step_inputs(state, q, k, v, beta, g)
    cd = compute_dtype(state, q, k, v, beta, g)
    scale = K ** -0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    odt = v.dtype
    S = state.to(cd)
    if g is not None:
        S = S * g.to(cd).exp()[:, :, None, None]
    k, v, beta = k.to(cd), v.to(cd), beta.to(cd)
    for j in range(nh):
        kS = torch.einsum("bhk,bhkv->bhv", k[:, j], S)
        S = S + beta[:, j, :, None, None] * k[:, j, :, :, None] * (v[:, j] - kS)[:, :, None, :]
    o = torch.einsum("bhk,bhkv->bhv", q.to(cd) * scale, S)
    return o.to(odt), S
