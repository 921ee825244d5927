"""Per-chunk backward of the DeltaProduct chunk op, parallel over chunks, from the sequential passes' chunk states S
(fwd.py), state gradients dS' (bwd_state.py), Vn and dVn. Per chunk:

    dQ  = e^gq dO S^T + (dO Vn^T o Gam o M) K            dK += (dO Vn^T o Gam o M)^T Q + e^(gC-g) Vn dS'^T
    dW  = -dVn S^T,  dT = dW Kb^T + dVn Vb^T,  dKb = T^T dW,  dVb = T^T dVn,  dA = -T^T dT T^T (strict lower)
    A = beta (K K^T o Gam): dbeta += rowsum(dA o KK o Gam), dK += (dA beta o Gam) K + (..)^T K, dg via dA o A

and the gradient of every exp(gamma) factor goes to the within-chunk cumulative log gate, which a reverse cumsum maps
back to the per-token log gate. Key heads of one 64-wide K slice run it as one kernel (_bwd_main_kernel); wider heads
as two (as flash-linear-attention splits its gated delta rule backward): _bwd_qk_kernel runs the loop over the chunk
states on one K slice per program (half the fp32 accumulators at K = 128) and forms dq, the query and state parts of
dk, dW and each slice's share of dg; _bwd_wy_kernel then forms dv, dbeta and the WY / (I + A)^-1 terms of dk and dg.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _qs_terms(b_q, b_k, b_dqi, b_dovn, b_dkd, b_dgc, b_g, b_gq, g_last, rq, m_q, m_t, o_t, nt, scale, dq, dq_rows, o_k,
              mk, PREC: tl.constexpr):
    """The intra-chunk output and state-passing terms of one chunk (or of one K slice of it) from the main backward's V
    loop (dO S^T, dO Vn^T, Vn dS'^T, rowsum(dS' o S)): stores dq (complete; at dq + dq_rows + o_k, as soon as it is
    formed, so that it does not hold registers through the rest) and returns dk's query and state terms and
    d(gate cumsum); rq: each token's last row, relative to the chunk's first row, nt: the chunk's rows."""
    kdt = b_k.dtype
    b_qs = b_q.to(tl.float32) * scale
    m_qk = (rq[:, None] >= o_t[None, :]) & m_q[:, None] & m_t[None, :]
    b_gamq = tl.exp(tl.where(m_qk, b_gq[:, None] - b_g[None, :], float("-inf")))
    b_qk = tl.dot(b_qs.to(kdt), tl.trans(b_k), input_precision=PREC)
    b_daq = tl.where(m_qk, b_dovn * b_gamq, 0.0)
    b_dq = b_dqi * tl.exp(b_gq)[:, None] + tl.dot(b_daq.to(kdt), b_k, input_precision=PREC)
    tl.store(dq + dq_rows[:, None] + o_k[None, :], (b_dq * scale).to(dq.dtype.element_ty), mask=m_q[:, None] & mk[None, :])
    b_dk = tl.dot(tl.trans(b_daq.to(kdt)), b_qs.to(kdt), input_precision=PREC)
    b_e2 = b_daq * b_qk
    b_dgq = tl.sum(b_e2, 1) + tl.exp(b_gq) * tl.sum(b_qs * b_dqi, 1)
    b_dg = -tl.sum(b_e2, 0)
    b_dg += tl.sum(tl.where((rq[:, None] == o_t[None, :]) & m_q[:, None], b_dgq[:, None], 0.0), 0)
    # state passing terms
    b_ed = tl.exp(g_last - b_g)
    b_dk += b_dkd * b_ed[:, None]
    b_f = tl.sum(b_dkd * b_k.to(tl.float32), 1) * b_ed
    b_dg -= b_f
    b_dglast = tl.sum(b_f, 0) + tl.exp(g_last) * tl.sum(b_dgc, 0)
    b_dg += tl.where(o_t == nt - 1, b_dglast, 0.0)
    return b_dk, b_dg


