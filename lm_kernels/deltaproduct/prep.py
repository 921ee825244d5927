"""Forward prep of the DeltaProduct chunk op, one program per (chunk, head), parallel over chunks.

    gc  = within-chunk cumsum of the log gates (each token's gate sits on its first sub-step row)
    A   = strict_lower(diag(beta) (K K^T o Gam)),  Gam_ij = exp(gc_i - gc_j)
    T   = (I + A)^-1                        by 16x16 block inversions and block merges
    W   = T diag(beta e^gc) K               (the WY form: the chunk's state update is S -> e^gC S + Kd^T (U - W S))
    Aqk = scale (Q K^T o Gam o causal)      nh >= 2 only: on the BQ tokens whose last sub-step is in the chunk

U = T diag(beta) V is formed where it is used, in the sequential forward (fwd.py).

The op's backward saves gc and T, not W (a k-sized tensor per layer): it runs this kernel again with W_ONLY, which
forms W from the saved T, gc, K and beta by the same code (`_w_aqk`) at the same launch config, so the W it gets is
the forward's bit for bit, for the cost of reading T and K and writing W (no A, no inversions, no Aqk).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _inv16(A):
    """(I + A)^-1 for a strictly lower-triangular 16x16 fp32 A, by forward substitution on rows."""
    o = tl.arange(0, 16)
    X = -A
    for i in tl.static_range(2, 16):
        x = tl.sum(tl.where((o == i)[:, None], X, 0.0), 0)
        x = x + tl.sum(x[:, None] * X, 0)
        X = tl.where((o == i)[:, None], x[None, :], X)
    return X + tl.where(o[:, None] == o[None, :], 1.0, 0.0)


@triton.jit
def _load_blk(k, beta, gc, eos, i: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Rows i*16 .. i*16+15 of the chunk (pointers at its first row): K, beta, gc and the row mask."""
    rows = i * 16 + tl.arange(0, 16)
    m = rows < eos
    o_k = tl.arange(0, BK)
    kk = tl.load(k + (rows[:, None] * H) * K + o_k[None, :], mask=m[:, None] & (o_k < K)[None, :], other=0.0)
    bb = tl.load(beta + rows * H, mask=m, other=0.0).to(tl.float32)
    gg = tl.load(gc + rows * H, mask=m, other=0.0)
    return kk, bb, gg, m


@triton.jit
def _akk(ki, bi, gi, mi, kj, gj, mj, DIAG: tl.constexpr, PREC: tl.constexpr):
    """A_ij = beta_i (K_i K_j^T) o exp(g_i - g_j) on valid pairs (strictly lower on the diagonal)."""
    a = tl.dot(ki, tl.trans(kj), input_precision=PREC)
    m = mi[:, None] & mj[None, :]
    if DIAG:
        o = tl.arange(0, 16)
        m = m & (o[:, None] > o[None, :])
    d = tl.where(m, gi[:, None] - gj[None, :], float("-inf"))
    return tl.where(m, a * bi[:, None] * tl.exp(d), 0.0)


@triton.jit
def _mmp(P: tl.constexpr, a, b):
    return tl.dot(a, b, input_precision=P)


@triton.jit
def _store_blk(T, eos, i: tl.constexpr, j: tl.constexpr, X, H: tl.constexpr, BT: tl.constexpr):
    rows = i * 16 + tl.arange(0, 16)
    cols = j * 16 + tl.arange(0, 16)
    tl.store(T + (rows[:, None] * H) * BT + cols[None, :], X.to(T.dtype.element_ty), mask=(rows < eos)[:, None])


