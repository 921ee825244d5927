"""Sequential backward of the DeltaProduct chunk op: one program per (V block, sequence, head), over the sequence's
chunks in reverse. Per chunk (dS' the gradient of the state leaving it):

    dVn = Aqk^T dO + (K dS') o e^(gC - gc)
    dS  = e^gC dS' + scale (Q o e^gq)^T dO - W^T dVn

It stores dVn and the state gradient entering each chunk (dh) for the per-chunk backward (bwd.py), and dh0.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bwd_state_kernel(q, k, w, gc, do, dht, dh0, dh, dvn, aqkt, cu_rows, chunk_off, scale,
                      NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, BQ: tl.constexpr, USE_DHT: tl.constexpr,
                      STORE_DH0: tl.constexpr, PREC: tl.constexpr, LOAD_AQ: tl.constexpr):
    """See the module docstring. The state-independent part Aqk^T dO is formed off the loop-carried chain, from the
    Aqk^T the backward's recompute stored (LOAD_AQ, nh = 1; chunk.py `_recompute`) or from the Q and K tiles (nh >=
    2). Q^T and W^T are loaded directly, the decays scale dO rows and the (K dS) rows instead of the Q and K tiles,
    int32 tile offsets."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_rows + i_n)
    eos = tl.load(cu_rows + i_n + 1)
    c0 = tl.load(chunk_off + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    o_t = tl.arange(0, BT)
    o_q = tl.arange(0, BQ)
    kdt = k.dtype.element_ty
    off_tk = o_t[:, None] * (H * K) + o_k[None, :]
    off_kt = o_k[:, None] + o_t[None, :] * (H * K)
    off_kq = o_k[:, None] + o_q[None, :] * (H * K)
    off_tv = o_t[:, None] * (H * V) + o_v[None, :]
    off_qv = o_q[:, None] * (H * V) + o_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    m_kv = mk[:, None] & mv[None, :]
    b_dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dS += tl.load(dht + (i_n * H + i_h).to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0).to(tl.float32)
    NT = tl.cdiv(eos - bos, BT)
    for cc in range(NT):
        c = NT - 1 - cc
        r0 = bos + c * BT
        re = tl.minimum(r0 + BT, eos)
        t0 = r0 // NH
        tl.store(dh + ((c0 + c) * H + i_h) * K * V + off_kv, b_dS.to(dh.dtype.element_ty), mask=m_kv)
        bk = (r0.to(tl.int64) * H + i_h) * K
        bv = (r0.to(tl.int64) * H + i_h) * V
        m_t = o_t < re - r0
        m_tv = m_t[:, None] & mv[None, :]
        b_k = tl.load(k + bk + off_tk, mask=m_t[:, None] & mk[None, :], other=0.0)
        b_wt = tl.load(w + bk + off_kt, mask=mk[:, None] & m_t[None, :], other=0.0)
        b_g = tl.load(gc + (r0 + o_t) * H + i_h, mask=m_t, other=0.0)
        g_last = tl.load(gc + (re - 1) * H + i_h)
        rq = (t0 + o_q) * NH + NH - 1
        m_q = rq < re
        bq = (t0.to(tl.int64) * H + i_h) * K
        bo = (t0.to(tl.int64) * H + i_h) * V
        b_qt = tl.load(q + bq + off_kq, mask=mk[:, None] & m_q[None, :], other=0.0)
        b_gq = tl.load(gc + rq * H + i_h, mask=m_q, other=0.0)
        b_do = tl.load(do + bo + off_qv, mask=m_q[:, None] & mv[None, :], other=0.0)
        if LOAD_AQ:  # [BT, BQ] per chunk, scaled, zero off the causal mask
            b_at = tl.load(aqkt + ((c0 + c) * H + i_h) * (BT * BQ) + o_t[:, None] * BQ + o_q[None, :])
        else:  # (K Q^T o Gam^T o M^T): row t of the chunk, token column j with last row rq_j >= t
            m_kq = ((rq - r0)[None, :] >= o_t[:, None]) & m_q[None, :] & m_t[:, None]
            b_at = tl.dot(b_k, b_qt, input_precision=PREC)
            b_at = tl.where(m_kq, b_at * (scale * tl.exp(tl.where(m_kq, b_gq[None, :] - b_g[:, None], 0.0))), 0.0)
            b_at = b_at.to(kdt)
        b_dvl = tl.dot(b_at, b_do, input_precision=PREC)
        b_dSk = b_dS.to(kdt)
        b_dvn = b_dvl.to(tl.float32) + tl.dot(b_k, b_dSk, input_precision=PREC) * tl.exp(g_last - b_g)[:, None]
        b_dvn = tl.where(m_t[:, None], b_dvn, 0.0)
        tl.store(dvn + bv + off_tv, b_dvn.to(dvn.dtype.element_ty), mask=m_tv)
        b_dog = (b_do.to(tl.float32) * (scale * tl.exp(b_gq))[:, None]).to(kdt)
        b_dS = b_dS * tl.exp(g_last) + tl.dot(b_qt, b_dog, input_precision=PREC) \
            - tl.dot(b_wt, b_dvn.to(kdt), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h).to(tl.int64) * K * V + off_kv, b_dS, mask=m_kv)