@triton.jit
def _wy_terms(b_k, b_dwk, b_Tk, b_b, b_g, b_dvnvb, m_t, o_t, b_dk, b_db, b_dg, PREC: tl.constexpr):
    """The WY (W = T Kb, U = T Vb) and T = (I + A)^-1 terms of one chunk's dk, dbeta and d(gate cumsum), added to
    b_dk, b_db, b_dg; b_dwk: dW in k's dtype, b_dvnvb: dVn V^T. dg's dA terms come before the two [BT, K] products
    with K, so that b_e and b_p are dead by then: the split's WY kernel at 4 warps has no spills in this order (392 B
    when the products came first; sm_90, triton 3.6)."""
    kdt = b_k.dtype
    b_eb = b_b * tl.exp(b_g)
    b_kb = b_k.to(tl.float32) * b_eb[:, None]
    b_dT = tl.dot(b_dwk, tl.trans(b_kb.to(kdt)), input_precision=PREC) + b_dvnvb * b_b[None, :]
    b_dkb = tl.dot(tl.trans(b_Tk), b_dwk, input_precision=PREC)
    b_dk += b_dkb * b_eb[:, None]
    b_t = tl.sum(b_dkb * b_k.to(tl.float32), 1)
    b_db += b_t * tl.exp(b_g)
    b_dg += b_t * b_eb
    # T = (I + A)^-1: dA = -T^T dT T^T on the strictly lower part
    b_dA = tl.dot(b_dT.to(kdt), tl.trans(b_Tk), input_precision=PREC)
    b_dA = -tl.dot(tl.trans(b_Tk), b_dA.to(kdt), input_precision=PREC)
    m_s = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_gam = tl.exp(tl.where(m_s, b_g[:, None] - b_g[None, :], float("-inf")))
    b_kk = tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    b_p = tl.where(m_s, b_kk * b_gam, 0.0)
    b_dA = tl.where(m_s, b_dA, 0.0)
    b_db += tl.sum(b_dA * b_p, 1)
    b_dpg = b_dA * b_b[:, None] * b_gam
    b_e = b_dA * b_p * b_b[:, None]
    b_dg += tl.sum(b_e, 1) - tl.sum(b_e, 0)
    b_dk += tl.dot(b_dpg.to(kdt), b_k, input_precision=PREC) + tl.dot(tl.trans(b_dpg.to(kdt)), b_k,
                                                                        input_precision=PREC)
    return b_dk, b_db, b_dg


@triton.jit
def _chunk_start(i_c, chunk_seq, chunk_row, cu_rows, chunk_off, BT: tl.constexpr, NH: tl.constexpr):
    """Chunk i_c's first row r0 (int64), its sequence's end row, its index among the stored chunk states, the
    sub-step of its first row (ph) and its first token (t0)."""
    n = tl.load(chunk_seq + i_c)
    r0 = tl.load(chunk_row + i_c).to(tl.int64)
    bos = tl.load(cu_rows + n).to(tl.int64)
    eos = tl.load(cu_rows + n + 1).to(tl.int64)
    c_glob = tl.load(chunk_off + n).to(tl.int64) + (r0 - bos) // BT
    ph = (r0 % NH).to(tl.int32)
    t0 = r0 // NH
    return r0, eos, c_glob, ph, t0


