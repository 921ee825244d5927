"""Forward: the outputs, y = e^{cs} C S^T + causal(C.B * decay * dt) x + D x, then the z gate (notation:
kernel_common.py), and for the folded gated norm (lm_kernels.mamba2) each row's sum of squares of the gated output
per head. chunk_scan_fwd4_kernel takes a whole chunk of two or four row blocks per program (chunk 128 or 256 with
64-row tiles: 16-bit inputs); chunk_scan_fwd2_kernel one row block per program (other chunk sizes, float32)."""
import triton
import triton.language as tl

from .kernel_common import chunk_coords



@triton.jit
def _scan_rows(x_base, C_base, cb_base, cs_ptr, dtp_ptr, D_ptr, tok0, t0, clen, m0, h, St, offs_p, pmask, offs_n,
               nmask, P, s_x_t, s_B_t,
               L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HAS_D: tl.constexpr, D_HP: tl.constexpr,
               DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """y rows m0..m0+BM of one chunk and head (before the z gate), float32 (BM, BP):
        y_m = e^{cs_m} C_m S^T + sum_{k <= m} CB[m, k] e^{cs_m - cs_k} dt_k x_k + D x_m,   St = S^T (BNF, BP).
    Blocks strictly below the diagonal (k < m0 <= m, BK divides BM) need no mask, and their decay goes to the x
    rows: with r = m0 - 1 (the row before the block), e^{cs_m - cs_k} = e^{cs_m - cs_r} e^{cs_r - cs_k} (both
    exponents <= 0, so underflow is the worst case), the raw C.B tile is the A operand, x_k dt_k e^{cs_r - cs_k}
    the B operand, and one row factor e^{cs_m - cs_r} scales the sum of the state term (started at
    e^{cs_r} C_m S^T) and the below-diagonal tiles. The diagonal block keeps the exact masked decay."""
    rows_m = m0 + tl.arange(0, BM)
    mmask = rows_m < clen
    cs_m = tl.load(cs_ptr + tok0 + rows_m, mask=mmask, other=0.0)
    Cm = tl.load(C_base + (t0 + rows_m[:, None]) * s_B_t + offs_n[None, :], mask=mmask[:, None] & nmask[None, :],
                 other=0.0).to(DOT_DT)
    cs_r = tl.load(cs_ptr + tok0 + m0 - 1, mask=m0 > 0, other=0.0)  # m0 == 0: cs_r = 0, no tiles below
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
    if BK == BM:  # one diagonal block; its x tile is x_m (reused for D)
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
    return acc


@triton.jit
def _store_y(y_ptr, ypre_ptr, z_ptr, za_ptr, ss_ptr, acc, b, t0, h, rows_m, mmask, offs_p, pmask, T, H, s_y_b, s_y_t,
             s_y_h, s_z_b, s_z_t, s_z_h, s_za_b, s_za_t, HAS_Z: tl.constexpr, STORE_PRE: tl.constexpr,
             HAS_ZADD: tl.constexpr, STORE_SS: tl.constexpr):
    """y (gated by z (+ z_add, the sum rounded to z's dtype as the gated norm rounds it) with HAS_Z), the pre-gate
    output (STORE_PRE) and with STORE_SS each row's sum of squares of the gated output over the head's P columns
    (the tile holds them all: BP >= P), from the pre-gate output rounded to its stored dtype: what the gated norm
    would read back (the folded norm, lm_kernels.mamba2). y and the pre-gate output share their batch / time / head
    strides (s_y_*); z_add has z's head stride, its own batch / time strides; the sums of squares are (b * t, H)
    float32, contiguous."""
    mp_mask = mmask[:, None] & pmask[None, :]
    y_base = b.to(tl.int64) * s_y_b + h * s_y_h  # (a scalar: the tile's offsets below stay 32-bit)
    y_off = (t0 + rows_m[:, None]) * s_y_t + offs_p[None, :]
    if STORE_PRE:
        tl.store(ypre_ptr + y_base + y_off, acc.to(ypre_ptr.dtype.element_ty), mask=mp_mask)
    if HAS_Z:
        z_off = b * s_z_b + (t0 + rows_m[:, None]) * s_z_t + h * s_z_h + offs_p[None, :]
        zv = tl.load(z_ptr + z_off, mask=mp_mask, other=0.0).to(tl.float32)
        if HAS_ZADD:
            za_off = b * s_za_b + (t0 + rows_m[:, None]) * s_za_t + h * s_z_h + offs_p[None, :]
            zv = (zv + tl.load(za_ptr + za_off, mask=mp_mask, other=0.0).to(tl.float32)).to(
                z_ptr.dtype.element_ty).to(tl.float32)
        if STORE_SS:
            acc = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        acc = acc * zv * tl.sigmoid(zv)
        if STORE_SS:
            row = (b * T + t0 + rows_m).to(tl.int64)
            tl.store(ss_ptr + row * H + h, tl.sum(tl.where(mp_mask, acc * acc, 0.0), 1), mask=mmask)
    tl.store(y_ptr + y_base + y_off, acc.to(y_ptr.dtype.element_ty), mask=mp_mask)


@triton.jit
def chunk_scan_fwd2_kernel(x_ptr, CB_ptr, C_ptr, dtp_ptr, cs_ptr, states_ptr, D_ptr, z_ptr, za_ptr, ss_ptr, y_ptr,
                           ypre_ptr, chunk_t0_ptr, chunk_len_ptr,
                           T, H, P, N, NC, BT, R, G,
                           s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g, s_z_b, s_z_t, s_z_h, s_za_b, s_za_t,
                           s_y_b, s_y_t, s_y_h,
                           L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                           BNF: tl.constexpr, HAS_D: tl.constexpr, D_HP: tl.constexpr, HAS_Z: tl.constexpr,
                           STORE_PRE: tl.constexpr, HAS_ZADD: tl.constexpr, STORE_SS: tl.constexpr,
                           IS_VARLEN: tl.constexpr,
                           DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """One row block (_scan_rows) per program, grid (m-block x p-block, head, chunk): the row blocks of one
    (chunk, head) run next to each other (x tiles and the chunk's start state are re-read from L2, not HBM),
    then the heads of the chunk (the group's C rows and CB tiles stay in L2); row blocks run heaviest first."""
    pid_mp = tl.program_id(0)
    h = tl.program_id(1)
    pid_c = tl.program_id(2)
    n_pb = tl.cdiv(P, BP)
    n_mb = tl.cdiv(L, BM)
    m0 = (n_mb - 1 - pid_mp // n_pb) * BM
    offs_p = (pid_mp % n_pb) * BP + tl.arange(0, BP)
    b, t0, clen = chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
    if m0 >= clen:
        return
    g = h // R
    tok0 = h * BT + b * T + t0
    offs_n = tl.arange(0, BNF)
    nmask = offs_n < N
    pmask = offs_p < P
    St = tl.load(states_ptr + (pid_c.to(tl.int64) * H + h) * P * N + offs_p[None, :] * N + offs_n[:, None],
                 mask=pmask[None, :] & nmask[:, None], other=0.0).to(DOT_DT)  # (BNF, BP) = S^T
    acc = _scan_rows(x_ptr + b * s_x_b + h * s_x_h, C_ptr + b * s_B_b + g * s_B_g,
                         CB_ptr + (pid_c.to(tl.int64) * G + g) * L * L, cs_ptr, dtp_ptr, D_ptr, tok0, t0, clen, m0, h,
                         St, offs_p, pmask, offs_n, nmask, P, s_x_t, s_B_t,
                         L, BM, BK, HAS_D, D_HP, DOT_DT, DOT_PREC)
    rows_m = m0 + tl.arange(0, BM)
    _store_y(y_ptr, ypre_ptr, z_ptr, za_ptr, ss_ptr, acc, b, t0, h, rows_m, rows_m < clen, offs_p, pmask, T, H,
             s_y_b, s_y_t, s_y_h, s_z_b, s_z_t, s_z_h, s_za_b, s_za_t, HAS_Z, STORE_PRE, HAS_ZADD, STORE_SS)


@triton.jit
def _fwd4_block(acc, cs_r, j, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, ypre_ptr, z_ptr, za_ptr, ss_ptr, b, t0,
               tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, s_y_b, s_y_t, s_y_h, s_z_b, s_z_t, s_z_h, s_za_b,
               s_za_t, L: tl.constexpr, BM: tl.constexpr, HAS_D: tl.constexpr, D_HP: tl.constexpr, HAS_Z: tl.constexpr,
               STORE_PRE: tl.constexpr, HAS_ZADD: tl.constexpr, STORE_SS: tl.constexpr, DOT_DT: tl.constexpr,
               DOT_PREC: tl.constexpr):
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
    # (the causal mask on the load: a row mask alone vectorises it but was slower on the H100)
    cb = tl.load(cb_base + rows[:, None] * L + rows[None, :], mask=causal, other=0.0).to(tl.float32)
    cb = cb * dec * dt_m[None, :]
    acc = tl.dot(cb.to(DOT_DT), xm.to(DOT_DT), acc, input_precision=DOT_PREC)
    if HAS_D:
        if D_HP:
            Dv = tl.load(D_ptr + h * P + offs_p, mask=pmask, other=0.0).to(tl.float32)[None, :]
        else:
            Dv = tl.load(D_ptr + h).to(tl.float32)
        acc += Dv * xm.to(tl.float32)
    _store_y(y_ptr, ypre_ptr, z_ptr, za_ptr, ss_ptr, acc, b, t0, h, rows, mmask, offs_p, pmask, T, H, s_y_b, s_y_t,
             s_y_h, s_z_b, s_z_t, s_z_h, s_za_b, s_za_t, HAS_Z, STORE_PRE, HAS_ZADD, STORE_SS)
    return xm, cs_m, dt_m


@triton.jit
def _fwd4_xt(xm, cs_m, dt_m, cs_ptr, tok0, j, BM: tl.constexpr, DOT_DT: tl.constexpr):
    """x~ of the full row block j relative to its own last row ref: x_k dt_k e^{cs_ref - cs_k} (factors <= 1);
    returns (x~ in the dot dtype, cs_ref)."""
    e = tl.load(cs_ptr + tok0 + j * BM + BM - 1)
    return (xm.to(tl.float32) * (tl.exp(e - cs_m) * dt_m)[:, None]).to(DOT_DT), e


@triton.jit
def _fwd4_cs_term(C_base, St, t0, clen, j, offs_n, nmask, s_B_t, BM: tl.constexpr, DOT_DT: tl.constexpr,
                 DOT_PREC: tl.constexpr):
    """C_m S^T for row block j (float32, unscaled)."""
    rows = j * BM + tl.arange(0, BM)
    Cm = tl.load(C_base + (t0 + rows[:, None]) * s_B_t + offs_n[None, :],
                 mask=(rows[:, None] < clen) & nmask[None, :], other=0.0).to(DOT_DT)
    return tl.dot(Cm, St, input_precision=DOT_PREC)


@triton.jit
def _fwd4_cb(cb_base, clen, m, k, L: tl.constexpr, BM: tl.constexpr, DOT_DT: tl.constexpr):
    """The raw C.B tile (row block m, k block k < m): every k row valid, m rows masked by the chunk length."""
    rows_m = m * BM + tl.arange(0, BM)
    rows_k = k * BM + tl.arange(0, BM)
    return tl.load(cb_base + rows_m[:, None] * L + rows_k[None, :], mask=(rows_m < clen)[:, None],
                   other=0.0).to(DOT_DT)


@triton.jit
def _fwd4_cb01(cb_base, clen, m, xt0, xt1, f1, L: tl.constexpr, BM: tl.constexpr, DOT_DT: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """Row block m >= 2: the first two Horner steps, CB[m, 0] x~_0 scaled by f1 = e^{cs_ref(1) - cs_ref(0)}
    plus CB[m, 1] x~_1."""
    acc = tl.dot(_fwd4_cb(cb_base, clen, m, 0, L, BM, DOT_DT), xt0, input_precision=DOT_PREC)
    return tl.dot(_fwd4_cb(cb_base, clen, m, 1, L, BM, DOT_DT), xt1, acc * f1, input_precision=DOT_PREC)


@triton.jit
def _fwd4_close(acc, e, m, C_base, St, offs_n, nmask, s_B_t, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, ypre_ptr,
                z_ptr, za_ptr, ss_ptr, b, t0, tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, s_y_b, s_y_t, s_y_h, s_z_b,
                s_z_t, s_z_h, s_za_b, s_za_t, L: tl.constexpr, BM: tl.constexpr, HAS_D: tl.constexpr,
                D_HP: tl.constexpr, HAS_Z: tl.constexpr, STORE_PRE: tl.constexpr, HAS_ZADD: tl.constexpr,
                STORE_SS: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """Row block m >= 2 after its below-diagonal sum acc (frame of cs_r = e): add the state term e^{cs_r} C_m S^T,
    then _fwd4_block (returns what it returns)."""
    acc += _fwd4_cs_term(C_base, St, t0, clen, m, offs_n, nmask, s_B_t, BM, DOT_DT, DOT_PREC) * tl.exp(e)
    return _fwd4_block(acc, e, m, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, ypre_ptr, z_ptr, za_ptr, ss_ptr, b,
                       t0, tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, s_y_b, s_y_t, s_y_h, s_z_b, s_z_t, s_z_h,
                       s_za_b, s_za_t, L, BM,
                       HAS_D, D_HP, HAS_Z, STORE_PRE, HAS_ZADD, STORE_SS, DOT_DT, DOT_PREC)


@triton.jit
def chunk_scan_fwd4_kernel(x_ptr, CB_ptr, C_ptr, dtp_ptr, cs_ptr, states_ptr, D_ptr, z_ptr, za_ptr, ss_ptr, y_ptr,
                           ypre_ptr, chunk_t0_ptr, chunk_len_ptr,
                           T, H, P, N, NC, BT, R, G,
                           s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g, s_z_b, s_z_t, s_z_h, s_za_b, s_za_t,
                           s_y_b, s_y_t, s_y_h,
                           L: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr,
                           BNF: tl.constexpr, HAS_D: tl.constexpr, D_HP: tl.constexpr, HAS_Z: tl.constexpr,
                           STORE_PRE: tl.constexpr, HAS_ZADD: tl.constexpr, STORE_SS: tl.constexpr,
                           IS_VARLEN: tl.constexpr,
                           DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """The whole chunk (two or four row blocks, L == 2 * BM or 4 * BM) per (p-block, head, chunk), grid (p-block,
    head, chunk). Below the diagonal the decay goes to the x rows as in _scan_rows, but each k block's
        x~_k = x_k dt_k e^{cs_ref(k) - cs_k},   ref(k) = the k block's last row (factors <= 1),
    is built once (from the x tile its own diagonal step loaded) and kept (in shared memory) for the row
    blocks below it; row block m (r = ref(m-1) = m0 - 1) sums Horner-style with scalar factors <= 1:
        A = CB[m, 0] x~_0;  A = A e^{cs_ref(k) - cs_ref(k-1)} + CB[m, k] x~_k  (k = 1 .. m-1);
        A += e^{cs_r} C_m S^T,
    i.e. A = e^{cs_r} C_m S^T + sum_{k<m} e^{cs_r - cs_ref(k)} CB[m, k] x~_k, what _scan_rows builds per row
    block; then the row factor e^{cs_m - cs_r}, the exact masked diagonal tile and D x. 3 x~ builds per chunk
    and head instead of 6 (one program per row block), x and S^T tiles loaded once per program. A chunk cut short
    returns after its last row block."""
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    pid_c = tl.program_id(2)
    offs_p = pid_p * BP + tl.arange(0, BP)
    b, t0, clen = chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
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
    St = tl.load(states_ptr + (pid_c.to(tl.int64) * H + h) * P * N + offs_p[None, :] * N + offs_n[:, None],
                 mask=pmask[None, :] & nmask[:, None], other=0.0).to(DOT_DT)  # (BNF, BP) = S^T
    # row block 0: state term (cs_r = 0) and the diagonal tile
    acc = _fwd4_cs_term(C_base, St, t0, clen, 0, offs_n, nmask, s_B_t, BM, DOT_DT, DOT_PREC)
    xm, cs_m, dt_m = _fwd4_block(acc, 0.0, 0, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, ypre_ptr, z_ptr, za_ptr,
                                 ss_ptr, b, t0, tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, s_y_b, s_y_t, s_y_h,
                                 s_z_b, s_z_t, s_z_h, s_za_b, s_za_t, L, BM, HAS_D, D_HP, HAS_Z, STORE_PRE, HAS_ZADD,
                                 STORE_SS, DOT_DT, DOT_PREC)
    if clen <= BM:
        return
    # row block 1: r = ref(0)
    xt0, e0 = _fwd4_xt(xm, cs_m, dt_m, cs_ptr, tok0, 0, BM, DOT_DT)
    acc = _fwd4_cs_term(C_base, St, t0, clen, 1, offs_n, nmask, s_B_t, BM, DOT_DT, DOT_PREC) * tl.exp(e0)
    acc = tl.dot(_fwd4_cb(cb_base, clen, 1, 0, L, BM, DOT_DT), xt0, acc, input_precision=DOT_PREC)
    xm, cs_m, dt_m = _fwd4_block(acc, e0, 1, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, ypre_ptr, z_ptr, za_ptr,
                                 ss_ptr, b, t0, tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, s_y_b, s_y_t, s_y_h,
                                 s_z_b, s_z_t, s_z_h, s_za_b, s_za_t, L, BM, HAS_D, D_HP, HAS_Z, STORE_PRE, HAS_ZADD,
                                 STORE_SS, DOT_DT, DOT_PREC)
    if L == 2 * BM:  # two row blocks: the whole chunk is done
        return
    if clen <= 2 * BM:
        return
    # row block 2: r = ref(1)
    xt1, e1 = _fwd4_xt(xm, cs_m, dt_m, cs_ptr, tok0, 1, BM, DOT_DT)
    f1 = tl.exp(e1 - e0)
    acc = _fwd4_cb01(cb_base, clen, 2, xt0, xt1, f1, L, BM, DOT_DT, DOT_PREC)
    xm, cs_m, dt_m = _fwd4_close(acc, e1, 2, C_base, St, offs_n, nmask, s_B_t, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr,
                                 y_ptr, ypre_ptr, z_ptr, za_ptr, ss_ptr, b, t0, tok0, clen, h, T, H, P, offs_p, pmask,
                                 s_x_t, s_y_b, s_y_t, s_y_h, s_z_b, s_z_t, s_z_h, s_za_b, s_za_t, L, BM, HAS_D, D_HP,
                                 HAS_Z, STORE_PRE, HAS_ZADD, STORE_SS, DOT_DT, DOT_PREC)
    if clen <= 3 * BM:
        return
    # row block 3: r = ref(2)
    xt2, e2 = _fwd4_xt(xm, cs_m, dt_m, cs_ptr, tok0, 2, BM, DOT_DT)
    acc = _fwd4_cb01(cb_base, clen, 3, xt0, xt1, f1, L, BM, DOT_DT, DOT_PREC)
    acc = tl.dot(_fwd4_cb(cb_base, clen, 3, 2, L, BM, DOT_DT), xt2, acc * tl.exp(e2 - e1), input_precision=DOT_PREC)
    _fwd4_close(acc, e2, 3, C_base, St, offs_n, nmask, s_B_t, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr,
                y_ptr, ypre_ptr, z_ptr, za_ptr, ss_ptr, b, t0, tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, s_y_b,
                s_y_t, s_y_h, s_z_b, s_z_t, s_z_h, s_za_b, s_za_t, L, BM, HAS_D, D_HP, HAS_Z, STORE_PRE, HAS_ZADD,
                STORE_SS, DOT_DT, DOT_PREC)

