"""Experiment (not wired into ssd_scan_triton): the SSD forward in one pass over x, chunk states passed by
decoupled look-back instead of a separate state kernel.

Why: the forward is state_fwd (reads x, writes every chunk's start state) + chunk_scan_fwd4 (reads x again and
the states). The scan kernel already builds each row block's decayed x tile x~_k = x_k dt_k e^{cs_ref(k) - cs_k}
(ref(k) = the block's last row); the chunk's own state contribution is sum_k e^{cs_last - cs_ref(k)} B_k^T x~_k, four
more [N, 64] x [64, BP] products on tiles the program holds. What the chunk needs from its predecessor is only
the state entering it; the chain S_c+1 = e^{cs_last} S_c + L_c is one multiply-add per hop.

One program per (p block, head, chunk), chunk-major, its position taken from an atomic ticket (so a program
only ever waits for one that has already started: no deadlock whatever order the hardware dispatches in):
  1. load the four x tiles, build x~_0..3, L = the chunk's own state (Horner over the k blocks);
  2. wait for the predecessor's flag (acquire), read its float32 state S_c, publish S_c+1 = e^{cs_last} S_c + L
     (store, CTA barrier, release flag);
  3. the xs4 row blocks with S_c^T, as chunk_scan_fwd4_kernel.
Scope of the experiment: fixed-length batches whose length is a multiple of the chunk (256 = 4 x 64 rows), no z,
no initial / final state, 16-bit inputs. dt / cs / C.B come from the existing dtcb kernel's layout (computed here
in PyTorch for the test; the benchmark times the kernels only).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import _xs4_block, _xs4_cb, _xs4_cs_term, _xs4_xt
from .triton_ssd import _dot_dt


@triton.jit
def _lb_xt(x_base, B_base, cs_ptr, dtp_ptr, tok0, t0, j, offs_p, pmask, offs_n, nmask, s_x_t, s_B_t,
           BM: tl.constexpr, DOT_DT: tl.constexpr):
    """Row block j: (x~_j)^T = (x_j dt_j e^{cs_ref - cs_j})^T (BP, BM), loaded transposed so that it is the product's
    A operand as built, B_j (BM, BNF) as loaded, and cs_ref (the block's last row)."""
    rows = j * BM + tl.arange(0, BM)
    cs_m = tl.load(cs_ptr + tok0 + rows)
    dt_m = tl.load(dtp_ptr + tok0 + rows)
    e = tl.load(cs_ptr + tok0 + j * BM + BM - 1)
    xT = tl.load(x_base + (t0 + rows[None, :]) * s_x_t + offs_p[:, None], mask=pmask[:, None], other=0.0)
    xtT = (xT.to(tl.float32) * (tl.exp(e - cs_m) * dt_m)[None, :]).to(DOT_DT)
    Bk = tl.load(B_base + (t0 + rows[:, None]) * s_B_t + offs_n[None, :], mask=nmask[None, :], other=0.0).to(DOT_DT)
    return xtT, Bk, e


@triton.jit(do_not_specialize=["NPROG"])
def lb_scan_fwd_kernel(x_ptr, B_ptr, C_ptr, CB_ptr, dtp_ptr, cs_ptr, D_ptr, y_ptr, sx_ptr, flag_ptr, ticket_ptr,
                       T, H, P, N, NC, BT, R, G, NPROG,
                       s_x_b, s_x_t, s_x_h, s_B_b, s_B_t, s_B_g,
                       L: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BNF: tl.constexpr, NPB: tl.constexpr,
                       HAS_D: tl.constexpr, D_HP: tl.constexpr, DOT_DT: tl.constexpr, DOT_PREC: tl.constexpr):
    t = tl.atomic_add(ticket_ptr, 1)
    pid_c = t // (H * NPB)
    rem = t % (H * NPB)
    h = rem // NPB
    pid_p = rem % NPB
    b = pid_c // NC
    ci = pid_c % NC
    t0 = ci * L
    clen = L
    g = h // R
    tok0 = h * BT + b * T + t0
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BNF)
    nmask = offs_n < N
    pmask = offs_p < P
    x_base = x_ptr + b * s_x_b + h * s_x_h
    B_base = B_ptr + b * s_B_b + g * s_B_g
    C_base = C_ptr + b * s_B_b + g * s_B_g
    cb_base = CB_ptr + (pid_c.to(tl.int64) * G + g) * L * L
    # 1. the chunk's own state, in the frame of each block's last row (x~ tiles are transient here; phase 3 rebuilds
    # them from the x tiles its diagonal steps load, as chunk_scan_fwd4_kernel does, to keep registers free)
    # (a runtime loop, so that the compiler does not hoist all four blocks' loads: phase 1 alone spilled 320 B at
    # 4 warps unrolled)
    loc = tl.zeros((BP, BNF), dtype=tl.float32)
    e_prev = tl.load(cs_ptr + tok0)
    e3 = e_prev
    for j in range(0, 4):
        xt, Bk, e3 = _lb_xt(x_base, B_base, cs_ptr, dtp_ptr, tok0, t0, j, offs_p, pmask, offs_n, nmask, s_x_t, s_B_t,
                            BM, DOT_DT)
        loc = tl.dot(xt, Bk, loc * tl.exp(e3 - e_prev), input_precision=DOT_PREC)
        e_prev = e3
    # e3 = cs of the chunk's last row
    # 2. the state entering this chunk from its predecessor, and the one leaving it for the successor
    # states exchanged in float32, (p, n) per (chunk, head); the local sum above is (BP, BNF)
    pn_off = offs_p[:, None] * N + offs_n[None, :]
    pnm = pmask[:, None] & nmask[None, :]
    base_prev = sx_ptr + ((pid_c - 1).to(tl.int64) * H + h) * N * P
    if ci > 0:
        fprev = flag_ptr + ((pid_c - 1) * H + h) * NPB + pid_p
        while tl.atomic_add(fprev, 0, sem="acquire") == 0:
            pass
        tl.debug_barrier()
    if ci < NC - 1:
        S = tl.zeros((BP, BNF), dtype=tl.float32)
        if ci > 0:
            S = tl.load(base_prev + pn_off, mask=pnm, other=0.0, cache_modifier=".cg")
        tl.store(sx_ptr + (pid_c.to(tl.int64) * H + h) * N * P + pn_off, tl.exp(e3) * S + loc, mask=pnm)
        tl.debug_barrier()
        tl.atomic_xchg(flag_ptr + (pid_c * H + h) * NPB + pid_p, 1, sem="release")
    # S_c^T (BNF, BP) for the output products, read again in that orientation (from L2)
    St = tl.zeros((BNF, BP), dtype=DOT_DT)
    if ci > 0:
        St = tl.load(base_prev + offs_n[:, None] + offs_p[None, :] * N, mask=nmask[:, None] & pmask[None, :], other=0.0,
                     cache_modifier=".cg").to(DOT_DT)
    # 3. the xs4 row blocks (chunk_scan_fwd4_kernel's body) with S_c^T
    acc = _xs4_cs_term(C_base, St, t0, clen, 0, offs_n, nmask, s_B_t, BM, DOT_DT, DOT_PREC)
    xm, cs_m, dt_m = _xs4_block(acc, 0.0, 0, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, y_ptr, y_ptr, b, t0,
                                tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, 0, 0, 0,
                                L, BM, HAS_D, D_HP, False, False, DOT_DT, DOT_PREC)
    xt0, e0 = _xs4_xt(xm, cs_m, dt_m, cs_ptr, tok0, 0, BM, DOT_DT)
    acc = _xs4_cs_term(C_base, St, t0, clen, 1, offs_n, nmask, s_B_t, BM, DOT_DT, DOT_PREC) * tl.exp(e0)
    acc = tl.dot(_xs4_cb(cb_base, clen, 1, 0, L, BM, DOT_DT), xt0, acc, input_precision=DOT_PREC)
    xm, cs_m, dt_m = _xs4_block(acc, e0, 1, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, y_ptr, y_ptr, b, t0,
                                tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, 0, 0, 0,
                                L, BM, HAS_D, D_HP, False, False, DOT_DT, DOT_PREC)
    xt1, e1 = _xs4_xt(xm, cs_m, dt_m, cs_ptr, tok0, 1, BM, DOT_DT)
    f1 = tl.exp(e1 - e0)
    acc = tl.dot(_xs4_cb(cb_base, clen, 2, 0, L, BM, DOT_DT), xt0, input_precision=DOT_PREC)
    acc = tl.dot(_xs4_cb(cb_base, clen, 2, 1, L, BM, DOT_DT), xt1, acc * f1, input_precision=DOT_PREC)
    acc += _xs4_cs_term(C_base, St, t0, clen, 2, offs_n, nmask, s_B_t, BM, DOT_DT, DOT_PREC) * tl.exp(e1)
    xm, cs_m, dt_m = _xs4_block(acc, e1, 2, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, y_ptr, y_ptr, b, t0,
                                tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, 0, 0, 0,
                                L, BM, HAS_D, D_HP, False, False, DOT_DT, DOT_PREC)
    xt2, e2 = _xs4_xt(xm, cs_m, dt_m, cs_ptr, tok0, 2, BM, DOT_DT)
    acc = tl.dot(_xs4_cb(cb_base, clen, 3, 0, L, BM, DOT_DT), xt0, input_precision=DOT_PREC)
    acc = tl.dot(_xs4_cb(cb_base, clen, 3, 1, L, BM, DOT_DT), xt1, acc * f1, input_precision=DOT_PREC)
    acc = tl.dot(_xs4_cb(cb_base, clen, 3, 2, L, BM, DOT_DT), xt2, acc * tl.exp(e2 - e1), input_precision=DOT_PREC)
    acc += _xs4_cs_term(C_base, St, t0, clen, 3, offs_n, nmask, s_B_t, BM, DOT_DT, DOT_PREC) * tl.exp(e2)
    _xs4_block(acc, e2, 3, x_base, cb_base, cs_ptr, dtp_ptr, D_ptr, y_ptr, y_ptr, y_ptr, b, t0,
               tok0, clen, h, T, H, P, offs_p, pmask, s_x_t, 0, 0, 0,
               L, BM, HAS_D, D_HP, False, False, DOT_DT, DOT_PREC)

