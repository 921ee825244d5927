"""Backward: the z gate, the reverse state pass (dstates), Q = sum_heads dy.x^T (decayed) and dB / dC
(notation: kernel_common.py)."""
import triton
import triton.language as tl

from .kernel_common import chunk_coords, state_walk_start



@triton.jit
def gate_bwd_kernel(dout_ptr, z_ptr, ypre_ptr, dy_ptr, dz_ptr, numel, BLOCK: tl.constexpr):
    """y = ypre * silu(z): dy = dout * silu(z), dz = dout * ypre * silu'(z) (all contiguous)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    do = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    yp = tl.load(ypre_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(z)
    tl.store(dy_ptr + offs, (do * z * sig).to(dy_ptr.dtype.element_ty), mask=mask)
    tl.store(dz_ptr + offs, (do * yp * sig * (1.0 + z * (1.0 - sig))).to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dstate_rows(dy_base, C_base, cs_ptr, tok0, t0, clen, k, offs_p, offs_n, P, N, s_dy_t, s_B_t,
                 BK: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """sum over rows k..k+BK of the chunk of e^{cs_l} dy_l C_l^T: (BP, BN) float32."""
    rows = k + tl.arange(0, BK)
    rmask = rows < clen
    cs_k = tl.load(cs_ptr + tok0 + rows, mask=rmask, other=0.0)
    dyk = tl.load(dy_base + (t0 + rows[:, None]) * s_dy_t + offs_p[None, :],
                  mask=rmask[:, None] & (offs_p[None, :] < P), other=0.0)
    Ck = tl.load(C_base + (t0 + rows[:, None]) * s_B_t + offs_n[None, :],
                 mask=rmask[:, None] & (offs_n[None, :] < N), other=0.0)
    dyw = (dyk.to(tl.float32) * tl.where(rmask, tl.exp(cs_k), 0.0)[:, None]).to(DOT_DT)
    return tl.dot(tl.trans(dyw), Ck.to(DOT_DT), input_precision=DOT_PREC)


@triton.jit
def dstate_bwd_kernel(dy_ptr, C_ptr, cs_ptr, dfinal_ptr, dstates_ptr, dinit_ptr, cu_ptr, chunk_first_ptr,
                      T, H, P, N, NC, BT, R,
                      s_dy_b, s_dy_t, s_dy_h, s_B_b, s_B_t, s_B_g,
                      L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      HAS_DFINAL: tl.constexpr, HAS_INIT: tl.constexpr, IS_VARLEN: tl.constexpr,
                      DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """Per (p-block x n-block, head, sequence): walk the chunks backwards carrying G = dLoss/dS; store G_{c+1}
    per chunk (dstates). The programs that read the same dy rows (one per n-block) are neighbours in the grid and
    share them through L2. (The chunk's <G_{c+1}, e^a S_c> for d(dt*A) is formed in dx_bwd, which holds G_{c+1}
    anyway: read here, the chunk states would add a pass over them to this bandwidth-bound walk.)"""
    pid_pn = tl.program_id(0)
    h = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_p, offs_n, pn_mask, pn_off, b, t_begin, seqlen, c_begin, n_chunks, G, dy_base, C_base = state_walk_start(
        pid_s, pid_pn, h, dfinal_ptr, dy_ptr, C_ptr, cu_ptr, chunk_first_ptr, T, H, P, N, NC, R,
        s_dy_b, s_dy_h, s_B_b, s_B_g, BP, BN, HAS_DFINAL, IS_VARLEN)
    dtype = DOT_DT
    for j in range(0, n_chunks):
        i = n_chunks - 1 - j
        c = c_begin + i
        t0 = t_begin + i * L
        clen = tl.minimum(L, seqlen - i * L)
        st_off = (c.to(tl.int64) * H + h) * P * N + pn_off
        tl.store(dstates_ptr + st_off, G.to(dstates_ptr.dtype.element_ty), mask=pn_mask)
        tok0 = h * BT + b * T + t0
        a = tl.load(cs_ptr + tok0 + clen - 1)
        ea = tl.exp(a)
        if BK >= L:
            acc = _dstate_rows(dy_base, C_base, cs_ptr, tok0, t0, clen, 0, offs_p, offs_n, P, N, s_dy_t, s_B_t,
                               BK, dtype, DOT_PREC)
        else:
            acc = tl.zeros((BP, BN), dtype=tl.float32)
            for k in range(0, clen, BK):
                acc += _dstate_rows(dy_base, C_base, cs_ptr, tok0, t0, clen, k, offs_p, offs_n, P, N, s_dy_t,
                                    s_B_t, BK, dtype, DOT_PREC)
        G = ea * G + acc
    if HAS_INIT:
        tl.store(dinit_ptr + (pid_s * H + h) * P * N + pn_off, G, mask=pn_mask)


@triton.jit
def _dcb_q_head(dy_ptr, x_ptr, cs_ptr, dtp_ptr, h, b, t0, BT, T, k0, rows_m, rows_k, mmask, kmask, causal, offs_p, pmask,
                s_dy_b, s_dy_t, s_dy_h, s_x_b, s_x_t, s_x_h, BK: tl.constexpr, DIAG: tl.constexpr,
                DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """One head's (dy_m . x_k) e^{cs_m - cs_k} dt_k tile (float32); off the diagonal (every k row valid) the
    decay factorises through the k block's last row r (both exponents <= 0)."""
    tok0 = h * BT + b * T + t0
    dym = tl.load(dy_ptr + b * s_dy_b + h * s_dy_h + (t0 + rows_m[:, None]) * s_dy_t + offs_p[None, :],
                  mask=mmask[:, None] & pmask[None, :], other=0.0).to(DOT_DT)
    xk = tl.load(x_ptr + b * s_x_b + h * s_x_h + (t0 + rows_k[:, None]) * s_x_t + offs_p[None, :],
                 mask=kmask[:, None] & pmask[None, :], other=0.0).to(DOT_DT)
    qq = tl.dot(dym, tl.trans(xk), input_precision=DOT_PREC)
    cs_m = tl.load(cs_ptr + tok0 + rows_m, mask=mmask, other=0.0)
    cs_k = tl.load(cs_ptr + tok0 + rows_k, mask=kmask, other=0.0)
    dt_k = tl.load(dtp_ptr + tok0 + rows_k, mask=kmask, other=0.0)
    if DIAG:
        return qq * tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf"))) * dt_k[None, :]
    else:
        cs_r = tl.load(cs_ptr + tok0 + k0 + BK - 1)
        fm = tl.where(mmask, tl.exp(cs_m - cs_r), 0.0)
        return qq * fm[:, None] * (tl.exp(cs_r - cs_k) * dt_k)[None, :]