@triton.jit
def _prep_kernel(k, beta, g, gc, Tm, chunk_seq, chunk_row, cu_rows, q, w, aqk, scale,
                 NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BQ: tl.constexpr, USE_G: tl.constexpr, PREC: tl.constexpr, MP: tl.constexpr, INTRA: tl.constexpr,
                 W_ONLY: tl.constexpr):
    """gc, T, W and (INTRA) Aqk of one chunk (module docstring); W_ONLY: W alone from the gc and T already in memory
    (the backward's recompute; g and aqk are not read). The block merges run at precision MP ("tf32" for bf16 / fp16
    inputs, whose T is stored in that dtype anyway; "ieee" for float32). At 64-row chunks all ten A blocks are formed
    first, so the four K blocks are dead before the inversions. W and Aqk are formed after a barrier from T as just
    stored (still in L2)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    n = tl.load(chunk_seq + i_c)
    r0 = tl.load(chunk_row + i_c).to(tl.int64)
    eos = tl.load(cu_rows + n + 1).to(tl.int64)
    ph = (r0 % NH).to(tl.int32)  # sub-step of the chunk's first row
    t0 = r0 // NH
    k += (r0 * H + i_h) * K
    beta += r0 * H + i_h
    gc += r0 * H + i_h
    Tm += (r0 * H + i_h) * BT
    g += t0 * H + i_h
    eos = (eos - r0).to(tl.int32)
    if not W_ONLY:
        o_t = tl.arange(0, BT)
        m_t = o_t < eos
        if USE_G:
            gl = tl.load(g + ((o_t + ph) // NH) * H, mask=m_t & ((o_t + ph) % NH == 0), other=0.0).to(tl.float32)
        else:
            gl = tl.zeros([BT], dtype=tl.float32)
        gcs = tl.cumsum(gl, 0)
        tl.store(gc + o_t * H, gcs, mask=m_t)
        tl.debug_barrier()
        if BT >= 64:
            k1, b1, g1, m1 = _load_blk(k, beta, gc, eos, 0, H, K, BK)
            k2, b2, g2, m2 = _load_blk(k, beta, gc, eos, 1, H, K, BK)
            k3, b3, g3, m3 = _load_blk(k, beta, gc, eos, 2, H, K, BK)
            k4, b4, g4, m4 = _load_blk(k, beta, gc, eos, 3, H, K, BK)
            A11 = _akk(k1, b1, g1, m1, k1, g1, m1, True, PREC)
            A22 = _akk(k2, b2, g2, m2, k2, g2, m2, True, PREC)
            A33 = _akk(k3, b3, g3, m3, k3, g3, m3, True, PREC)
            A44 = _akk(k4, b4, g4, m4, k4, g4, m4, True, PREC)
            A21 = _akk(k2, b2, g2, m2, k1, g1, m1, False, PREC)
            A31 = _akk(k3, b3, g3, m3, k1, g1, m1, False, PREC)
            A32 = _akk(k3, b3, g3, m3, k2, g2, m2, False, PREC)
            A41 = _akk(k4, b4, g4, m4, k1, g1, m1, False, PREC)
            A42 = _akk(k4, b4, g4, m4, k2, g2, m2, False, PREC)
            A43 = _akk(k4, b4, g4, m4, k3, g3, m3, False, PREC)
            T11 = _inv16(A11)
            T22 = _inv16(A22)
            T33 = _inv16(A33)
            T44 = _inv16(A44)
            T21 = -_mmp(MP, _mmp(MP, T22, A21), T11)
            _store_blk(Tm, eos, 0, 0, T11, H, BT)
            _store_blk(Tm, eos, 1, 0, T21, H, BT)
            _store_blk(Tm, eos, 1, 1, T22, H, BT)
            T32 = -_mmp(MP, _mmp(MP, T33, A32), T22)
            T43 = -_mmp(MP, _mmp(MP, T44, A43), T33)
            T31 = -_mmp(MP, T33, _mmp(MP, A31, T11) + _mmp(MP, A32, T21))
            T42 = -_mmp(MP, T44, _mmp(MP, A42, T22) + _mmp(MP, A43, T32))
            T41 = -_mmp(MP, T44, _mmp(MP, A41, T11) + _mmp(MP, A42, T21) + _mmp(MP, A43, T31))
            _store_blk(Tm, eos, 2, 0, T31, H, BT)
            _store_blk(Tm, eos, 2, 1, T32, H, BT)
            _store_blk(Tm, eos, 2, 2, T33, H, BT)
            _store_blk(Tm, eos, 3, 0, T41, H, BT)
            _store_blk(Tm, eos, 3, 1, T42, H, BT)
            _store_blk(Tm, eos, 3, 2, T43, H, BT)
            _store_blk(Tm, eos, 3, 3, T44, H, BT)
        else:
            k1, b1, g1, m1 = _load_blk(k, beta, gc, eos, 0, H, K, BK)
            T11 = _inv16(_akk(k1, b1, g1, m1, k1, g1, m1, True, PREC))
            _store_blk(Tm, eos, 0, 0, T11, H, BT)
            if BT >= 32:
                k2, b2, g2, m2 = _load_blk(k, beta, gc, eos, 1, H, K, BK)
                T22 = _inv16(_akk(k2, b2, g2, m2, k2, g2, m2, True, PREC))
                A21 = _akk(k2, b2, g2, m2, k1, g1, m1, False, PREC)
                T21 = -_mmp(MP, _mmp(MP, T22, A21), T11)
                _store_blk(Tm, eos, 1, 0, T21, H, BT)
                _store_blk(Tm, eos, 1, 1, T22, H, BT)
    tl.debug_barrier()  # T is in global memory now, visible to the whole program
    _w_aqk(q + (t0 * H + i_h) * K, k, beta, gc, Tm, w + (r0 * H + i_h) * K, aqk, i_c, i_h, ph, tl.minimum(eos, BT),
           scale, NH, H, K, BT, BK, BQ, INTRA, W_ONLY, PREC)


@triton.jit
def _w_aqk(q, k, beta, gc, Tm, w, aqk, i_c, i_h, ph, nt, scale, NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr,
           BT: tl.constexpr, BK: tl.constexpr, BQ: tl.constexpr, INTRA: tl.constexpr, W_ONLY: tl.constexpr,
           PREC: tl.constexpr):
    """W and (INTRA, unless W_ONLY) Aqk of one chunk: the row pointers at the chunk's first row (q at its first token),
    i_c the chunk's global index (aqk is [chunks, H, BQ, BT]), nt rows (<= BT), ph the sub-step of the first row. INTRA
    folds beta and the decay into T's columns, else into the K rows (the faster form of each on an H100), with
    or without W_ONLY: W's rounding follows the form."""
    o_t = tl.arange(0, BT)
    m_t = o_t < nt
    o_k = tl.arange(0, BK)
    mk = o_k < K
    gcs = tl.load(gc + o_t * H, mask=m_t, other=0.0)
    tri = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    b_T = tl.load(Tm + o_t[:, None] * (H * BT) + o_t[None, :], mask=tri, other=0.0)
    b_b = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & mk[None, :], other=0.0)
    kdt = b_k.dtype
    if INTRA:
        b_Tw = (b_T.to(tl.float32) * (b_b * tl.exp(gcs))[None, :]).to(kdt)
        b_w = tl.dot(b_Tw, b_k, input_precision=PREC).to(kdt)
    else:
        b_kb = (b_k.to(tl.float32) * (b_b * tl.exp(gcs))[:, None]).to(kdt)
        b_w = tl.dot(b_T.to(kdt), b_kb, input_precision=PREC).to(kdt)
    tl.store(w + o_t[:, None] * (H * K) + o_k[None, :], b_w.to(w.dtype.element_ty), mask=m_t[:, None] & mk[None, :])
    if INTRA:
        if not W_ONLY:
            o_q = tl.arange(0, BQ)
            rq = o_q * NH + NH - 1 - ph  # row of each token's last sub-step, relative to the chunk's first row
            m_q = rq < nt
            b_q = tl.load(q + o_q[:, None] * (H * K) + o_k[None, :], mask=m_q[:, None] & mk[None, :], other=0.0)
            b_gq = tl.load(gc + rq * H, mask=m_q, other=0.0)
            m_qk = (rq[:, None] >= o_t[None, :]) & m_q[:, None] & m_t[None, :]
            b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
            b_A = tl.where(m_qk, b_A * (scale * tl.exp(tl.where(m_qk, b_gq[:, None] - gcs[None, :], 0.0))), 0.0)
            tl.store(aqk + (i_c.to(tl.int64) * H + i_h) * (BQ * BT) + o_q[:, None] * BT + o_t[None, :],
                     b_A.to(kdt).to(aqk.dtype.element_ty))