def prepare(x, dt, A, B, C, dt_bias=None, dt_softplus=True, chunk_size=256):
    """dt after bias / softplus (dtp), the within-chunk cumulative dt*A (cs), both (H, b*T) float32, and C.B per
    chunk and group (b*NC, G, L, L) in x's dtype: the layouts the scan kernels read."""
    b, T, H, P = x.shape
    G = B.shape[2]
    L = chunk_size
    NC = T // L
    d = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    dtp = torch.nn.functional.softplus(d) if dt_softplus else d
    cs = (dtp * A.float()).reshape(b, NC, L, H).cumsum(2).reshape(b, T, H)
    Cc = C.float().reshape(b, NC, L, G, -1)
    Bc = B.float().reshape(b, NC, L, G, -1)
    CB = torch.einsum("bclgn,bckgn->bcglk", Cc, Bc).reshape(b * NC, G, L, L).to(x.dtype).contiguous()
    return (dtp.permute(2, 0, 1).reshape(H, b * T).contiguous(), cs.permute(2, 0, 1).reshape(H, b * T).contiguous(),
            CB)


def ssd_forward_lookback(x, B, C, D, dtp, cs, CB, chunk_size=256, num_warps=4, BP=64, maxnreg=None):
    """y of the SSD (no z, no initial state) from prepare()'s dtp / cs / C.B; x (b, T, H, P) 16-bit, T a multiple
    of the chunk (4 x 64 rows)."""
    b, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    L = chunk_size
    if L % 4 or T % L:
        raise ValueError(f"lookback experiment: T ({T}) must be a multiple of chunk_size ({L}), itself 4 row blocks")
    BM = L // 4
    NC = T // L
    BP = min(BP, triton.next_power_of_2(P))
    NPB = triton.cdiv(P, BP)
    BNF = max(16, triton.next_power_of_2(N))
    R = H // G
    y = torch.empty_like(x)
    sx = torch.empty(b * NC, H, N, P, dtype=torch.float32, device=x.device)
    ws = torch.zeros(1 + b * NC * H * NPB, dtype=torch.int32, device=x.device)
    nprog = b * NC * H * NPB
    dot_dt = _dot_dt(x.dtype)  # float32 under the interpreter (its bf16 dot is wrong)
    lb_scan_fwd_kernel[(nprog,)](
        x, B, C, CB, dtp, cs, D if D is not None else dtp, y, sx, ws[1:], ws[:1],
        T, H, P, N, NC, b * T, R, G, nprog,
        x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2),
        L=L, BM=BM, BP=BP, BNF=BNF, NPB=NPB, HAS_D=D is not None, D_HP=D is not None and D.dim() == 2,
        DOT_DT=dot_dt, DOT_PREC="tf32", num_warps=num_warps, num_stages=1,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    return y