@triton.jit
def dcb_bwd_kernel(dy_ptr, x_ptr, dtp_ptr, cs_ptr, Q_ptr, chunk_t0_ptr, chunk_len_ptr,
                   T, P, NC, BT, R, G,
                   s_dy_b, s_dy_t, s_dy_h, s_x_b, s_x_t, s_x_h,
                   L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BPF: tl.constexpr,
                   IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """Q[m, l] = sum over the group's heads of (dy_m . x_l) e^{cs_m - cs_l} dt_l for l <= m (float32; zeros
    above the diagonal of the diagonal tiles), per (tile, group, chunk): a chunk's tiles run together and share
    its dy / x rows through L2."""
    pid_mk = tl.program_id(0)
    g = tl.program_id(1)
    pid_c = tl.program_id(2)
    n_kb = L // BK
    m0 = (pid_mk // n_kb) * BM
    k0 = (pid_mk % n_kb) * BK
    b, t0, clen = chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if (m0 >= clen) | (k0 >= m0 + BM):
        return
    rows_m = m0 + tl.arange(0, BM)
    rows_k = k0 + tl.arange(0, BK)
    mmask = rows_m < clen
    kmask = rows_k < clen
    offs_p = tl.arange(0, BPF)
    pmask = offs_p < P
    causal = (rows_m[:, None] >= rows_k[None, :]) & kmask[None, :] & mmask[:, None]
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    if k0 == m0:
        for hh in range(0, R):
            acc += _dcb_q_head(dy_ptr, x_ptr, cs_ptr, dtp_ptr, g * R + hh, b, t0, BT, T, k0, rows_m, rows_k, mmask,
                               kmask, causal, offs_p, pmask, s_dy_b, s_dy_t, s_dy_h, s_x_b, s_x_t, s_x_h, BK, True,
                               DOT_DT, DOT_PREC)
    else:
        for hh in range(0, R):
            acc += _dcb_q_head(dy_ptr, x_ptr, cs_ptr, dtp_ptr, g * R + hh, b, t0, BT, T, k0, rows_m, rows_k, mmask,
                               kmask, causal, offs_p, pmask, s_dy_b, s_dy_t, s_dy_h, s_x_b, s_x_t, s_x_h, BK, False,
                               DOT_DT, DOT_PREC)
    q_base = Q_ptr + (pid_c.to(tl.int64) * G + g) * L * L
    tl.store(q_base + rows_m[:, None] * L + rows_k[None, :], acc)


@triton.jit
def dbdc_bwd_kernel(dy_ptr, x_ptr, B_ptr, C_ptr, dtp_ptr, cs_ptr, states_ptr, dstates_ptr, Q_ptr, dB_ptr, dC_ptr,
                    dcs_ptr, chunk_t0_ptr, chunk_len_ptr,
                    T, H, P, N, NC, BT, R, G,
                    s_dy_b, s_dy_t, s_dy_h, s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g, s_dB_b, s_dB_t, s_dB_g,
                    L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BPF: tl.constexpr, BN: tl.constexpr,
                    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """Per (chunk, group, m-block x n-block): dC = sum_h e^{cs} dy S + Q B, dB = sum_h w x G' + Q^T C; and each
    head's dcs_m = dy_m . y_off_m = sum_n C_mn (e^{cs_m} dy_m S)_n from the dC product it forms anyway, the part
    of the n block in its slot of dcs ((n blocks, H, B*T), summed by dt_bwd). dB and dC are written through their
    batch, time and group strides (the same for both; n contiguous): (b, t, g, n) tensors or the B / C columns of a
    (b, t, x | B | C) gradient, whose size-1 time axis (t = 1) may carry any stride. Grid (m-block x
    n-block, group, chunk): the m-blocks of a chunk, which all read the chunk states S and their gradients of every
    head of the group, are neighbours and share them through L2."""
    pid_mn = tl.program_id(0)
    g = tl.program_id(1)
    pid_c = tl.program_id(2)
    n_nb = tl.cdiv(N, BN)
    m0 = (pid_mn // n_nb) * BM
    offs_n = (pid_mn % n_nb) * BN + tl.arange(0, BN)
    b, t0, clen = chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if m0 >= clen:
        return
    rows_m = m0 + tl.arange(0, BM)
    mmask = rows_m < clen
    nmask = offs_n < N
    offs_p = tl.arange(0, BPF)
    pmask = offs_p < P
    dtype = DOT_DT
    acc_dC = tl.zeros((BM, BN), dtype=tl.float32)
    acc_dB = tl.zeros((BM, BN), dtype=tl.float32)
    Cm = tl.load(C_ptr + b * s_B_b + g * s_B_g + (t0 + rows_m[:, None]) * s_B_t + offs_n[None, :],
                 mask=mmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
    for hh in range(0, R):
        h = g * R + hh
        tok0 = h * BT + b * T + t0
        cs_m = tl.load(cs_ptr + tok0 + rows_m, mask=mmask, other=0.0)
        dt_m = tl.load(dtp_ptr + tok0 + rows_m, mask=mmask, other=0.0)
        a = tl.load(cs_ptr + tok0 + clen - 1)
        pm = mmask[:, None] & pmask[None, :]
        dym = tl.load(dy_ptr + b * s_dy_b + h * s_dy_h + (t0 + rows_m[:, None]) * s_dy_t + offs_p[None, :],
                      mask=pm, other=0.0).to(tl.float32)
        xm = tl.load(x_ptr + b * s_x_b + h * s_x_h + (t0 + rows_m[:, None]) * s_x_t + offs_p[None, :],
                     mask=pm, other=0.0).to(tl.float32)
        st_off = (pid_c.to(tl.int64) * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :]
        pn = pmask[:, None] & nmask[None, :]
        S = tl.load(states_ptr + st_off, mask=pn, other=0.0).to(dtype)
        Gd = tl.load(dstates_ptr + st_off, mask=pn, other=0.0).to(dtype)
        e_m = tl.where(mmask, tl.exp(cs_m), 0.0)
        w_m = tl.where(mmask, tl.exp(a - cs_m) * dt_m, 0.0)
        tC = tl.dot((dym * e_m[:, None]).to(dtype), S, input_precision=DOT_PREC)
        acc_dC += tC
        tl.store(dcs_ptr + (pid_mn % n_nb) * (H.to(tl.int64) * BT) + tok0 + rows_m, tl.sum(tC * Cm, 1), mask=mmask)
        acc_dB = tl.dot((xm * w_m[:, None]).to(dtype), Gd, acc_dB, input_precision=DOT_PREC)
    q_base = Q_ptr + (pid_c.to(tl.int64) * G + g) * L * L
    B_base = B_ptr + b * s_B_b + g * s_B_g
    C_base = C_ptr + b * s_B_b + g * s_B_g
    k_end = tl.minimum(m0 + BM, clen)
    for k in range(0, k_end, BK):  # dC_m += sum_{l <= m} Q[m, l] B_l
        rows_k = k + tl.arange(0, BK)
        kmask = rows_k < clen
        # Q's diagonal tiles hold zeros above the diagonal (dcb_bwd): no causal mask, so the loads vectorise
        q = tl.load(q_base + rows_m[:, None] * L + rows_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        Bk = tl.load(B_base + (t0 + rows_k[:, None]) * s_B_t + offs_n[None, :], mask=kmask[:, None] & nmask[None, :],
                     other=0.0).to(dtype)
        acc_dC = tl.dot(q.to(dtype), Bk, acc_dC, input_precision=DOT_PREC)
    k_begin = (m0 // BK) * BK
    for k in range(k_begin, clen, BK):  # dB_l += sum_{m >= l} Q[m, l] C_m  (here l = rows_m)
        rows_k = k + tl.arange(0, BK)
        kmask = rows_k < clen
        qT = tl.load(q_base + rows_k[None, :] * L + rows_m[:, None], mask=mmask[:, None] & kmask[None, :], other=0.0)
        Ck = tl.load(C_base + (t0 + rows_k[:, None]) * s_B_t + offs_n[None, :], mask=kmask[:, None] & nmask[None, :],
                     other=0.0).to(dtype)
        acc_dB = tl.dot(qT.to(dtype), Ck, acc_dB, input_precision=DOT_PREC)
    out_base = b.to(tl.int64) * s_dB_b + g * s_dB_g  # (a scalar: the tile's offsets below stay 32-bit)
    out_off = (t0 + rows_m[:, None]) * s_dB_t + offs_n[None, :]
    mn = mmask[:, None] & nmask[None, :]
    tl.store(dB_ptr + out_base + out_off, acc_dB.to(dB_ptr.dtype.element_ty), mask=mn)
    tl.store(dC_ptr + out_base + out_off, acc_dC.to(dC_ptr.dtype.element_ty), mask=mn)