@triton.jit
def _v_loop(hs, dh, vn, dvn, do, v, dv, b_Tk, b_b, o_t, o_q, o_k, mk, m_t, m_q, H: tl.constexpr, V: tl.constexpr,
            BT: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STATE: tl.constexpr,
            WY: tl.constexpr, PREC: tl.constexpr):
    """A chunk's loop over V blocks. STATE: the fp32 accumulators dO S^T, dO Vn^T, Vn dS^T, -dVn S^T and
    rowsum(dS o S) (reads hs, dh, vn, do); WY: dVn V^T and beta's U-gradient, storing dv = T^T dVn diag(beta)
    (reads v, b_Tk, b_b). Returns (dqi, dovn, dkd, dw, dgc, dvnvb, db); a part not run leaves its own zero."""
    b_dqi = tl.zeros([BQ, BK], dtype=tl.float32)
    b_dovn = tl.zeros([BQ, BT], dtype=tl.float32)
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dvnvb = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dgc = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mv = o_v < V
        mtv = m_t[:, None] & mv[None, :]
        if STATE:
            p_h = o_k[:, None] * V + o_v[None, :]
            b_S = tl.load(hs + p_h, mask=mk[:, None] & mv[None, :], other=0.0)
            b_dS = tl.load(dh + p_h, mask=mk[:, None] & mv[None, :], other=0.0)
            b_vn = tl.load(vn + o_t[:, None] * (H * V) + o_v[None, :], mask=mtv, other=0.0)
        b_dvn = tl.load(dvn + o_t[:, None] * (H * V) + o_v[None, :], mask=mtv, other=0.0)
        if WY:
            b_v = tl.load(v + o_t[:, None] * (H * V) + o_v[None, :], mask=mtv, other=0.0)
        if STATE:
            b_do = tl.load(do + o_q[:, None] * (H * V) + o_v[None, :], mask=m_q[:, None] & mv[None, :], other=0.0)
            b_dqi += tl.dot(b_do, tl.trans(b_S), input_precision=PREC)
            b_dovn += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
            b_dkd += tl.dot(b_vn, tl.trans(b_dS), input_precision=PREC)
            b_dw -= tl.dot(b_dvn, tl.trans(b_S), input_precision=PREC)
            b_dgc += tl.sum(b_dS.to(tl.float32) * b_S.to(tl.float32), 1)
        if WY:
            b_dvnvb += tl.dot(b_dvn, tl.trans(b_v), input_precision=PREC)  # dVn Vb^T = (dVn V^T) diag(beta)
            b_dvb = tl.dot(tl.trans(b_Tk), b_dvn, input_precision=PREC)
            tl.store(dv + o_t[:, None] * (H * V) + o_v[None, :], (b_dvb * b_b[:, None]).to(dv.dtype.element_ty),
                     mask=mtv)
            b_db += tl.sum(b_dvb * b_v.to(tl.float32), 1)
    return b_dqi, b_dovn, b_dkd, b_dw, b_dgc, b_dvnvb, b_db


