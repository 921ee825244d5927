"""The recurrent (Gated) DeltaProduct decode step as one Triton kernel (generation: one token per call).

Same contract as `naive.deltaproduct_step` (the PyTorch reference, which runs ~6 + 6 nh small kernels per call):
    S <- exp(g) S;  for j in 1..nh: S <- S + beta_j k_j (v_j - k_j^T S)^T;  o = scale S^T q
with the optional L2 norm of q and the k_j done in the kernel. One program per (V block, batch x head): it loads its
[K, BV] slice of the state once, runs the nh sub-steps in registers (k_j^T S is a column sum over K, so V blocks are
independent) and writes o and the new state (float32; the input state is not modified).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import cdiv, next_pow2
from ._common import L2NORM_EPS


@triton.jit
def _step_kernel(s_in, q, k, v, beta, g, s_out, o, H, scale, eps,
                 NH: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 USE_G: tl.constexpr, L2: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    m_kv = mk[:, None] & mv[None, :]
    p_s = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.load(s_in + p_s, mask=m_kv, other=0.0).to(tl.float32)
    if USE_G:
        b_s = b_s * tl.exp(tl.load(g + i_bh).to(tl.float32))
    for j in tl.static_range(NH):
        r = (i_b * NH + j) * H + i_h  # row of k / v / beta (b, nh, h)
        b_k = tl.load(k + r.to(tl.int64) * K + o_k, mask=mk, other=0.0).to(tl.float32)
        if L2:
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + eps)
        b_vj = tl.load(v + r.to(tl.int64) * V + o_v, mask=mv, other=0.0).to(tl.float32)
        b_b = tl.load(beta + r).to(tl.float32)
        b_ks = tl.sum(b_k[:, None] * b_s, 0)
        b_s = b_s + (b_b * b_k)[:, None] * (b_vj - b_ks)[None, :]
    b_q = tl.load(q + i_bh.to(tl.int64) * K + o_k, mask=mk, other=0.0).to(tl.float32)
    if L2:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + eps)
    b_o = tl.sum((b_q * scale)[:, None] * b_s, 0)
    tl.store(o + i_bh.to(tl.int64) * V + o_v, b_o.to(o.dtype.element_ty), mask=mv)
    tl.store(s_out + p_s, b_s, mask=m_kv)


def deltaproduct_step_triton(state, q, k, v, beta, g=None, *, scale=None, use_qk_l2norm=False):
    """Triton form of `deltaproduct_step` (same shapes, checks and results; float32 state out). Inputs must be on a
    CUDA device (or run under TRITON_INTERPRET=1); float64 goes to the reference (see `deltaproduct_step`)."""
    b, h, K, V = state.shape
    nh = k.shape[1]
    scale = K ** -0.5 if scale is None else float(scale)
    s_out = torch.empty(b, h, K, V, dtype=torch.float32, device=state.device)
    o = torch.empty(b, h, V, dtype=v.dtype, device=v.device)
    if b * h == 0 or V == 0:
        return o, s_out
    BK = max(16, next_pow2(K))
    BV = min(max(16, next_pow2(V)), max(16, 4096 // BK))  # [BK, BV] fp32 state tile: 32 regs / thread
    _step_kernel[(cdiv(V, BV), b * h)](
        state.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(),
        g.contiguous() if g is not None else state, s_out, o, h, scale, L2NORM_EPS,
        NH=nh, K=K, V=V, BK=BK, BV=BV, USE_G=g is not None, L2=use_qk_l2norm, num_warps=4)
    return o, s_out
