"""Backward: dx with the intra-chunk d(dt*A) shares, and dt / dA / dt_bias (notation: kernel_common.py)."""
import triton
import triton.language as tl

from .kernel_common import chunk_coords, softplus


@triton.jit
def _dx_tile(dxi, csum, xld, Bl, C_base, cs_ptr, dy_base, dda_ptr, tok0, t0, clen, l0, k, rows_l, lmask, cs_l,
             dt_l, offs_p, pmask, offs_n, nmask, s_dy_t, s_B_t, HBT,
             BM: tl.constexpr, BK: tl.constexpr, DIAG: tl.constexpr,
             DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr):
    """One k block (rows m) of dx_bwd for the rows l: dxi += (CB^T * decay) dy_k; and, with x_l . dy_m (xld = x_l),
    the transposed tile M^T[l, m] = M[m, l] of M = Q_h * CB: its sums over l are this row block's part of the row
    sums R_m = sum_{s <= m} M[m, s], stored in the slot of row block l of dda ((L // BM + 1, H, B*T)); its sums
    over m add to csum, the column sums C_l = sum_{m >= l} M[m, l] of the rows l (both sums from the same tile:
    dt_bwd's difference R - C cancels only float32 rounding)."""
    rows_k = k + tl.arange(0, BK)
    kmask = rows_k < clen
    cs_k = tl.load(cs_ptr + tok0 + rows_k, mask=kmask, other=0.0)
    # [l, m] = C_m . B_l as a product (float32, in the products' register layout, where the share tile M^T is
    # formed): loading the forward's C.B instead made the compiler build the decayed tile twice, once per layout
    # (H100)
    Ck = tl.load(C_base + (t0 + rows_k[:, None]) * s_B_t + offs_n[None, :], mask=kmask[:, None] & nmask[None, :],
                 other=0.0).to(DOT_DT)
    cbT = tl.dot(Bl, tl.trans(Ck), input_precision=DOT_PREC)
    if DIAG:
        causal = (rows_k[None, :] >= rows_l[:, None]) & kmask[None, :]
        decay = tl.exp(tl.where(causal, cs_k[None, :] - cs_l[:, None], float("-inf")))
        dyk = tl.load(dy_base + (t0 + rows_k[:, None]) * s_dy_t + offs_p[None, :],
                      mask=kmask[:, None] & pmask[None, :], other=0.0).to(DOT_DT)
        cbd = cbT * decay
    else:
        # below the diagonal every l precedes every m: e^{cs_m - cs_l} = e^{cs_m - c} e^{c - cs_l} through the row c
        # before the k block (both exponents <= 0), on the dy rows and the C.B columns: no exponential per element
        c = tl.load(cs_ptr + tok0 + k - 1)
        ek = tl.where(kmask, tl.exp(cs_k - c), 0.0)
        cbd = cbT * tl.exp(c - cs_l)[:, None]
        dyk = (tl.load(dy_base + (t0 + rows_k[:, None]) * s_dy_t + offs_p[None, :],
                       mask=kmask[:, None] & pmask[None, :], other=0.0).to(tl.float32) * ek[:, None]).to(DOT_DT)
    dxi = tl.dot(cbd.to(DOT_DT), dyk, dxi, input_precision=DOT_PREC)
    MT = tl.dot(xld, tl.trans(dyk), input_precision=DOT_PREC) * cbd * dt_l[:, None]  # [l, m] = M[m, l]
    tl.store(dda_ptr + (l0 // BM).to(tl.int64) * HBT + tok0 + rows_k, tl.sum(MT, 0), mask=kmask)
    return dxi, csum + tl.sum(MT, 1)


@triton.jit
def dx_bwd_kernel(dy_ptr, x_ptr, B_ptr, C_ptr, dtp_ptr, cs_ptr, states_ptr, dstates_ptr, D_ptr,
                  dx_ptr, ddt_ptr, q_ptr, dD_ptr, dda_ptr, passing_ptr, chunk_t0_ptr, chunk_len_ptr,
                  T, H, P, N, NC, BT, R,
                  s_dy_b, s_dy_t, s_dy_h, s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g, s_dx_b, s_dx_t, s_dx_h,
                  s_part,
                  L: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BPF: tl.constexpr, BNF: tl.constexpr,
                  HAS_D: tl.constexpr, D_HP: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                  DOT_DT: tl.constexpr):
    """Per (chunk, head, l-block): dx, the direct ddt, the per-row state terms q, dD partial sums and, for the
    intra-chunk d(dt*A), the row and column sums of M (_dx_tile; the column sums in the last slot of dda); the
    program with the chunk's last rows (the lightest row block of a full chunk) also forms the chunk's passing term
    e^a <G_{c+1}, S_c> from the G_{c+1} tile it holds (one float32 per chunk and head in passing). Grid
    (l-block, head, chunk): a (chunk, head)'s row blocks and then a chunk's heads run together (dy tiles, dstates
    and the group's B / C rows come from L2). dx is written through its batch, time and head strides (channels
    contiguous): a (b, t, h, p) tensor or the x columns of a (b, t, x | B | C) gradient, whose size-1 time axis
    (t = 1) may carry any stride."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    pid_c = tl.program_id(2)
    l0 = pid_m * BM
    b, t0, clen = chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
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
    C_base = C_ptr + b * s_B_b + g * s_B_g
    dy_base = dy_ptr + b * s_dy_b + h * s_dy_h
    x_base = x_ptr + b * s_x_b + h * s_x_h
    cs_l = tl.load(cs_ptr + tok0 + rows_l, mask=lmask, other=0.0)
    dt_l = tl.load(dtp_ptr + tok0 + rows_l, mask=lmask, other=0.0)
    a = tl.load(cs_ptr + tok0 + clen - 1)
    dxi = tl.zeros((BM, BPF), dtype=tl.float32)
    HBT = H.to(tl.int64) * BT
    xld = tl.load(x_base + (t0 + rows_l[:, None]) * s_x_t + offs_p[None, :],
                  mask=lmask[:, None] & pmask[None, :], other=0.0).to(dtype)
    csum = tl.zeros((BM,), dtype=tl.float32)
    Bl = tl.load(B_base + (t0 + rows_l[:, None]) * s_B_t + offs_n[None, :], mask=lmask[:, None] & nmask[None, :],
                 other=0.0).to(dtype)
    dxi, csum = _dx_tile(dxi, csum, xld, Bl, C_base, cs_ptr, dy_base, dda_ptr, tok0, t0, clen, l0, l0, rows_l, lmask,
                         cs_l, dt_l, offs_p, pmask, offs_n, nmask, s_dy_t, s_B_t, HBT, BM, BK, True, dtype, DOT_PREC)
    for k in range(l0 + BK, clen, BK):
        dxi, csum = _dx_tile(dxi, csum, xld, Bl, C_base, cs_ptr, dy_base, dda_ptr, tok0, t0, clen, l0, k, rows_l,
                             lmask, cs_l, dt_l, offs_p, pmask, offs_n, nmask, s_dy_t, s_B_t, HBT, BM, BK, False,
                             dtype, DOT_PREC)
    st_off = (pid_c.to(tl.int64) * H + h) * P * N + offs_p[None, :] * N + offs_n[:, None]  # (n, p): transposed
    st_mask = pmask[None, :] & nmask[:, None]
    Gd = tl.load(dstates_ptr + st_off, mask=st_mask, other=0.0).to(dtype)  # (BNF, BPF) = G^T
    if l0 + BM >= clen:
        St = tl.load(states_ptr + st_off, mask=st_mask, other=0.0)  # (BNF, BPF) = S^T
        tl.store(passing_ptr + pid_c.to(tl.int64) * H + h,
                 tl.sum(tl.sum(St.to(tl.float32) * Gd.to(tl.float32), 1), 0) * tl.exp(a))
    dxs = tl.dot(Bl, Gd, input_precision=DOT_PREC) * tl.where(lmask, tl.exp(a - cs_l), 0.0)[:, None]
    lp = lmask[:, None] & pmask[None, :]
    xl = xld.to(tl.float32)  # x's own dtype (or float32 under the interpreter): exact
    tl.store(q_ptr + tok0 + rows_l, tl.sum(xl * dxs, 1) * dt_l, mask=lmask)
    tl.store(dda_ptr + (L // BM) * HBT + tok0 + rows_l, csum, mask=lmask)  # the column sums C_l of M
    t = dxs + dxi
    tl.store(ddt_ptr + tok0 + rows_l, tl.sum(xl * t, 1), mask=lmask)
    dx = dt_l[:, None] * t
    if HAS_D:
        dyl = tl.load(dy_base + (t0 + rows_l[:, None]) * s_dy_t + offs_p[None, :], mask=lp, other=0.0).to(tl.float32)
        if D_HP:
            Dv = tl.load(D_ptr + h * P + offs_p, mask=pmask, other=0.0).to(tl.float32)[None, :]
        else:
            Dv = tl.load(D_ptr + h).to(tl.float32)
        dx = dx + Dv * dyl
        if D_HP:
            tl.store(dD_ptr + (pid_c.to(tl.int64) * tl.cdiv(L, BM) + pid_m) * s_part + h * P + offs_p,
                     tl.sum(dyl * xl, 0), mask=pmask)
        else:  # one D per head: one partial sum per program (summed by sum_rows_kernel)
            tl.store(dD_ptr + (pid_c.to(tl.int64) * tl.cdiv(L, BM) + pid_m) * s_part + h,
                     tl.sum(tl.sum(dyl * xl, 0), 0))
    tl.store(dx_ptr + b.to(tl.int64) * s_dx_b + h * s_dx_h + (t0 + rows_l[:, None]) * s_dx_t + offs_p[None, :],
             dx.to(dx_ptr.dtype.element_ty), mask=lp)


@triton.jit
def dt_bwd_kernel(dt_ptr, bias_ptr, A_ptr, dtp_ptr, ddt_dir_ptr, dcs_ptr, dda_ptr, q_ptr, passing_ptr,
                  ddt_out_ptr, dA_part_ptr, dbias_part_ptr, chunk_t0_ptr, chunk_len_ptr,
                  T, H, NC, BT, s_dt_b, s_dt_t, s_ddt_b, s_ddt_t, s_part, dt_lo, dt_hi,
                  L: tl.constexpr, BH: tl.constexpr, HAS_BIAS: tl.constexpr,
                  SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr, IS_VARLEN: tl.constexpr, BMB: tl.constexpr,
                  NDCS: tl.constexpr):
    """Per (chunk, head block): d(dt*A)_l = sum_{k>=l} dy_k.y_off_k + sum_{k<l} q_k + <G_{c+1}, e^a S_c> (passing,
    from dx_bwd) + the intra-chunk part from dx_bwd's row and column sums of M (row blocks of BMB rows; the dcs
    partial sums of dbdc_bwd's NDCS n blocks); then ddt = ddt_direct + A d(dt*A), back through clamp/softplus/bias.
    ddt_out is read through its own strides (a column block of a larger gradient)."""
    pid_c = tl.program_id(0)
    pid_h = tl.program_id(1)
    b, t0, clen = chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
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
    # intra-chunk: d(dt*A)_l = sum_{m >= l} sum_{s < l} M[m, s] = sum_{j >= l} (R_j - C_j) (the pairs with both
    # ends at or after l cancel), R the row sums of M (slot s: row block s's part, at the rows of blocks >= s),
    # C its column sums (slot NMB); all in float32 from the tiles
    intra = -tl.load(dda_ptr + NMB * HBT + off, mask=mask, other=0.0)
    blk = rows // BMB
    for s in tl.static_range(NMB):
        intra += tl.load(dda_ptr + s * HBT + off, mask=mask & (blk[:, None] >= s), other=0.0)
    q = tl.load(q_ptr + off, mask=mask, other=0.0)
    ddt = tl.load(ddt_dir_ptr + off, mask=mask, other=0.0)
    dtp = tl.load(dtp_ptr + off, mask=mask, other=0.0)
    pas = tl.load(passing_ptr + pid_c.to(tl.int64) * H + heads, mask=hmask, other=0.0)
    ddA = tl.sum(dcs, 0)[None, :] - tl.cumsum(dcs, axis=0) + dcs  # suffix sums of dy.y_off
    ddA += tl.cumsum(q, axis=0) - q + pas[None, :]  # state terms
    ddA += tl.sum(intra, 0)[None, :] - tl.cumsum(intra, axis=0) + intra
    ddA = tl.where(mask, ddA, 0.0)
    A = tl.load(A_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
    ddt = ddt + A[None, :] * ddA
    tl.store(dA_part_ptr + pid_c * s_part + heads, tl.sum(dtp * ddA, 0), mask=hmask)
    raw = tl.load(dt_ptr + b * s_dt_b + (t0 + rows[:, None]) * s_dt_t + heads[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    if HAS_BIAS:
        raw += tl.load(bias_ptr + heads, mask=hmask, other=0.0).to(tl.float32)[None, :]
    v = raw
    if SOFTPLUS:
        v = softplus(raw)
    if HAS_LIMIT:
        ddt = tl.where((v >= dt_lo) & (v <= dt_hi), ddt, 0.0)
    if SOFTPLUS:
        ddt = tl.where(raw > 20.0, ddt, ddt * tl.sigmoid(raw))
    ddt = tl.where(mask, ddt, 0.0)
    tl.store(ddt_out_ptr + b * s_ddt_b + (t0 + rows[:, None]) * s_ddt_t + heads[None, :],
             ddt.to(ddt_out_ptr.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(dbias_part_ptr + pid_c * s_part + heads, tl.sum(ddt, 0), mask=hmask)


@triton.jit
def sum_rows_kernel(part_ptr, out0_ptr, out1_ptr, out2_ptr, rows, c0, c1, c2, s_part,
                    BR: tl.constexpr, BC: tl.constexpr):
    """Column sums of the (rows, c0 + c1 + c2) float32 partials into three tensors of their own (dA, dt_bias's and
    D's gradients; each in its dtype): one launch instead of one reduction per gradient."""
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    n = c0 + c1 + c2
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    for r in range(0, rows, BR):
        rr = r + tl.arange(0, BR)
        acc += tl.load(part_ptr + rr[:, None].to(tl.int64) * s_part + cols[None, :],
                       mask=(rr[:, None] < rows) & (cols[None, :] < n), other=0.0)
    tot = tl.sum(acc, 0)
    tl.store(out0_ptr + cols, tot, mask=cols < c0)
    tl.store(out1_ptr + cols - c0, tot, mask=(cols >= c0) & (cols < c0 + c1))
    tl.store(out2_ptr + cols - c0 - c1, tot, mask=(cols >= c0 + c1) & (cols < n))
