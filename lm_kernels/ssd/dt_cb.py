"""Forward, first launch: dt (bias, softplus, limits) with its in-chunk cumsum of dt*A, and C.B per chunk and
group (read by every head of the group), in one kernel (notation: kernel_common.py)."""
import triton
import triton.language as tl

from .kernel_common import chunk_coords, softplus


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
        dt = softplus(dt)
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
def dtcb_fwd_kernel(dt_ptr, bias_ptr, A_ptr, dtp_ptr, cs_ptr, B_ptr, C_ptr, CB_ptr, chunk_t0_ptr, chunk_len_ptr,
                    T, H, N, NC, BT, G, s_dt_b, s_dt_t, s_B_b, s_B_t, s_B_g, dt_lo, dt_hi,
                    L: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BNF: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
                    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """Grid (chunk, G * (L/BM) * (L/BK) + cdiv(H, BH)): the first programs of axis 1 compute the C.B tiles on and
    below the diagonal (group, tile; a diagonal tile is stored whole), the rest dt and cs for a block of BH heads."""
    pid_c = tl.program_id(0)
    pid = tl.program_id(1)
    n_cb = G * (L // BM) * (L // BK)
    b, t0, clen = chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L, IS_VARLEN)
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

