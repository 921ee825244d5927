"""Sequential forward of the DeltaProduct chunk op: state passing and the output, one program per (V block,
sequence, head), sequential over the sequence's chunks. Per chunk (S the state entering it, gc from prep.py):

    U  = T diag(beta) V,   Vn = U - W S
    o  = scale e^gq (Q S) + Aqk Vn      on the BQ tokens whose last sub-step lies in the chunk
    S <- e^gC S + K^T (Vn o e^(gC - gc))

nh = 1 forms Aqk here from its Q and K^T tiles; nh >= 2 reads the prep's Aqk. The forward runs it with OUT (the
output and, optionally, the final state), the same launch with or without grad. The backward runs it again with SAVE
and without OUT (chunk.py, `_recompute`): it stores the state entering each chunk, Vn and, at nh = 1, Aqk^T (scaled)
for the backward kernels and skips the output's products and the query tile (nh >= 2). The states and Vn depend only
on the inputs, W, T and gc, so that pass reproduces what a forward with SAVE would have stored, bit for bit.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fwd_kernel(q, k, w, gc, h0, o, ht, hs, vn, aqk, aqkt, v, Tm, beta, cu_rows, chunk_off, scale,
                NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, BQ: tl.constexpr, BQP: tl.constexpr, USE_H0: tl.constexpr,
                STORE_FINAL: tl.constexpr, OUT: tl.constexpr, SAVE: tl.constexpr, INTRA: tl.constexpr,
                PREC: tl.constexpr):
    """See the module docstring. INTRA (nh >= 2): Aqk from the prep ([BQ, BT] per chunk, scaled); else formed here and,
    with SAVE, stored transposed and scaled to aqkt by the V-block-0 program. OUT: form and store the output (o and
    aqk are not read without it). BQP: rows of the query tile (BQ padded to 64: then both products with the state are
    warpgroup MMAs sharing one shared-memory copy of it). All of a chunk's tiles are loaded at its top, and the state
    store follows their loads so that it overlaps their latency. Tile offsets are int32 from an int64 chunk base (no
    spills on sm_90)."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_rows + i_n)
    eos = tl.load(cu_rows + i_n + 1)
    c0 = tl.load(chunk_off + i_n).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_q = tl.arange(0, BQP)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    kdt = k.dtype.element_ty
    off_tk = o_t[:, None] * (H * K) + o_k[None, :]
    off_kt = o_k[:, None] + o_t[None, :] * (H * K)
    off_tv = o_t[:, None] * (H * V) + o_v[None, :]
    off_qk = o_q[:, None] * (H * K) + o_k[None, :]
    off_qv = o_q[:, None] * (H * V) + o_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    off_tt = o_t[:, None] * (H * BT) + o_t[None, :]
    m_kv = mk[:, None] & mv[None, :]
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0 + (i_n * H + i_h).to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0).to(tl.float32)
    for c in range(tl.cdiv(eos - bos, BT)):
        r0 = bos + c * BT
        re = tl.minimum(r0 + BT, eos)
        t0 = r0 // NH
        nt = re - r0
        bk = (r0.to(tl.int64) * H + i_h) * K
        bv = (r0.to(tl.int64) * H + i_h) * V
        m_t = o_t < nt
        m_tv = m_t[:, None] & mv[None, :]
        m_tt = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
        b_g = tl.load(gc + (r0 + o_t) * H + i_h, mask=m_t, other=0.0)
        g_last = tl.load(gc + (re - 1) * H + i_h)
        b_w = tl.load(w + bk + off_tk, mask=m_t[:, None] & mk[None, :], other=0.0)
        # U = (T diag(beta)) V; T is lower triangular (its upper blocks are never written)
        b_vv = tl.load(v + bv + off_tv, mask=m_tv, other=0.0)
        b_T = tl.load(Tm + (r0.to(tl.int64) * H + i_h) * BT + off_tt, mask=m_tt, other=0.0)
        b_bt = tl.load(beta + (r0 + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_uf = tl.dot((b_T.to(tl.float32) * b_bt[None, :]).to(kdt), b_vv, input_precision=PREC)
        b_kt = tl.load(k + bk + off_kt, mask=mk[:, None] & m_t[None, :], other=0.0)
        # the query tile (padded to BQP rows), its gate cumsums and, for nh >= 2, the prep's Aqk: nh = 1 forms Aqk from
        # the tile for the output and for the saved Aqk^T; nh >= 2 needs the tile only for the output
        rq = (t0 + o_q) * NH + NH - 1
        m_q = (rq < re) & (o_q < BQ)
        bq = (t0.to(tl.int64) * H + i_h) * K
        if not INTRA:
            b_q = tl.load(q + bq + off_qk, mask=m_q[:, None] & mk[None, :], other=0.0)
            b_gq = tl.load(gc + rq * H + i_h, mask=m_q, other=0.0)
        if OUT:
            if INTRA:
                b_q = tl.load(q + bq + off_qk, mask=m_q[:, None] & mk[None, :], other=0.0)
                b_gq = tl.load(gc + rq * H + i_h, mask=m_q, other=0.0)
                b_aq = tl.load(aqk + ((c0 + c) * H + i_h) * (BQ * BT) + o_q[:, None] * BT + o_t[None, :],
                               mask=(o_q < BQ)[:, None], other=0.0)
        if SAVE:  # the state entering the chunk, stored after the tile loads are issued
            tl.store(hs + ((c0 + c) * H + i_h) * K * V + off_kv, b_S.to(hs.dtype.element_ty), mask=m_kv)
        b_Sk = b_S.to(kdt)
        b_vn = b_uf - tl.dot(b_w, b_Sk, input_precision=PREC)
        if SAVE:
            tl.store(vn + bv + off_tv, b_vn.to(vn.dtype.element_ty), mask=m_tv)
        if INTRA:
            if OUT:
                b_o = tl.dot(b_q, b_Sk, input_precision=PREC) * (scale * tl.exp(b_gq))[:, None] \
                    + tl.dot(b_aq, b_vn.to(kdt), input_precision=PREC)
        else:
            m_qk = ((rq - r0)[:, None] >= o_t[None, :]) & m_q[:, None] & m_t[None, :]
            b_A = tl.dot(b_q, b_kt, input_precision=PREC)
            b_A = tl.where(m_qk, b_A * tl.exp(tl.where(m_qk, b_gq[:, None] - b_g[None, :], 0.0)), 0.0)
            if SAVE:  # Aqk^T (scaled) for the sequential backward, written once per chunk (V block 0)
                tl.store(aqkt + ((c0 + c) * H + i_h) * (BT * BQ) + o_t[None, :] * BQ + o_q[:, None],
                         (b_A * scale).to(aqkt.dtype.element_ty),
                         mask=((tl.zeros([BQP, BT], dtype=tl.int32) + i_v) == 0) & (o_q < BQ)[:, None])
            if OUT:
                b_o = tl.dot(b_q, b_Sk, input_precision=PREC) * tl.exp(b_gq)[:, None] \
                    + tl.dot(b_A.to(kdt), b_vn.to(kdt), input_precision=PREC)
                b_o = b_o * scale
        if OUT:
            bo = (t0.to(tl.int64) * H + i_h) * V
            tl.store(o + bo + off_qv, b_o.to(o.dtype.element_ty), mask=m_q[:, None] & mv[None, :])
        b_vd = (b_vn * tl.exp(g_last - b_g)[:, None]).to(kdt)
        b_S = b_S * tl.exp(g_last) + tl.dot(b_kt, b_vd, input_precision=PREC)
    if STORE_FINAL:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * K * V + off_kv, b_S, mask=m_kv)
