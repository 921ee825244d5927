"""Triton kernels of the chunked SSD scan, forward and backward (launched from triton_ssd.py).

Notation (per head; a chunk is at most L consecutive tokens of one sequence):
    dt  processed step (softplus(dt + bias), clamped), cs = in-chunk cumsum of dt*A, a = cs[last]
    S_c state at the start of chunk c (S_0 = initial state), S_{c+1} = e^a S_c + sum_l w_l x_l B_l^T,
        w_l = dt_l e^{a - cs_l}
    y_m = e^{cs_m} S_c C_m + sum_{l<=m} (C_m.B_l) e^{cs_m - cs_l} dt_l x_l + D x_m, then y *= silu(z)
Backward: G_c = dLoss/dS_c runs in reverse, G_c = e^a G_{c+1} + sum_m e^{cs_m} dy_m C_m^T. The kernels
below store G_{c+1} per chunk ("dstates") and then every gradient is chunk-local:
    dx_l   = dt_l * t_l + D dy_l,  t_l = e^{a-cs_l} G_{c+1} B_l + sum_{m>=l} (C_m.B_l) e^{cs_m-cs_l} dy_m
    ddt_l  = x_l.t_l  (+ the part through cs)
    Q_ml   = sum_heads (dy_m.x_l) e^{cs_m-cs_l} dt_l           (m >= l; per group)
    dC_m   = sum_heads e^{cs_m} dy_m S_c + sum_l Q_ml B_l
    dB_l   = sum_heads w_l x_l G_{c+1} + sum_m Q_ml C_m
    d(dt*A)_l = sum_{k>=l} dy_k.y_off_k + sum_{k<l} x_k.dx_state_k + <G_{c+1}, e^a S_c>
                + sum_{m>=l} sum_{s<l} (Q_h * CB)[m, s]       (all float32, no large cancelling terms)
Chunks: fixed-length batches use chunk = (batch, c); packed documents use a chunk table (the chunk's
first token and length), so chunks never cross a document boundary and states restart per document.
Internal per-token buffers (dt, cs, ...) are float32, laid out (H, B*T). Products take their operands
in DOT_DT (the input dtype on GPU; float32 under the interpreter, whose bf16 dot is wrong).
"""
import triton
import triton.language as tl