@triton.jit
def _wy_store(b_k, b_dw, b_Tk, b_b, b_g, b_dvnvb, b_dk, b_db, b_dg, dk, db, dg, m_t, o_t, o_k, mkv, ph,
              H: tl.constexpr, K: tl.constexpr, NH: tl.constexpr, USE_G: tl.constexpr, PREC: tl.constexpr):
    """Add the WY terms to dk, dbeta and the gate cumsum's gradient and store the three (dg per token: the reverse
    cumsum of the per-row terms, stored from each token's first row)."""
    b_dk, b_db, b_dg = _wy_terms(b_k, b_dw, b_Tk, b_b, b_g, b_dvnvb, m_t, o_t, b_dk, b_db, b_dg, PREC)
    tl.store(dk + o_t[:, None] * (H * K) + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=mkv)
    tl.store(db + o_t * H, b_db.to(db.dtype.element_ty), mask=m_t)
    if USE_G:
        b_dg = tl.where(m_t, b_dg, 0.0)
        b_dgl = tl.sum(b_dg, 0) - tl.cumsum(b_dg, 0) + b_dg  # reverse cumsum
        tl.store(dg + ((o_t + ph) // NH) * H, b_dgl.to(dg.dtype.element_ty), mask=m_t & ((o_t + ph) % NH == 0))


@triton.jit
def _bwd_main_kernel(q, k, v, beta, gc, Tm, hs, vn, do, dh, dvn, dq, dk, dv, db, dg,
                     chunk_seq, chunk_row, cu_rows, chunk_off, scale,
                     NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, BQ: tl.constexpr, USE_G: tl.constexpr, PREC: tl.constexpr):
    """dq, dk, dv, dbeta, dg of one chunk: one loop over V blocks with five fp32 accumulators (dO S^T, dO Vn^T,
    Vn dS^T, dVn S^T, dVn V^T), then the intra-chunk, state and WY terms. Every pointer is moved once to the chunk
    (int64), so the tile offsets are small int32; the K and Q tiles, used only after the V loop, are loaded after it."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    r0, eos, c_glob, ph, t0 = _chunk_start(i_c, chunk_seq, chunk_row, cu_rows, chunk_off, BT, NH)
    k += (r0 * H + i_h) * K
    dk += (r0 * H + i_h) * K
    v += (r0 * H + i_h) * V
    vn += (r0 * H + i_h) * V
    dvn += (r0 * H + i_h) * V
    dv += (r0 * H + i_h) * V
    beta += r0 * H + i_h
    db += r0 * H + i_h
    gc += r0 * H + i_h
    Tm += (r0 * H + i_h) * BT
    q += (t0 * H + i_h) * K
    dq += (t0 * H + i_h) * K
    do += (t0 * H + i_h) * V
    dg += t0 * H + i_h
    hs += (c_glob * H + i_h) * K * V
    dh += (c_glob * H + i_h) * K * V
    nt = (tl.minimum(eos, r0 + BT) - r0).to(tl.int32)
    o_t = tl.arange(0, BT)
    o_q = tl.arange(0, BQ)
    o_k = tl.arange(0, BK)
    mk = o_k < K
    m_t = o_t < nt
    kdt = k.dtype.element_ty
    mkv = m_t[:, None] & mk[None, :]
    b_b = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_g = tl.load(gc + o_t * H, mask=m_t, other=0.0)
    g_last = tl.load(gc + (nt - 1) * H)
    tri = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    b_T = tl.load(Tm + o_t[:, None] * (H * BT) + o_t[None, :], mask=tri, other=0.0)
    b_Tk = b_T.to(kdt)
    rq = o_q * NH + NH - 1 - ph
    m_q = rq < nt
    b_gq = tl.load(gc + rq * H, mask=m_q, other=0.0)
    b_dqi, b_dovn, b_dkd, b_dw, b_dgc, b_dvnvb, b_db = _v_loop(hs, dh, vn, dvn, do, v, dv, b_Tk, b_b, o_t, o_q, o_k, mk,
                                                               m_t, m_q, H, V, BT, BQ, BK, BV, True, True, PREC)
    b_q = tl.load(q + o_q[:, None] * (H * K) + o_k[None, :], mask=m_q[:, None] & mk[None, :], other=0.0)
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=mkv, other=0.0)
    b_dk, b_dg = _qs_terms(b_q, b_k, b_dqi, b_dovn, b_dkd, b_dgc, b_g, b_gq, g_last, rq, m_q, m_t, o_t, nt, scale,
                           dq, o_q * (H * K), o_k, mk, PREC)
    _wy_store(b_k, b_dw.to(kdt), b_Tk, b_b, b_g, b_dvnvb, b_dk, b_db, b_dg, dk, db, dg, m_t, o_t, o_k, mkv, ph,
              H, K, NH, USE_G, PREC)


@triton.jit
def _bwd_qk_kernel(q, k, gc, hs, vn, do, dh, dvn, dq, dkp, dwp, dgp, chunk_seq, chunk_row, cu_rows, chunk_off, scale,
                   LH, NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, BQ: tl.constexpr, PREC: tl.constexpr):
    """One chunk, one BK-wide K slice (program_id 0, so that a chunk's slices run side by side and share its Vn, dVn
    and dO tiles through L2): V loop with dO S^T, dO Vn^T, Vn dS^T, dVn S^T, then dq (complete), dk's query and state
    terms (dkp), dW (dwp) and the slice's terms of d(gate cumsum) (dgp[i_k])."""
    i_k, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r0, eos, c_glob, ph, t0 = _chunk_start(i_c, chunk_seq, chunk_row, cu_rows, chunk_off, BT, NH)
    k0 = i_k * BK
    k += (r0 * H + i_h) * K + k0
    dkp += (r0 * H + i_h) * K + k0
    dwp += (r0 * H + i_h) * K + k0
    vn += (r0 * H + i_h) * V
    dvn += (r0 * H + i_h) * V
    gc += r0 * H + i_h
    dgp += i_k.to(tl.int64) * LH + r0 * H + i_h
    q += (t0 * H + i_h) * K + k0
    dq += (t0 * H + i_h) * K + k0
    do += (t0 * H + i_h) * V
    hs += (c_glob * H + i_h) * K * V + k0 * V
    dh += (c_glob * H + i_h) * K * V + k0 * V
    nt = (tl.minimum(eos, r0 + BT) - r0).to(tl.int32)
    o_t = tl.arange(0, BT)
    o_q = tl.arange(0, BQ)
    o_k = tl.arange(0, BK)
    mk = o_k < K - k0
    m_t = o_t < nt
    b_g = tl.load(gc + o_t * H, mask=m_t, other=0.0)
    g_last = tl.load(gc + (nt - 1) * H)
    rq = o_q * NH + NH - 1 - ph
    m_q = rq < nt
    b_gq = tl.load(gc + rq * H, mask=m_q, other=0.0)
    b_dqi, b_dovn, b_dkd, b_dw, b_dgc, _, _ = _v_loop(hs, dh, vn, dvn, do, dvn, dvn, o_t, o_t, o_t, o_q, o_k, mk, m_t,
                                                      m_q, H, V, BT, BQ, BK, BV, True, False, PREC)
    mtk = m_t[:, None] & mk[None, :]
    tl.store(dwp + o_t[:, None] * (H * K) + o_k[None, :], b_dw.to(dwp.dtype.element_ty), mask=mtk)
    b_q = tl.load(q + o_q[:, None] * (H * K) + o_k[None, :], mask=m_q[:, None] & mk[None, :], other=0.0)
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=mtk, other=0.0)
    # every term is linear in the slice's columns (Q K^T, rowsum(Q o dQ), rowsum(dK o K), sum(dS o S) are sums over them)
    b_dk, b_dg = _qs_terms(b_q, b_k, b_dqi, b_dovn, b_dkd, b_dgc, b_g, b_gq, g_last, rq, m_q, m_t, o_t, nt, scale,
                           dq, o_q * (H * K), o_k, mk, PREC)
    tl.store(dkp + o_t[:, None] * (H * K) + o_k[None, :], b_dk.to(dkp.dtype.element_ty), mask=mtk)
    tl.store(dgp + o_t * H, b_dg, mask=m_t)


@triton.jit
def _bwd_wy_kernel(k, v, beta, gc, Tm, dvn, dwp, dkp, dgp, dk, dv, db, dg, chunk_seq, chunk_row, cu_rows, LH,
                   NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr, USE_G: tl.constexpr, PREC: tl.constexpr):
    """One chunk: dv and beta's U-gradient (V loop over dVn, V), then the WY terms (W = T Kb, U = T Vb) and the
    (I + A)^-1 terms of dk, dbeta and dg from _bwd_qk_kernel's dW, added to its dk and dg shares."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    n = tl.load(chunk_seq + i_c)
    r0 = tl.load(chunk_row + i_c).to(tl.int64)
    eos = tl.load(cu_rows + n + 1).to(tl.int64)
    ph = (r0 % NH).to(tl.int32)
    k += (r0 * H + i_h) * K
    dk += (r0 * H + i_h) * K
    dkp += (r0 * H + i_h) * K
    dwp += (r0 * H + i_h) * K
    v += (r0 * H + i_h) * V
    dv += (r0 * H + i_h) * V
    dvn += (r0 * H + i_h) * V
    beta += r0 * H + i_h
    db += r0 * H + i_h
    gc += r0 * H + i_h
    dgp += r0 * H + i_h
    Tm += (r0 * H + i_h) * BT
    dg += (r0 // NH) * H + i_h
    nt = (tl.minimum(eos, r0 + BT) - r0).to(tl.int32)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    mk = o_k < K
    m_t = o_t < nt
    mkv = m_t[:, None] & mk[None, :]
    kdt = k.dtype.element_ty
    b_b = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_g = tl.load(gc + o_t * H, mask=m_t, other=0.0)
    tri = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    b_Tk = tl.load(Tm + o_t[:, None] * (H * BT) + o_t[None, :], mask=tri, other=0.0).to(kdt)
    _, _, _, _, _, b_dvnvb, b_db = _v_loop(dvn, dvn, dvn, dvn, dvn, v, dv, b_Tk, b_b, o_t, o_t, o_k, mk, m_t, m_t,
                                           H, V, BT, BT, BK, BV, False, True, PREC)
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=mkv, other=0.0)
    b_dw = tl.load(dwp + o_t[:, None] * (H * K) + o_k[None, :], mask=mkv, other=0.0).to(kdt)
    b_dg = tl.zeros([BT], dtype=tl.float32)
    for i_k in tl.static_range(NK):
        b_dg += tl.load(dgp + i_k * LH + o_t * H, mask=m_t, other=0.0)
    b_dk = tl.load(dkp + o_t[:, None] * (H * K) + o_k[None, :], mask=mkv, other=0.0).to(tl.float32)
    _wy_store(b_k, b_dw, b_Tk, b_b, b_g, b_dvnvb, b_dk, b_db, b_dg, dk, db, dg, m_t, o_t, o_k, mkv, ph, H, K, NH, USE_G,
              PREC)

