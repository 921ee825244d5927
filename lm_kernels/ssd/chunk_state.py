"""Forward: the chunk states. One program walks a sequence's chunks in order (chunk state and chunk-to-chunk
passing fused) and stores every chunk's start state; the final state stays float32 (notation:
kernel_common.py)."""
import triton
import triton.language as tl

from .kernel_common import state_walk_start



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
                     s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g,
                     L: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     HAS_INIT: tl.constexpr, HAS_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr,
                     DOT_PREC: tl.constexpr, DOT_DT: tl.constexpr):
    """Per (p-block x n-block, head, sequence): walk the chunks in order, store each chunk's start state. The
    programs that read the same x rows (one per n-block) are neighbours in the grid and share them through L2.
    BK rows per step (BK >= L: the whole chunk)."""
    pid_pn = tl.program_id(0)
    h = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_p, offs_n, pn_mask, pn_off, b, t_begin, seqlen, c_begin, n_chunks, S, x_base, B_base = state_walk_start(
        pid_s, pid_pn, h, init_ptr, x_ptr, B_ptr, cu_ptr, chunk_first_ptr, T, H, P, N, NC, R,
        s_x_b, s_x_h, s_B_b, s_B_g, BP, BN, HAS_INIT, IS_VARLEN)
    dtype = DOT_DT
    for i in range(0, n_chunks):
        c = c_begin + i
        t0 = t_begin + i * L
        clen = tl.minimum(L, seqlen - i * L)
        tl.store(states_ptr + (c.to(tl.int64) * H + h) * P * N + pn_off, S.to(states_ptr.dtype.element_ty),
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