@triton.jit
def _chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Global chunk id -> (batch, first token in the batch row, length); length 0 = no chunk."""
    if IS_VARLEN:
        b = pid_c * 0
        t0 = tl.load(chunk_t0_ptr + pid_c)
        clen = tl.load(chunk_len_ptr + pid_c)
    else:
        b = pid_c // NC
        t0 = (pid_c % NC) * L
        clen = tl.minimum(L, T - t0)
    return b, t0, clen


@triton.jit
def _seq_coords(pid_s, T, NC, cu_ptr, chunk_first_ptr, IS_VARLEN: tl.constexpr):
    """Sequence id -> (batch, first token, length, first global chunk, number of chunks)."""
    if IS_VARLEN:
        b = pid_s * 0
        t_begin = tl.load(cu_ptr + pid_s).to(tl.int32)
        seqlen = tl.load(cu_ptr + pid_s + 1).to(tl.int32) - t_begin
        c_begin = tl.load(chunk_first_ptr + pid_s)
        n_chunks = tl.load(chunk_first_ptr + pid_s + 1) - c_begin
    else:
        b = pid_s
        t_begin = pid_s * 0
        seqlen = T
        c_begin = pid_s * NC
        n_chunks = NC
    return b, t_begin, seqlen, c_begin, n_chunks


@triton.jit
def _softplus(v):
    return tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _dt_block(dt_ptr, bias_ptr, A_ptr, dtp_ptr, cs_ptr, b, t0, clen, pid_h, T, H, BT, s_dt_b, s_dt_t, dt_lo, dt_hi,
              L: tl.constexpr, BH: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
              HAS_LIMIT: tl.constexpr):
    """dt (bias, softplus, limits) and its within-chunk cumsum of dt * A for one chunk and BH heads."""
    rows = tl.arange(0, L)
    heads = pid_h * BH + tl.arange(0, BH)
    mask = (rows[:, None] < clen) & (heads[None, :] < H)
    dt = tl.load(dt_ptr + b * s_dt_b + (t0 + rows[:, None]) * s_dt_t + heads[None, :], mask=mask, other=0.0)
    dt = dt.to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + heads, mask=heads < H, other=0.0).to(tl.float32)[None, :]
    if SOFTPLUS:
        dt = _softplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    dt = tl.where(mask, dt, 0.0)
    A = tl.load(A_ptr + heads, mask=heads < H, other=0.0).to(tl.float32)
    cs = tl.cumsum(dt * A[None, :], axis=0)
    off = heads[None, :] * BT + b * T + t0 + rows[:, None]
    tl.store(dtp_ptr + off, dt, mask=mask)
    tl.store(cs_ptr + off, cs, mask=mask)


@triton.jit
def _cb_tile(B_ptr, C_ptr, CB_ptr, pid_c, g, b, t0, clen, m0, k0, N, G, s_B_b, s_B_t, s_B_g,
             L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BNF: tl.constexpr,
             DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """One (BM, BK) tile of CB[m, l] = C_m . B_l for chunk pid_c, group g (stored in CB's dtype)."""
    rows_m = m0 + tl.arange(0, BM)
    rows_k = k0 + tl.arange(0, BK)
    offs_n = tl.arange(0, BNF)
    nmask = offs_n < N
    base = b * s_B_b + g * s_B_g
    Cm = tl.load(C_ptr + base + (t0 + rows_m[:, None]) * s_B_t + offs_n[None, :],
                 mask=(rows_m[:, None] < clen) & nmask[None, :], other=0.0).to(DOT_DT)
    Bk = tl.load(B_ptr + base + (t0 + rows_k[:, None]) * s_B_t + offs_n[None, :],
                 mask=(rows_k[:, None] < clen) & nmask[None, :], other=0.0).to(DOT_DT)
    cb = tl.dot(Cm, tl.trans(Bk), input_precision=DOT_PREC)
    tl.store(CB_ptr + (pid_c.to(tl.int64) * G + g) * L * L + rows_m[:, None] * L + rows_k[None, :],
             cb.to(CB_ptr.dtype.element_ty))


@triton.jit
def dt_fwd_kernel(dt_ptr, bias_ptr, A_ptr, dtp_ptr, cs_ptr, chunk_t0_ptr, chunk_len_ptr,
                  T, H, NC, BT, s_dt_b, s_dt_t, dt_lo, dt_hi,
                  L: tl.constexpr, BH: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                  HAS_LIMIT: tl.constexpr, IS_VARLEN: tl.constexpr):
    pid_c = tl.program_id(0)
    b, t0, clen = _chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if clen <= 0:
        return
    _dt_block(dt_ptr, bias_ptr, A_ptr, dtp_ptr, cs_ptr, b, t0, clen, tl.program_id(1), T, H, BT, s_dt_b, s_dt_t,
              dt_lo, dt_hi, L, BH, HAS_BIAS, SOFTPLUS, HAS_LIMIT)


@triton.jit
def _state_rows(x_base, B_base, cs_ptr, dtp_ptr, tok0, t0, a, clen, k, offs_p, offs_n, P, N, s_x_t, s_B_t,
                BK: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """sum over rows k..k+BK of the chunk of w_l x_l B_l^T, w_l = dt_l e^{a - cs_l}: (BP, BN) float32."""
    rows = k + tl.arange(0, BK)
    rmask = rows < clen
    cs_k = tl.load(cs_ptr + tok0 + rows, mask=rmask, other=0.0)
    dt_k = tl.load(dtp_ptr + tok0 + rows, mask=rmask, other=0.0)
    w = tl.where(rmask, tl.exp(a - cs_k) * dt_k, 0.0)
    xk = tl.load(x_base + (t0 + rows[:, None]) * s_x_t + offs_p[None, :],
                 mask=rmask[:, None] & (offs_p[None, :] < P), other=0.0)
    Bk = tl.load(B_base + (t0 + rows[:, None]) * s_B_t + offs_n[None, :],
                 mask=rmask[:, None] & (offs_n[None, :] < N), other=0.0)
    xw = (xk.to(tl.float32) * w[:, None]).to(DOT_DT)
    return tl.dot(tl.trans(xw), Bk.to(DOT_DT), input_precision=DOT_PREC)


@triton.jit
def state_fwd_kernel(x_ptr, B_ptr, dtp_ptr, cs_ptr, init_ptr, states_ptr, final_ptr, cu_ptr, chunk_first_ptr,
                     T, H, P, N, NC, BT, R,
                     s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g, s_sp, s_sn,
                     L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     HAS_INIT: tl.constexpr, HAS_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
                     DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr, PN_FAST: tl.constexpr = False):
    """Per (sequence, head, p-block x n-block): walk the chunks in order, store each chunk's start state.
    PN_FAST: grid (p-block x n-block, head, sequence), so the programs that read the same x rows (one per
    n-block) run together and share them through L2; else (sequence, head, p-block x n-block).
    Chunk state (c, h) element (p, n) is stored at (c * H + h) * P * N + p * s_sp + n * s_sn ("PN" layout:
    s_sp = N, s_sn = 1; "NP": s_sp = 1, s_sn = P)."""
    if PN_FAST:
        pid_pn = tl.program_id(0)
        h = tl.program_id(1)
        pid_s = tl.program_id(2)
    else:
        pid_s = tl.program_id(0)
        h = tl.program_id(1)
        pid_pn = tl.program_id(2)
    n_nb = tl.cdiv(N, BN)
    offs_p = (pid_pn // n_nb) * BP + tl.arange(0, BP)
    offs_n = (pid_pn % n_nb) * BN + tl.arange(0, BN)
    pn_mask = (offs_p[:, None] < P) & (offs_n[None, :] < N)
    pn_off = offs_p[:, None] * N + offs_n[None, :]
    st_off = offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
    g = h // R
    b, t_begin, seqlen, c_begin, n_chunks = _seq_coords(pid_s, T, NC, cu_ptr, chunk_first_ptr, IS_VARLEN)
    dtype = DOT_DT
    if HAS_INIT:
        S = tl.load(init_ptr + (pid_s * H + h) * P * N + pn_off, mask=pn_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BP, BN), dtype=tl.float32)
    x_base = x_ptr + b * s_x_b + h * s_x_h
    B_base = B_ptr + b * s_B_b + g * s_B_g
    for i in range(0, n_chunks):
        c = c_begin + i
        t0 = t_begin + i * L
        clen = tl.minimum(L, seqlen - i * L)
        tl.store(states_ptr + (c.to(tl.int64) * H + h) * P * N + st_off, S.to(states_ptr.dtype.element_ty),
                 mask=pn_mask)
        tok0 = h * BT + b * T + t0
        a = tl.load(cs_ptr + tok0 + clen - 1)
        if BK >= L:  # the whole chunk in one step: no inner loop, so the chunk loop gets pipelined
            acc = _state_rows(x_base, B_base, cs_ptr, dtp_ptr, tok0, t0, a, clen, 0, offs_p, offs_n, P, N,
                              s_x_t, s_B_t, BK, dtype, DOT_PREC)
        else:
            acc = tl.zeros((BP, BN), dtype=tl.float32)
            for k in range(0, clen, BK):
                acc += _state_rows(x_base, B_base, cs_ptr, dtp_ptr, tok0, t0, a, clen, k, offs_p, offs_n, P, N,
                                   s_x_t, s_B_t, BK, dtype, DOT_PREC)
        S = tl.exp(a) * S + acc
    if HAS_FINAL:
        tl.store(final_ptr + (pid_s * H + h) * P * N + pn_off, S, mask=pn_mask)


@triton.jit
def cb_fwd_kernel(B_ptr, C_ptr, CB_ptr, chunk_t0_ptr, chunk_len_ptr, T, N, NC, G,
                  s_B_b, s_B_t, s_B_g,
                  L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BNF: tl.constexpr,
                  IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """CB[m, l] = C_m . B_l per (chunk, group), lower-triangular tiles only (stored in CB's dtype)."""
    pid_c = tl.program_id(0)
    g = tl.program_id(1)
    pid_mk = tl.program_id(2)
    n_kb = L // BK
    m0 = (pid_mk // n_kb) * BM
    k0 = (pid_mk % n_kb) * BK
    b, t0, clen = _chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if (m0 >= clen) | (k0 >= m0 + BM):
        return
    _cb_tile(B_ptr, C_ptr, CB_ptr, pid_c, g, b, t0, clen, m0, k0, N, G, s_B_b, s_B_t, s_B_g, L, BM, BK, BNF,
             DOT_PREC, DOT_DT)


@triton.jit
def dtcb_fwd_kernel(dt_ptr, bias_ptr, A_ptr, dtp_ptr, cs_ptr, B_ptr, C_ptr, CB_ptr, chunk_t0_ptr, chunk_len_ptr,
                    T, H, N, NC, BT, G, s_dt_b, s_dt_t, s_B_b, s_B_t, s_B_g, dt_lo, dt_hi,
                    L: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BNF: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
                    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """dt_fwd_kernel and cb_fwd_kernel in one launch: grid (chunk, G * (L/BM) * (L/BK) + cdiv(H, BH)); the
    first programs of axis 1 compute C.B tiles (group, tile), the rest dt and cs for a block of BH heads."""
    pid_c = tl.program_id(0)
    pid = tl.program_id(1)
    n_cb = G * (L // BM) * (L // BK)
    b, t0, clen = _chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if pid < n_cb:
        g = pid // ((L // BM) * (L // BK))
        pid_mk = pid % ((L // BM) * (L // BK))
        n_kb = L // BK
        m0 = (pid_mk // n_kb) * BM
        k0 = (pid_mk % n_kb) * BK
        if (m0 < clen) & (k0 < m0 + BM):
            _cb_tile(B_ptr, C_ptr, CB_ptr, pid_c, g, b, t0, clen, m0, k0, N, G, s_B_b, s_B_t, s_B_g, L, BM, BK, BNF,
                     DOT_PREC, DOT_DT)
    else:
        _dt_block(dt_ptr, bias_ptr, A_ptr, dtp_ptr, cs_ptr, b, t0, clen, pid - n_cb, T, H, BT, s_dt_b, s_dt_t,
                  dt_lo, dt_hi, L, BH, HAS_BIAS, SOFTPLUS, HAS_LIMIT)


@triton.jit
def chunk_scan_fwd_kernel(x_ptr, CB_ptr, C_ptr, dtp_ptr, cs_ptr, states_ptr, D_ptr, z_ptr, y_ptr, ypre_ptr,
                          chunk_t0_ptr, chunk_len_ptr,
                          T, H, P, N, NC, BT, R, G,
                          s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g, s_z_b, s_z_t, s_z_h,
                          L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                          BNF: tl.constexpr, HAS_D: tl.constexpr, D_HP: tl.constexpr, HAS_Z: tl.constexpr,
                          STORE_PRE: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """Per (chunk, head, m-block x p-block): y = e^{cs} C S^T + causal(CB * decay * dt) x + D x."""
    pid_c = tl.program_id(0)
    h = tl.program_id(1)
    pid_mp = tl.program_id(2)
    n_pb = tl.cdiv(P, BP)
    m0 = (pid_mp // n_pb) * BM
    offs_p = (pid_mp % n_pb) * BP + tl.arange(0, BP)
    b, t0, clen = _chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if m0 >= clen:
        return
    g = h // R
    dtype = DOT_DT
    tok0 = h * BT + b * T + t0
    rows_m = m0 + tl.arange(0, BM)
    mmask = rows_m < clen
    offs_n = tl.arange(0, BNF)
    nmask = offs_n < N
    pmask = offs_p < P
    C_base = C_ptr + b * s_B_b + g * s_B_g
    x_base = x_ptr + b * s_x_b + h * s_x_h
    cb_base = CB_ptr + (pid_c.to(tl.int64) * G + g) * L * L
    cs_m = tl.load(cs_ptr + tok0 + rows_m, mask=mmask, other=0.0)
    Cm = tl.load(C_base + (t0 + rows_m[:, None]) * s_B_t + offs_n[None, :], mask=mmask[:, None] & nmask[None, :],
                 other=0.0).to(dtype)
    S = tl.load(states_ptr + (pid_c.to(tl.int64) * H + h) * P * N + offs_p[None, :] * N + offs_n[:, None],
                mask=pmask[None, :] & nmask[:, None], other=0.0).to(dtype)  # (BNF, BP) = S^T
    acc = tl.dot(Cm, S, input_precision=DOT_PREC) * tl.exp(cs_m)[:, None]
    k_end = tl.minimum(m0 + BM, clen)
    for k in range(0, k_end, BK):
        rows_k = k + tl.arange(0, BK)
        kmask = rows_k < clen
        causal = (rows_m[:, None] >= rows_k[None, :]) & kmask[None, :]
        cb = tl.load(cb_base + rows_m[:, None] * L + rows_k[None, :], mask=causal & mmask[:, None],
                     other=0.0).to(tl.float32)
        cs_k = tl.load(cs_ptr + tok0 + rows_k, mask=kmask, other=0.0)
        dt_k = tl.load(dtp_ptr + tok0 + rows_k, mask=kmask, other=0.0)
        decay = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")))
        cb = cb * decay * dt_k[None, :]
        xk = tl.load(x_base + (t0 + rows_k[:, None]) * s_x_t + offs_p[None, :], mask=kmask[:, None] & pmask[None, :],
                     other=0.0)
        acc = tl.dot(cb.to(dtype), xk.to(dtype), acc, input_precision=DOT_PREC)
    mp_mask = mmask[:, None] & pmask[None, :]
    if HAS_D:
        xm = tl.load(x_base + (t0 + rows_m[:, None]) * s_x_t + offs_p[None, :], mask=mp_mask, other=0.0)
        if D_HP:
            Dv = tl.load(D_ptr + h * P + offs_p, mask=pmask, other=0.0).to(tl.float32)[None, :]
        else:
            Dv = tl.load(D_ptr + h).to(tl.float32)
        acc += Dv * xm.to(tl.float32)
    y_off = (b * T + t0 + rows_m[:, None]) * (H * P) + h * P + offs_p[None, :]
    if STORE_PRE:
        tl.store(ypre_ptr + y_off, acc.to(ypre_ptr.dtype.element_ty), mask=mp_mask)
    if HAS_Z:
        zv = tl.load(z_ptr + b * s_z_b + (t0 + rows_m[:, None]) * s_z_t + h * s_z_h + offs_p[None, :],
                     mask=mp_mask, other=0.0).to(tl.float32)
        acc = acc * zv * tl.sigmoid(zv)
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mp_mask)


@triton.jit
def _scan_rows(x_base, C_base, cb_base, cs_ptr, dtp_ptr, D_ptr, tok0, t0, clen, m0, h, St, offs_p, pmask, offs_n,
               nmask, P, s_x_t, s_B_t,
               L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HAS_D: tl.constexpr, D_HP: tl.constexpr,
               FACT: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr, XS: tl.constexpr = False):
    """y rows m0..m0+BM of one chunk and head (before the z gate), float32 (BM, BP), and the x rows m0..m0+BM:
        y_m = e^{cs_m} C_m S^T + sum_{k <= m} CB[m, k] e^{cs_m - cs_k} dt_k x_k + D x_m,   St = S^T (BNF, BP).
    Blocks strictly below the diagonal (k < m0 <= m, BK divides BM) need no mask; with FACT their decay
    factorises through the k-block's last row r: e^{cs_m - cs_k} = e^{cs_m - cs_r} e^{cs_r - cs_k}, both
    exponents <= 0 (cs falls within a chunk), so underflow is the worst case, and BM + BK exponentials
    replace BM * BK. The diagonal block keeps the exact masked decay.
    XS: below the diagonal the decay goes to the x rows instead: with r = m0 - 1 (the row before the block),
    e^{cs_m - cs_k} = e^{cs_m - cs_r} e^{cs_r - cs_k} (both exponents <= 0), so the raw C.B tile is the A
    operand, x_k dt_k e^{cs_r - cs_k} the B operand, and one row factor e^{cs_m - cs_r} scales the sum of the
    state term (started at e^{cs_r} C_m S^T) and the below-diagonal tiles."""
    rows_m = m0 + tl.arange(0, BM)
    mmask = rows_m < clen
    cs_m = tl.load(cs_ptr + tok0 + rows_m, mask=mmask, other=0.0)
    Cm = tl.load(C_base + (t0 + rows_m[:, None]) * s_B_t + offs_n[None, :], mask=mmask[:, None] & nmask[None, :],
                 other=0.0).to(DOT_DT)
    if XS:  # m0 == 0: r = -1 with cs_r = 0, no tiles below the diagonal
        cs_r = tl.load(cs_ptr + tok0 + m0 - 1, mask=m0 > 0, other=0.0)
        acc = tl.dot(Cm, St, input_precision=DOT_PREC) * tl.exp(cs_r)
        for k in range(0, m0, BK):
            rows_k = k + tl.arange(0, BK)
            cb = tl.load(cb_base + rows_m[:, None] * L + rows_k[None, :], mask=mmask[:, None], other=0.0)
            cs_k = tl.load(cs_ptr + tok0 + rows_k)
            dt_k = tl.load(dtp_ptr + tok0 + rows_k)
            xk = tl.load(x_base + (t0 + rows_k[:, None]) * s_x_t + offs_p[None, :], mask=pmask[None, :], other=0.0)
            xk = (xk.to(tl.float32) * (tl.exp(cs_r - cs_k) * dt_k)[:, None]).to(DOT_DT)
            acc = tl.dot(cb.to(DOT_DT), xk, acc, input_precision=DOT_PREC)
        acc = acc * tl.where(mmask, tl.exp(cs_m - cs_r), 0.0)[:, None]
    else:
        acc = tl.dot(Cm, St, input_precision=DOT_PREC) * tl.where(mmask, tl.exp(cs_m), 0.0)[:, None]
    for k in range(0, 0 if XS else m0, BK):  # below the diagonal: every row valid (k + BK <= m0 < clen)
        rows_k = k + tl.arange(0, BK)
        cb = tl.load(cb_base + rows_m[:, None] * L + rows_k[None, :], mask=mmask[:, None], other=0.0).to(tl.float32)
        cs_k = tl.load(cs_ptr + tok0 + rows_k)
        dt_k = tl.load(dtp_ptr + tok0 + rows_k)
        if FACT:
            cs_r = tl.load(cs_ptr + tok0 + k + BK - 1)
            fm = tl.where(mmask, tl.exp(cs_m - cs_r), 0.0)
            cb = cb * fm[:, None] * (tl.exp(cs_r - cs_k) * dt_k)[None, :]
        else:
            dec = tl.exp(tl.where(mmask[:, None], cs_m[:, None] - cs_k[None, :], float("-inf")))
            cb = cb * dec * dt_k[None, :]
        xk = tl.load(x_base + (t0 + rows_k[:, None]) * s_x_t + offs_p[None, :], mask=pmask[None, :], other=0.0)
        acc = tl.dot(cb.to(DOT_DT), xk.to(DOT_DT), acc, input_precision=DOT_PREC)
    if BK == BM:  # one diagonal block; its x tile is x_m (reused for D and by the fused state update)
        causal = (rows_m[:, None] >= rows_m[None, :]) & mmask[None, :] & mmask[:, None]
        dt_m = tl.load(dtp_ptr + tok0 + rows_m, mask=mmask, other=0.0)
        dec = tl.exp(tl.where(causal, cs_m[:, None] - cs_m[None, :], float("-inf")))
        cb = tl.load(cb_base + rows_m[:, None] * L + rows_m[None, :], mask=causal, other=0.0).to(tl.float32)
        cb = cb * dec * dt_m[None, :]
        xm = tl.load(x_base + (t0 + rows_m[:, None]) * s_x_t + offs_p[None, :], mask=mmask[:, None] & pmask[None, :],
                     other=0.0)
        acc = tl.dot(cb.to(DOT_DT), xm.to(DOT_DT), acc, input_precision=DOT_PREC)
    else:
        k_end = tl.minimum(m0 + BM, clen)
        for k in range(m0, k_end, BK):
            rows_k = k + tl.arange(0, BK)
            kmask = rows_k < clen
            causal = (rows_m[:, None] >= rows_k[None, :]) & kmask[None, :] & mmask[:, None]
            cb = tl.load(cb_base + rows_m[:, None] * L + rows_k[None, :], mask=causal, other=0.0).to(tl.float32)
            cs_k = tl.load(cs_ptr + tok0 + rows_k, mask=kmask, other=0.0)
            dt_k = tl.load(dtp_ptr + tok0 + rows_k, mask=kmask, other=0.0)
            dec = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")))
            cb = cb * dec * dt_k[None, :]
            xk = tl.load(x_base + (t0 + rows_k[:, None]) * s_x_t + offs_p[None, :],
                         mask=kmask[:, None] & pmask[None, :], other=0.0)
            acc = tl.dot(cb.to(DOT_DT), xk.to(DOT_DT), acc, input_precision=DOT_PREC)
        xm = tl.load(x_base + (t0 + rows_m[:, None]) * s_x_t + offs_p[None, :], mask=mmask[:, None] & pmask[None, :],
                     other=0.0)
    if HAS_D:
        if D_HP:
            Dv = tl.load(D_ptr + h * P + offs_p, mask=pmask, other=0.0).to(tl.float32)[None, :]
        else:
            Dv = tl.load(D_ptr + h).to(tl.float32)
        acc += Dv * xm.to(tl.float32)
    return acc, xm


@triton.jit
def _store_y(y_ptr, ypre_ptr, z_ptr, acc, b, t0, h, rows_m, mmask, offs_p, pmask, T, H, P, s_z_b, s_z_t, s_z_h,
             HAS_Z: tl.constexpr, STORE_PRE: tl.constexpr):
    mp_mask = mmask[:, None] & pmask[None, :]
    y_off = (b * T + t0 + rows_m[:, None]).to(tl.int64) * (H * P) + h * P + offs_p[None, :]
    if STORE_PRE:
        tl.store(ypre_ptr + y_off, acc.to(ypre_ptr.dtype.element_ty), mask=mp_mask)
    if HAS_Z:
        zv = tl.load(z_ptr + b * s_z_b + (t0 + rows_m[:, None]) * s_z_t + h * s_z_h + offs_p[None, :],
                     mask=mp_mask, other=0.0).to(tl.float32)
        acc = acc * zv * tl.sigmoid(zv)
    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=mp_mask)


@triton.jit
def chunk_scan_fwd2_kernel(x_ptr, CB_ptr, C_ptr, dtp_ptr, cs_ptr, states_ptr, D_ptr, z_ptr, y_ptr, ypre_ptr,
                           chunk_t0_ptr, chunk_len_ptr,
                           T, H, P, N, NC, BT, R, G,
                           s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g, s_z_b, s_z_t, s_z_h, s_sp, s_sn,
                           L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                           BNF: tl.constexpr, HAS_D: tl.constexpr, D_HP: tl.constexpr, HAS_Z: tl.constexpr,
                           STORE_PRE: tl.constexpr, IS_VARLEN: tl.constexpr, FACT: tl.constexpr,
                           DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr, XS: tl.constexpr = False):
    """chunk_scan_fwd_kernel with the grid (m-block x p-block, head, chunk): the row blocks of one (chunk,
    head) run next to each other (x tiles and the chunk's start state are re-read from L2, not HBM), then
    the heads of the chunk (the group's C rows and CB tiles stay in L2); row blocks run heaviest first."""
    pid_mp = tl.program_id(0)
    h = tl.program_id(1)
    pid_c = tl.program_id(2)
    n_pb = tl.cdiv(P, BP)
    n_mb = tl.cdiv(L, BM)
    m0 = (n_mb - 1 - pid_mp // n_pb) * BM
    offs_p = (pid_mp % n_pb) * BP + tl.arange(0, BP)
    b, t0, clen = _chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if m0 >= clen:
        return
    g = h // R
    tok0 = h * BT + b * T + t0
    offs_n = tl.arange(0, BNF)
    nmask = offs_n < N
    pmask = offs_p < P
    St = tl.load(states_ptr + (pid_c.to(tl.int64) * H + h) * P * N + offs_p[None, :] * s_sp + offs_n[:, None] * s_sn,
                 mask=pmask[None, :] & nmask[:, None], other=0.0).to(DOT_DT)  # (BNF, BP) = S^T
    acc, xm = _scan_rows(x_ptr + b * s_x_b + h * s_x_h, C_ptr + b * s_B_b + g * s_B_g,
                         CB_ptr + (pid_c.to(tl.int64) * G + g) * L * L, cs_ptr, dtp_ptr, D_ptr, tok0, t0, clen, m0, h,
                         St, offs_p, pmask, offs_n, nmask, P, s_x_t, s_B_t,
                         L, BM, BK, HAS_D, D_HP, FACT, DOT_DT, DOT_PREC, XS)
    rows_m = m0 + tl.arange(0, BM)
    _store_y(y_ptr, ypre_ptr, z_ptr, acc, b, t0, h, rows_m, rows_m < clen, offs_p, pmask, T, H, P,
             s_z_b, s_z_t, s_z_h, HAS_Z, STORE_PRE)


@triton.jit
def _xs4_block(acc, cs_r, j, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, ypre_ptr, z_ptr, b, t0, tok0, clen, h,
               T, H, P, offs_p, pmask, s_x_t, s_z_b, s_z_t, s_z_h,
               L: tl.constexpr, BM: tl.constexpr, HAS_D: tl.constexpr, D_HP: tl.constexpr, HAS_Z: tl.constexpr,
               STORE_PRE: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """Row block j of chunk_scan_fwd4: acc holds e^{cs_r} C_m S^T + the below-diagonal sum in the frame of row r
    (cs_r = cs of the row before the block, 0 for block 0); apply the row factor e^{cs_m - cs_r} (<= 1), add
    the exact masked diagonal tile and D x, store y. Returns the block's x tile, cs and dt (for its x~)."""
    rows = j * BM + tl.arange(0, BM)
    mmask = rows < clen
    cs_m = tl.load(cs_ptr + tok0 + rows, mask=mmask, other=0.0)
    dt_m = tl.load(dtp_ptr + tok0 + rows, mask=mmask, other=0.0)
    xm = tl.load(x_base + (t0 + rows[:, None]) * s_x_t + offs_p[None, :], mask=mmask[:, None] & pmask[None, :],
                 other=0.0)
    acc = acc * tl.where(mmask, tl.exp(cs_m - cs_r), 0.0)[:, None]
    causal = (rows[:, None] >= rows[None, :]) & mmask[None, :] & mmask[:, None]
    dec = tl.exp(tl.where(causal, cs_m[:, None] - cs_m[None, :], float("-inf")))
    # (causal mask on the load: 16-bit loads. A row mask only vectorises them but made this kernel slower on the
    # H100, 0.283 vs 0.256 ms at B8 T2048: session 7, lm_kernels/ssd/PERF.md)
    cb = tl.load(cb_base + rows[:, None] * L + rows[None, :], mask=causal, other=0.0).to(tl.float32)
    cb = cb * dec * dt_m[None, :]
    acc = tl.dot(cb.to(DOT_DT), xm.to(DOT_DT), acc, input_precision=DOT_PREC)
    if HAS_D:
        if D_HP:
            Dv = tl.load(D_ptr + h * P + offs_p, mask=pmask, other=0.0).to(tl.float32)[None, :]
        else:
            Dv = tl.load(D_ptr + h).to(tl.float32)
        acc += Dv * xm.to(tl.float32)
    _store_y(y_ptr, ypre_ptr, z_ptr, acc, b, t0, h, rows, mmask, offs_p, pmask, T, H, P, s_z_b, s_z_t, s_z_h,
             HAS_Z, STORE_PRE)
    return xm, cs_m, dt_m


@triton.jit
def _xs4_xt(xm, cs_m, dt_m, cs_ptr, tok0, j, BM: tl.constexpr, DOT_DT: tl.constexpr):
    """x~ of the full row block j relative to its own last row ref: x_k dt_k e^{cs_ref - cs_k} (factors <= 1);
    returns (x~ in the dot dtype, cs_ref)."""
    e = tl.load(cs_ptr + tok0 + j * BM + BM - 1)
    return (xm.to(tl.float32) * (tl.exp(e - cs_m) * dt_m)[:, None]).to(DOT_DT), e


@triton.jit
def _xs4_cs_term(C_base, St, t0, clen, j, offs_n, nmask, s_B_t, BM: tl.constexpr, DOT_DT: tl.constexpr,
                 DOT_PREC: tl.constexpr):
    """C_m S^T for row block j (float32, unscaled)."""
    rows = j * BM + tl.arange(0, BM)
    Cm = tl.load(C_base + (t0 + rows[:, None]) * s_B_t + offs_n[None, :],
                 mask=(rows[:, None] < clen) & nmask[None, :], other=0.0).to(DOT_DT)
    return tl.dot(Cm, St, input_precision=DOT_PREC)


@triton.jit
def _xs4_cb(cb_base, clen, m, k, L: tl.constexpr, BM: tl.constexpr, DOT_DT: tl.constexpr):
    """The raw C.B tile (row block m, k block k < m): every k row valid, m rows masked by the chunk length."""
    rows_m = m * BM + tl.arange(0, BM)
    rows_k = k * BM + tl.arange(0, BM)
    return tl.load(cb_base + rows_m[:, None] * L + rows_k[None, :], mask=(rows_m < clen)[:, None],
                   other=0.0).to(DOT_DT)


@triton.jit
def chunk_scan_fwd4_kernel(x_ptr, CB_ptr, C_ptr, dtp_ptr, cs_ptr, states_ptr, D_ptr, z_ptr, y_ptr, ypre_ptr,
                           chunk_t0_ptr, chunk_len_ptr,
                           T, H, P, N, NC, BT, R, G,
                           s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g, s_z_b, s_z_t, s_z_h, s_sp, s_sn,
                           L: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr,
                           BNF: tl.constexpr, HAS_D: tl.constexpr, D_HP: tl.constexpr, HAS_Z: tl.constexpr,
                           STORE_PRE: tl.constexpr, IS_VARLEN: tl.constexpr,
                           DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """"xs4": the whole chunk (four row blocks, L == 4 * BM) per (p-block, head, chunk), grid (p-block, head,
    chunk). Below the diagonal the decay goes to the x rows as in "xs", but each k block's
        x~_k = x_k dt_k e^{cs_ref(k) - cs_k},   ref(k) = the k block's last row (factors <= 1),
    is built once (from the x tile its own diagonal step loaded) and kept (in shared memory) for the row
    blocks below it; row block m (r = ref(m-1) = m0 - 1) sums Horner-style with scalar factors <= 1:
        A = CB[m, 0] x~_0;  A = A e^{cs_ref(k) - cs_ref(k-1)} + CB[m, k] x~_k  (k = 1 .. m-1);
        A += e^{cs_r} C_m S^T,
    i.e. A = e^{cs_r} C_m S^T + sum_{k<m} e^{cs_r - cs_ref(k)} CB[m, k] x~_k, what "xs" builds per row block;
    then the row factor e^{cs_m - cs_r}, the exact masked diagonal tile and D x. 3 x~ builds per chunk and
    head instead of "xs"'s 6, x and S^T tiles loaded once per program. A chunk cut short returns after its
    last row block."""
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    pid_c = tl.program_id(2)
    offs_p = pid_p * BP + tl.arange(0, BP)
    b, t0, clen = _chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if clen <= 0:
        return
    g = h // R
    tok0 = h * BT + b * T + t0
    offs_n = tl.arange(0, BNF)
    nmask = offs_n < N
    pmask = offs_p < P
    x_base = x_ptr + b * s_x_b + h * s_x_h
    C_base = C_ptr + b * s_B_b + g * s_B_g
    cb_base = CB_ptr + (pid_c.to(tl.int64) * G + g) * L * L
    St = tl.load(states_ptr + (pid_c.to(tl.int64) * H + h) * P * N + offs_p[None, :] * s_sp + offs_n[:, None] * s_sn,
                 mask=pmask[None, :] & nmask[:, None], other=0.0).to(DOT_DT)  # (BNF, BP) = S^T
    # row block 0: state term (cs_r = 0) and the diagonal tile
    acc = _xs4_cs_term(C_base, St, t0, clen, 0, offs_n, nmask, s_B_t, BM, DOT_DT, DOT_PREC)
    xm, cs_m, dt_m = _xs4_block(acc, 0.0, 0, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, ypre_ptr, z_ptr, b, t0,
                                tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, s_z_b, s_z_t, s_z_h,
                                L, BM, HAS_D, D_HP, HAS_Z, STORE_PRE, DOT_DT, DOT_PREC)
    if clen <= BM:
        return
    # row block 1: r = ref(0)
    xt0, e0 = _xs4_xt(xm, cs_m, dt_m, cs_ptr, tok0, 0, BM, DOT_DT)
    acc = _xs4_cs_term(C_base, St, t0, clen, 1, offs_n, nmask, s_B_t, BM, DOT_DT, DOT_PREC) * tl.exp(e0)
    acc = tl.dot(_xs4_cb(cb_base, clen, 1, 0, L, BM, DOT_DT), xt0, acc, input_precision=DOT_PREC)
    xm, cs_m, dt_m = _xs4_block(acc, e0, 1, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, ypre_ptr, z_ptr, b, t0,
                                tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, s_z_b, s_z_t, s_z_h,
                                L, BM, HAS_D, D_HP, HAS_Z, STORE_PRE, DOT_DT, DOT_PREC)
    if clen <= 2 * BM:
        return
    # row block 2: r = ref(1)
    xt1, e1 = _xs4_xt(xm, cs_m, dt_m, cs_ptr, tok0, 1, BM, DOT_DT)
    f1 = tl.exp(e1 - e0)
    acc = tl.dot(_xs4_cb(cb_base, clen, 2, 0, L, BM, DOT_DT), xt0, input_precision=DOT_PREC)
    acc = tl.dot(_xs4_cb(cb_base, clen, 2, 1, L, BM, DOT_DT), xt1, acc * f1, input_precision=DOT_PREC)
    acc += _xs4_cs_term(C_base, St, t0, clen, 2, offs_n, nmask, s_B_t, BM, DOT_DT, DOT_PREC) * tl.exp(e1)
    xm, cs_m, dt_m = _xs4_block(acc, e1, 2, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, ypre_ptr, z_ptr, b, t0,
                                tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, s_z_b, s_z_t, s_z_h,
                                L, BM, HAS_D, D_HP, HAS_Z, STORE_PRE, DOT_DT, DOT_PREC)
    if clen <= 3 * BM:
        return
    # row block 3: r = ref(2)
    xt2, e2 = _xs4_xt(xm, cs_m, dt_m, cs_ptr, tok0, 2, BM, DOT_DT)
    acc = tl.dot(_xs4_cb(cb_base, clen, 3, 0, L, BM, DOT_DT), xt0, input_precision=DOT_PREC)
    acc = tl.dot(_xs4_cb(cb_base, clen, 3, 1, L, BM, DOT_DT), xt1, acc * f1, input_precision=DOT_PREC)
    acc = tl.dot(_xs4_cb(cb_base, clen, 3, 2, L, BM, DOT_DT), xt2, acc * tl.exp(e2 - e1), input_precision=DOT_PREC)
    acc += _xs4_cs_term(C_base, St, t0, clen, 3, offs_n, nmask, s_B_t, BM, DOT_DT, DOT_PREC) * tl.exp(e2)
    _xs4_block(acc, e2, 3, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, ypre_ptr, z_ptr, b, t0,
               tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, s_z_b, s_z_t, s_z_h,
               L, BM, HAS_D, D_HP, HAS_Z, STORE_PRE, DOT_DT, DOT_PREC)


@triton.jit
def ssd_fused_fwd_kernel(x_ptr, B_ptr, C_ptr, CB_ptr, dtp_ptr, cs_ptr, init_ptr, final_ptr, D_ptr, z_ptr, y_ptr,
                         cu_ptr, chunk_first_ptr,
                         T, H, P, N, NC, BT, R, G,
                         s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g, s_z_b, s_z_t, s_z_h,
                         L: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BNF: tl.constexpr,
                         HAS_INIT: tl.constexpr, HAS_FINAL: tl.constexpr, HAS_D: tl.constexpr, D_HP: tl.constexpr,
                         HAS_Z: tl.constexpr, IS_VARLEN: tl.constexpr, FACT: tl.constexpr, S_BF16: tl.constexpr,
                         DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """No-grad forward in one pass per (p-block, head, sequence): walk the chunks in order with the state
    S (BP, N) in registers (float32); per chunk, each row block's output uses S (rounded to the dot dtype,
    as the stored states of the two-kernel path) and adds its rows' share sum_l w_l x_l B_l^T to the next
    state, from the x tile it already loaded. No chunk states are written or read, x is read once."""
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_p = pid_p * BP + tl.arange(0, BP)
    pmask = offs_p < P
    offs_n = tl.arange(0, BNF)
    nmask = offs_n < N
    pn_mask = pmask[:, None] & nmask[None, :]
    pn_off = offs_p[:, None] * N + offs_n[None, :]
    g = h // R
    b, t_begin, seqlen, c_begin, n_chunks = _seq_coords(pid_s, T, NC, cu_ptr, chunk_first_ptr, IS_VARLEN)
    if HAS_INIT:
        S = tl.load(init_ptr + (pid_s * H + h) * P * N + pn_off, mask=pn_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BP, BNF), dtype=tl.float32)
    x_base = x_ptr + b * s_x_b + h * s_x_h
    B_base = B_ptr + b * s_B_b + g * s_B_g
    C_base = C_ptr + b * s_B_b + g * s_B_g
    for i in range(0, n_chunks):
        c = c_begin + i
        t0 = t_begin + i * L
        clen = tl.minimum(L, seqlen - i * L)
        tok0 = h * BT + b * T + t0
        a = tl.load(cs_ptr + tok0 + clen - 1)
        if S_BF16:  # the two-kernel path stores the chunk states in bfloat16 for bfloat16 inputs
            St = tl.trans(S.to(tl.bfloat16).to(DOT_DT))  # (BNF, BP)
        else:
            St = tl.trans(S.to(DOT_DT))
        cb_base = CB_ptr + (c.to(tl.int64) * G + g) * L * L
        upd = tl.zeros((BP, BNF), dtype=tl.float32)
        for mb in range(0, tl.cdiv(clen, BM)):
            m0 = mb * BM
            acc, xm = _scan_rows(x_base, C_base, cb_base, cs_ptr, dtp_ptr, D_ptr, tok0, t0, clen, m0, h,
                                 St, offs_p, pmask, offs_n, nmask, P, s_x_t, s_B_t,
                                 L, BM, BM, HAS_D, D_HP, FACT, DOT_DT, DOT_PREC)
            rows_m = m0 + tl.arange(0, BM)
            mmask = rows_m < clen
            _store_y(y_ptr, y_ptr, z_ptr, acc, b, t0, h, rows_m, mmask, offs_p, pmask, T, H, P,
                     s_z_b, s_z_t, s_z_h, HAS_Z, False)
            cs_m = tl.load(cs_ptr + tok0 + rows_m, mask=mmask, other=0.0)
            dt_m = tl.load(dtp_ptr + tok0 + rows_m, mask=mmask, other=0.0)
            w = tl.where(mmask, tl.exp(a - cs_m) * dt_m, 0.0)
            Bm = tl.load(B_base + (t0 + rows_m[:, None]) * s_B_t + offs_n[None, :],
                         mask=mmask[:, None] & nmask[None, :], other=0.0).to(DOT_DT)
            xw = (xm.to(tl.float32) * w[:, None]).to(DOT_DT)
            upd = tl.dot(tl.trans(xw), Bm, upd, input_precision=DOT_PREC)
        S = tl.exp(a) * S + upd
    if HAS_FINAL:
        tl.store(final_ptr + (pid_s * H + h) * P * N + pn_off, S, mask=pn_mask)


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
def dstate_bwd_kernel(dy_ptr, C_ptr, cs_ptr, states_ptr, dfinal_ptr, dstates_ptr, dinit_ptr, passing_ptr,
                      cu_ptr, chunk_first_ptr,
                      T, H, P, N, NC, BT, R,
                      s_dy_b, s_dy_t, s_dy_h, s_B_b, s_B_t, s_B_g, s_sp, s_sn,
                      L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      HAS_DFINAL: tl.constexpr, HAS_INIT: tl.constexpr, IS_VARLEN: tl.constexpr,
                      DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """Per (sequence, head, p-block x n-block): walk the chunks backwards carrying G = dLoss/dS."""
    pid_s = tl.program_id(0)
    h = tl.program_id(1)
    pid_pn = tl.program_id(2)
    n_pn = tl.num_programs(2)
    n_nb = tl.cdiv(N, BN)
    offs_p = (pid_pn // n_nb) * BP + tl.arange(0, BP)
    offs_n = (pid_pn % n_nb) * BN + tl.arange(0, BN)
    pn_mask = (offs_p[:, None] < P) & (offs_n[None, :] < N)
    pn_off = offs_p[:, None] * N + offs_n[None, :]
    g = h // R
    b, t_begin, seqlen, c_begin, n_chunks = _seq_coords(pid_s, T, NC, cu_ptr, chunk_first_ptr, IS_VARLEN)
    dtype = DOT_DT
    if HAS_DFINAL:
        G = tl.load(dfinal_ptr + (pid_s * H + h) * P * N + pn_off, mask=pn_mask, other=0.0).to(tl.float32)
    else:
        G = tl.zeros((BP, BN), dtype=tl.float32)
    dy_base = dy_ptr + b * s_dy_b + h * s_dy_h
    C_base = C_ptr + b * s_B_b + g * s_B_g
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
        S = tl.load(states_ptr + (c.to(tl.int64) * H + h) * P * N + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn,
                    mask=pn_mask, other=0.0).to(tl.float32)
        tl.store(passing_ptr + (c.to(tl.int64) * H + h) * n_pn + pid_pn, tl.sum(tl.sum(G * S, 1), 0) * ea)
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
def dcb_bwd_kernel(dy_ptr, x_ptr, dtp_ptr, cs_ptr, CB_ptr, Q_ptr, dda_ptr, tot_ptr, chunk_t0_ptr, chunk_len_ptr,
                   T, H, P, NC, BT, R, G,
                   s_dy_b, s_dy_t, s_dy_h, s_x_b, s_x_t, s_x_h,
                   L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BPF: tl.constexpr,
                   IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr, QONLY: tl.constexpr = False):
    """Q[m, l] = sum over the group's heads of (dy_m . x_l) e^{cs_m - cs_l} dt_l for l <= m (float32), and
    (unless QONLY: dx_bwd computes it) per head the intra-chunk part of d(dt*A) in its stable form: with
    M = Q_h * CB,
        dda_l = sum_{m >= l} sum_{s < l} M[m, s]
    (no difference of large row and column sums). A token of row block j gets exactly one share per row
    block s of the chunk (s > j: the column part of tile (s, j), prefix sums of its column sums; s == j: the
    diagonal tile; s < j: the row part of tile (j, s), suffix sums of its row sums), stored in dda slot s
    ((L // BM, H, B*T) buffer); each tile's total goes to tot[(chunk, head), m block, k block] and dt_bwd adds
    the totals of the tiles (mb, kb) with kb < j < mb to block j. No atomics.
    Grid (tile, group, chunk): a chunk's tiles run together and share its dy / x rows through L2."""
    pid_mk = tl.program_id(0)
    g = tl.program_id(1)
    pid_c = tl.program_id(2)
    n_kb = L // BK
    m0 = (pid_mk // n_kb) * BM
    k0 = (pid_mk % n_kb) * BK
    b, t0, clen = _chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if (m0 >= clen) | (k0 >= m0 + BM):
        return
    rows_m = m0 + tl.arange(0, BM)
    rows_k = k0 + tl.arange(0, BK)
    mmask = rows_m < clen
    kmask = rows_k < clen
    offs_p = tl.arange(0, BPF)
    pmask = offs_p < P
    dtype = DOT_DT
    causal = (rows_m[:, None] >= rows_k[None, :]) & kmask[None, :] & mmask[:, None]
    NMB: tl.constexpr = L // BM
    HBT = H.to(tl.int64) * BT
    acc = tl.zeros((BM, BK), dtype=tl.float32)
    if QONLY:
        if k0 == m0:
            for hh in range(0, R):
                acc += _dcb_q_head(dy_ptr, x_ptr, cs_ptr, dtp_ptr, g * R + hh, b, t0, BT, T, k0, rows_m, rows_k, mmask,
                                   kmask, causal, offs_p, pmask, s_dy_b, s_dy_t, s_dy_h, s_x_b, s_x_t, s_x_h, BK, True,
                                   dtype, DOT_PREC)
        else:
            for hh in range(0, R):
                acc += _dcb_q_head(dy_ptr, x_ptr, cs_ptr, dtp_ptr, g * R + hh, b, t0, BT, T, k0, rows_m, rows_k, mmask,
                                   kmask, causal, offs_p, pmask, s_dy_b, s_dy_t, s_dy_h, s_x_b, s_x_t, s_x_h, BK, False,
                                   dtype, DOT_PREC)
    else:
        cbt = tl.load(CB_ptr + (pid_c.to(tl.int64) * G + g) * L * L + rows_m[:, None] * L + rows_k[None, :], mask=causal,
                      other=0.0).to(tl.float32)
        for hh in range(0, R):
            h = g * R + hh
            tok0 = h * BT + b * T + t0
            dym = tl.load(dy_ptr + b * s_dy_b + h * s_dy_h + (t0 + rows_m[:, None]) * s_dy_t + offs_p[None, :],
                          mask=mmask[:, None] & pmask[None, :], other=0.0).to(dtype)
            xk = tl.load(x_ptr + b * s_x_b + h * s_x_h + (t0 + rows_k[:, None]) * s_x_t + offs_p[None, :],
                         mask=kmask[:, None] & pmask[None, :], other=0.0).to(dtype)
            qq = tl.dot(dym, tl.trans(xk), input_precision=DOT_PREC)
            cs_m = tl.load(cs_ptr + tok0 + rows_m, mask=mmask, other=0.0)
            cs_k = tl.load(cs_ptr + tok0 + rows_k, mask=kmask, other=0.0)
            dt_k = tl.load(dtp_ptr + tok0 + rows_k, mask=kmask, other=0.0)
            decay = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")))
            contrib = qq * decay * dt_k[None, :]
            acc += contrib
            M = contrib * cbt
            if k0 == m0:  # diagonal tile: sum_{m >= l} sum_{s < l} M[m, s] for l in the block
                prefix = tl.cumsum(M, axis=1) - M  # [m, l] = sum_{s < l} M[m, s]
                F = tl.sum(tl.where(rows_m[:, None] >= rows_k[None, :], prefix, 0.0), 0)
                tl.store(dda_ptr + (m0 // BM).to(tl.int64) * HBT + tok0 + rows_k, F, mask=kmask)
            else:
                colsum = tl.sum(M, 0)
                rowsum = tl.sum(M, 1)
                total = tl.sum(rowsum, 0)
                tl.store(dda_ptr + (m0 // BM).to(tl.int64) * HBT + tok0 + rows_k, tl.cumsum(colsum, 0) - colsum,
                         mask=kmask)
                tl.store(dda_ptr + (k0 // BK).to(tl.int64) * HBT + tok0 + rows_m,
                         total - tl.cumsum(rowsum, 0) + rowsum, mask=mmask)
                tl.store(tot_ptr + ((pid_c.to(tl.int64) * H + h) * NMB + m0 // BM) * NMB + k0 // BK, total)
    q_base = Q_ptr + (pid_c.to(tl.int64) * G + g) * L * L
    tl.store(q_base + rows_m[:, None] * L + rows_k[None, :], acc)


@triton.jit
def dbdc_bwd_kernel(dy_ptr, x_ptr, B_ptr, C_ptr, dtp_ptr, cs_ptr, states_ptr, dstates_ptr, Q_ptr, dB_ptr, dC_ptr,
                    chunk_t0_ptr, chunk_len_ptr,
                    T, H, P, N, NC, BT, R, G,
                    s_dy_b, s_dy_t, s_dy_h, s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g, s_sp, s_sn,
                    L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BPF: tl.constexpr, BN: tl.constexpr,
                    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr,
                    dcs_ptr=None, DCS: tl.constexpr = False):
    """Per (chunk, group, m-block x n-block): dC = sum_h e^{cs} dy S + Q B, dB = sum_h w x G' + Q^T C.
    DCS: also each head's dcs_m = dy_m . y_off_m = sum_n C_mn (e^{cs_m} dy_m S)_n from the dC product it forms
    anyway (dx_bwd then skips its C S^T product), the part of the n block in its slot of dcs ((n blocks, H, B*T))."""
    pid_c = tl.program_id(0)
    g = tl.program_id(1)
    pid_mn = tl.program_id(2)
    n_nb = tl.cdiv(N, BN)
    m0 = (pid_mn // n_nb) * BM
    offs_n = (pid_mn % n_nb) * BN + tl.arange(0, BN)
    b, t0, clen = _chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
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
    if DCS:
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
        S = tl.load(states_ptr + (pid_c.to(tl.int64) * H + h) * P * N + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn,
                    mask=pn, other=0.0).to(dtype)
        Gd = tl.load(dstates_ptr + st_off, mask=pn, other=0.0).to(dtype)
        e_m = tl.where(mmask, tl.exp(cs_m), 0.0)
        w_m = tl.where(mmask, tl.exp(a - cs_m) * dt_m, 0.0)
        if DCS:
            tC = tl.dot((dym * e_m[:, None]).to(dtype), S, input_precision=DOT_PREC)
            acc_dC += tC
            tl.store(dcs_ptr + (pid_mn % n_nb) * (H.to(tl.int64) * BT) + tok0 + rows_m, tl.sum(tC * Cm, 1),
                     mask=mmask)
        else:
            acc_dC = tl.dot((dym * e_m[:, None]).to(dtype), S, acc_dC, input_precision=DOT_PREC)
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
    out_off = (b * T + t0 + rows_m[:, None]) * (G * N) + g * N + offs_n[None, :]
    mn = mmask[:, None] & nmask[None, :]
    tl.store(dB_ptr + out_off, acc_dB.to(dB_ptr.dtype.element_ty), mask=mn)
    tl.store(dC_ptr + out_off, acc_dC.to(dC_ptr.dtype.element_ty), mask=mn)


@triton.jit
def _dx_tile(dxi, xld, cb_base, cs_ptr, dy_base, dda_ptr, tot_ptr, tok0, t0, clen, l0, k, rows_l, lmask, cs_l, dt_l,
             c2, w2, offs_p, pmask, s_dy_t, HBT, pid_c, h, H,
             L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, NMB: tl.constexpr, DIAG: tl.constexpr,
             DDA: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr, FACT: tl.constexpr):
    """One k block (rows m) of dx_bwd for the rows l: dxi += (CB^T * decay) dy_k. DDA: with x_l . dy_m
    (xld = x_l) the transposed tile M^T[l, m] = M[m, l] of dcb_bwd (M = Q_h * CB) gives the same
    d(dt*A) shares as dcb_bwd: on the diagonal block (DIAG) the stable sum_{m >= l} sum_{s < l},
    else the column part (slot of block m, rows l), the row part (slot of block l, rows m) and the tile total.
    Below the diagonal, FACT 1 factorises the decay through the row before the k block; FACT 2 through the l
    block's last row c2 (the same for all of its k blocks): the caller scales the sum of these tiles by
    e^{c2 - cs_l} once, and w2 = dt_l e^{c2 - cs_l} weighs the d(dt*A) shares."""
    rows_k = k + tl.arange(0, BK)
    kmask = rows_k < clen
    cs_k = tl.load(cs_ptr + tok0 + rows_k, mask=kmask, other=0.0)
    if DIAG or not FACT:
        causal = (rows_k[None, :] >= rows_l[:, None]) & kmask[None, :]
        # [l, m] = C_m . B_l; the diagonal tile is stored whole by dtcb_fwd (finite where decay is 0): no causal
        # mask on the load, so it vectorises
        cbT = tl.load(cb_base + rows_k[None, :] * L + rows_l[:, None], mask=kmask[None, :] & lmask[:, None],
                      other=0.0).to(tl.float32)
        decay = tl.exp(tl.where(causal, cs_k[None, :] - cs_l[:, None], float("-inf")))
        dyk = tl.load(dy_base + (t0 + rows_k[:, None]) * s_dy_t + offs_p[None, :],
                      mask=kmask[:, None] & pmask[None, :], other=0.0).to(DOT_DT)
        cbd = cbT * decay
    else:
        # below the diagonal every l precedes every m: e^{cs_m - cs_l} = e^{cs_m - c} e^{c - cs_l} through a row
        # c between them (both exponents <= 0), on the dy rows and the C.B columns (FACT 1: c = the row before
        # the k block) or the rows of dx (FACT 2: c = c2): no exponential per tile element
        if FACT == 2:
            c = c2
        else:
            c = tl.load(cs_ptr + tok0 + k - 1)
        ek = tl.where(kmask, tl.exp(cs_k - c), 0.0)
        cbT = tl.load(cb_base + rows_k[None, :] * L + rows_l[:, None], mask=kmask[None, :] & lmask[:, None],
                      other=0.0).to(tl.float32)
        if FACT == 2:
            cbd = cbT
        else:
            cbd = cbT * tl.exp(c - cs_l)[:, None]
        dyk = (tl.load(dy_base + (t0 + rows_k[:, None]) * s_dy_t + offs_p[None, :],
                       mask=kmask[:, None] & pmask[None, :], other=0.0).to(tl.float32) * ek[:, None]).to(DOT_DT)
    dxi = tl.dot(cbd.to(DOT_DT), dyk, dxi, input_precision=DOT_PREC)
    if DDA:
        if FACT == 2 and not DIAG:
            wl = w2
        else:
            wl = dt_l
        MT = tl.dot(xld, tl.trans(dyk), input_precision=DOT_PREC) * cbd * wl[:, None]  # [l, m] = M[m, l]
        if DIAG:
            pre = tl.cumsum(MT, axis=0) - MT  # [l, m] = sum_{s < l} M[m, s]
            F = tl.sum(tl.where(rows_k[None, :] >= rows_l[:, None], pre, 0.0), 1)
            tl.store(dda_ptr + (l0 // BM).to(tl.int64) * HBT + tok0 + rows_l, F, mask=lmask)
        else:
            col = tl.sum(MT, 1)  # per l: sum_m M[m, l]
            row = tl.sum(MT, 0)  # per m: sum_l M[m, l]
            total = tl.sum(col, 0)
            tl.store(dda_ptr + (k // BK) * HBT + tok0 + rows_l, tl.cumsum(col, 0) - col, mask=lmask)
            tl.store(dda_ptr + (l0 // BM).to(tl.int64) * HBT + tok0 + rows_k, total - tl.cumsum(row, 0) + row,
                     mask=kmask)
            tl.store(tot_ptr + ((pid_c.to(tl.int64) * H + h) * NMB + k // BK) * NMB + l0 // BM, total)
    return dxi


@triton.jit
def dx_bwd_kernel(dy_ptr, x_ptr, B_ptr, C_ptr, CB_ptr, dtp_ptr, cs_ptr, states_ptr, dstates_ptr, D_ptr,
                  dx_ptr, ddt_ptr, dcs_ptr, q_ptr, dD_ptr, chunk_t0_ptr, chunk_len_ptr,
                  T, H, P, N, NC, BT, R, G,
                  s_dy_b, s_dy_t, s_dy_h, s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g, s_sp, s_sn,
                  L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BPF: tl.constexpr, BNF: tl.constexpr,
                  HAS_D: tl.constexpr, D_HP: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr,
                  dda_ptr=None, tot_ptr=None, DDA: tl.constexpr = False, FACT: tl.constexpr = 1,
                  DCS: tl.constexpr = True):
    """Per (chunk, head, l-block): dx, the direct ddt, the per-row dcs and state terms, dD partial sums.
    DDA: also the intra-chunk d(dt*A) shares of dcb_bwd (see _dx_tile), so that dcb_bwd only sums Q (QONLY).
    Grid (l-block, head, chunk): a (chunk, head)'s row blocks and then a chunk's heads run together (dy
    tiles, chunk states and the group's C.B / B / C rows come from L2)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    pid_c = tl.program_id(2)
    l0 = pid_m * BM
    b, t0, clen = _chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if l0 >= clen:
        return
    g = h // R
    dtype = DOT_DT
    tok0 = h * BT + b * T + t0
    rows_l = l0 + tl.arange(0, BM)
    lmask = rows_l < clen
    offs_p = tl.arange(0, BPF)
    pmask = offs_p < P
    offs_n = tl.arange(0, BNF)
    nmask = offs_n < N
    B_base = B_ptr + b * s_B_b + g * s_B_g
    cb_base = CB_ptr + (pid_c.to(tl.int64) * G + g) * L * L
    dy_base = dy_ptr + b * s_dy_b + h * s_dy_h
    x_base = x_ptr + b * s_x_b + h * s_x_h
    cs_l = tl.load(cs_ptr + tok0 + rows_l, mask=lmask, other=0.0)
    dt_l = tl.load(dtp_ptr + tok0 + rows_l, mask=lmask, other=0.0)
    a = tl.load(cs_ptr + tok0 + clen - 1)
    dxi = tl.zeros((BM, BPF), dtype=tl.float32)
    if FACT == 2:
        c2 = tl.load(cs_ptr + tok0 + tl.minimum(l0 + BM, clen) - 1)  # the l block's last row
        el2 = tl.exp(c2 - cs_l)  # <= 1 (masked rows: cs_l = 0 >= c2)
        w2 = dt_l * el2
    else:
        c2 = 0.0
        el2 = dt_l
        w2 = dt_l
    NMB: tl.constexpr = L // BM  # the d(dt*A) slots / tile totals (used with DDA only)
    if DDA:
        HBT = H.to(tl.int64) * BT
        xld = tl.load(x_base + (t0 + rows_l[:, None]) * s_x_t + offs_p[None, :],
                      mask=lmask[:, None] & pmask[None, :], other=0.0).to(dtype)
    else:  # unused
        HBT = H.to(tl.int64) * 0
        xld = dxi
    if FACT != 2:
        dxi = _dx_tile(dxi, xld, cb_base, cs_ptr, dy_base, dda_ptr, tot_ptr, tok0, t0, clen, l0, l0, rows_l, lmask,
                       cs_l, dt_l, c2, w2, offs_p, pmask, s_dy_t, HBT, pid_c, h, H, L, BM, BK, NMB, True, DDA, dtype,
                       DOT_PREC, FACT)
    for k in range(l0 + BK, clen, BK):
        dxi = _dx_tile(dxi, xld, cb_base, cs_ptr, dy_base, dda_ptr, tot_ptr, tok0, t0, clen, l0, k, rows_l, lmask,
                       cs_l, dt_l, c2, w2, offs_p, pmask, s_dy_t, HBT, pid_c, h, H, L, BM, BK, NMB, False, DDA, dtype,
                       DOT_PREC, FACT)
    if FACT == 2:  # the tiles below the diagonal first, scaled once, then the diagonal tile
        dxi = dxi * el2[:, None]
        dxi = _dx_tile(dxi, xld, cb_base, cs_ptr, dy_base, dda_ptr, tot_ptr, tok0, t0, clen, l0, l0, rows_l, lmask,
                       cs_l, dt_l, c2, w2, offs_p, pmask, s_dy_t, HBT, pid_c, h, H, L, BM, BK, NMB, True, DDA, dtype,
                       DOT_PREC, FACT)
    Bl = tl.load(B_base + (t0 + rows_l[:, None]) * s_B_t + offs_n[None, :], mask=lmask[:, None] & nmask[None, :],
                 other=0.0).to(dtype)
    Gd = tl.load(dstates_ptr + (pid_c.to(tl.int64) * H + h) * P * N + offs_p[None, :] * N + offs_n[:, None],
                 mask=pmask[None, :] & nmask[:, None], other=0.0).to(dtype)  # (BNF, BPF) = G^T
    dxs = tl.dot(Bl, Gd, input_precision=DOT_PREC) * tl.where(lmask, tl.exp(a - cs_l), 0.0)[:, None]
    lp = lmask[:, None] & pmask[None, :]
    xl = tl.load(x_base + (t0 + rows_l[:, None]) * s_x_t + offs_p[None, :], mask=lp, other=0.0).to(tl.float32)
    tl.store(q_ptr + tok0 + rows_l, tl.sum(xl * dxs, 1) * dt_l, mask=lmask)
    t = dxs + dxi
    tl.store(ddt_ptr + tok0 + rows_l, tl.sum(xl * t, 1), mask=lmask)
    dx = dt_l[:, None] * t
    if HAS_D or DCS:
        dyl = tl.load(dy_base + (t0 + rows_l[:, None]) * s_dy_t + offs_p[None, :], mask=lp, other=0.0).to(tl.float32)
    if HAS_D:
        if D_HP:
            Dv = tl.load(D_ptr + h * P + offs_p, mask=pmask, other=0.0).to(tl.float32)[None, :]
        else:
            Dv = tl.load(D_ptr + h).to(tl.float32)
        dx = dx + Dv * dyl
        if D_HP:
            tl.store(dD_ptr + ((pid_c.to(tl.int64) * tl.cdiv(L, BM) + pid_m) * H + h) * P + offs_p,
                     tl.sum(dyl * xl, 0), mask=pmask)
        else:  # one D per head: one partial sum per program (a small reduction on the host side)
            tl.store(dD_ptr + (pid_c.to(tl.int64) * tl.cdiv(L, BM) + pid_m) * H + h, tl.sum(tl.sum(dyl * xl, 0), 0))
    tl.store(dx_ptr + (b * T + t0 + rows_l[:, None]) * (H * P) + h * P + offs_p[None, :],
             dx.to(dx_ptr.dtype.element_ty), mask=lp)
    if DCS:
        # y_off = e^{cs_l} S C_l in float32 from the stored state (for dcs; the intra part comes from dcb_bwd)
        Cl = tl.load(C_ptr + b * s_B_b + g * s_B_g + (t0 + rows_l[:, None]) * s_B_t + offs_n[None, :],
                     mask=lmask[:, None] & nmask[None, :], other=0.0).to(dtype)
        St = tl.load(states_ptr + (pid_c.to(tl.int64) * H + h) * P * N + offs_p[None, :] * s_sp + offs_n[:, None] * s_sn,
                     mask=pmask[None, :] & nmask[:, None], other=0.0).to(dtype)  # (BNF, BPF) = S^T
        yoff = tl.dot(Cl, St, input_precision=DOT_PREC) * tl.where(lmask, tl.exp(cs_l), 0.0)[:, None]
        tl.store(dcs_ptr + tok0 + rows_l, tl.sum(dyl * yoff, 1), mask=lmask)


@triton.jit
def dt_bwd_kernel(dt_ptr, bias_ptr, A_ptr, dtp_ptr, ddt_dir_ptr, dcs_ptr, dda_ptr, tot_ptr, q_ptr, passing_ptr,
                  ddt_out_ptr, dA_part_ptr, dbias_part_ptr, chunk_t0_ptr, chunk_len_ptr,
                  T, H, NC, BT, NPN, s_dt_b, s_dt_t, dt_lo, dt_hi,
                  L: tl.constexpr, BH: tl.constexpr, NPN_B: tl.constexpr, HAS_BIAS: tl.constexpr,
                  SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, IS_VARLEN: tl.constexpr, BMB: tl.constexpr,
                  NDCS: tl.constexpr = 1):
    """Per (chunk, head block): d(dt*A)_l = sum_{k>=l} dy_k.y_off_k + sum_{k<l} q_k + <G_{c+1}, e^a S_c>
    + the intra-chunk part from dcb_bwd / dx_bwd (its per-row-block slots and tile totals, row blocks of BMB
    rows); then ddt = ddt_direct + A d(dt*A), back through clamp/softplus/bias."""
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    b, t0, clen = _chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if clen <= 0:
        return
    rows = tl.arange(0, L)
    heads = pid_h * BH + tl.arange(0, BH)
    hmask = heads < H
    mask = (rows[:, None] < clen) & hmask[None, :]
    off = heads[None, :] * BT + b * T + t0 + rows[:, None]
    NMB: tl.constexpr = L // BMB
    HBT = H.to(tl.int64) * BT
    dcs = tl.load(dcs_ptr + off, mask=mask, other=0.0)
    for s in tl.static_range(1, NDCS):  # dbdc_bwd's partial sums per n block
        dcs += tl.load(dcs_ptr + s * HBT + off, mask=mask, other=0.0)
    dda_intra = tl.zeros((L, BH), dtype=tl.float32)
    for s in tl.static_range(NMB):  # slot s exists where the chunk has row block s (tile (s, j) ran)
        dda_intra += tl.load(dda_ptr + s * HBT + off, mask=mask & (rows[:, None] * 0 + s * BMB < clen), other=0.0)
    blk = rows // BMB
    for mb in tl.static_range(2, NMB):  # tile (mb, kb)'s total reaches the row blocks strictly between
        for kb in tl.static_range(0, mb - 1):
            tot = tl.load(tot_ptr + ((pid_c.to(tl.int64) * H + heads) * NMB + mb) * NMB + kb,
                          mask=hmask & (heads * 0 + mb * BMB < clen), other=0.0)
            dda_intra += tl.where((blk[:, None] > kb) & (blk[:, None] < mb), tot[None, :], 0.0)
    q = tl.load(q_ptr + off, mask=mask, other=0.0)
    ddt = tl.load(ddt_dir_ptr + off, mask=mask, other=0.0)
    dtp = tl.load(dtp_ptr + off, mask=mask, other=0.0)
    offs_pn = tl.arange(0, NPN_B)
    pas = tl.load(passing_ptr + (pid_c.to(tl.int64) * H + heads[:, None]) * NPN + offs_pn[None, :],
                  mask=hmask[:, None] & (offs_pn[None, :] < NPN), other=0.0)
    ddA = tl.sum(dcs, 0)[None, :] - tl.cumsum(dcs, axis=0) + dcs  # suffix sums of dy.y_off
    ddA += tl.cumsum(q, axis=0) - q + tl.sum(pas, 1)[None, :]  # state terms
    ddA += dda_intra
    ddA = tl.where(mask, ddA, 0.0)
    A = tl.load(A_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
    ddt = ddt + A[None, :] * ddA
    tl.store(dA_part_ptr + pid_c * H + heads, tl.sum(dtp * ddA, 0), mask=hmask)
    raw = tl.load(dt_ptr + b * s_dt_b + (t0 + rows[:, None]) * s_dt_t + heads[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(bias_ptr + heads, mask=hmask, other=0.0).to(tl.float32)[None, :]
    v = raw
    if SOFTPLUS:
        v = _softplus(raw)
    if HAS_LIMIT:
        ddt = tl.where((v >= dt_lo) & (v <= dt_hi), ddt, 0.0)
    if SOFTPLUS:
        ddt = tl.where(raw > 20.0, ddt, ddt * tl.sigmoid(raw))
    ddt = tl.where(mask, ddt, 0.0)
    tl.store(ddt_out_ptr + b * s_dt_b + (t0 + rows[:, None]) * s_dt_t + heads[None, :],
             ddt.to(ddt_out_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(dbias_part_ptr + pid_c * H + heads, tl.sum(ddt, 0), mask=hmask)
