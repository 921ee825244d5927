"""Triton kernels of the depthwise causal conv1d (launched by triton_conv1d.py).

Layout: x (B, T, C) read through its batch and time strides (a split view of a larger projection:
stride_t != C) with contiguous channels (the wrapper ensures stride_c == 1), so that a row of a tile is
one vectorised load. A program owns tiles of BT time steps x BC channels; tap j (0 <= j < W)
multiplies the input j steps back by weight[:, W-1-j]. "Input at position p" means x[p] for p >= 0
and conv_state[:, W-1+p] for -(W-1) <= p < 0 (zero without a state); only tiles that start before
row 0 read the state (a scalar branch). With packed documents (VARLEN) tap j is masked at rows whose
position inside their document is < j; the document start of a row is found by a binary search of
cu_seqlens (LOG_N steps). Shifted tiles are L1/L2 hits: DRAM sees each row about once.

Forward (conv_fwd_kernel): y = act(bias + sum_j w_j in[p - j]) in float32 (float64 for float64 x),
stored in x's dtype; the program holding the last row also writes the new conv state (the last W-1
inputs). Weight, bias and conv state are rounded to x's dtype first, as the PyTorch reference does.

Backward (conv_bwd_kernel): g[r] = dy[r] * act'(z[r]) with the pre-activation z recomputed from x;
dx[p] = sum_s w_s g[p + s] over the taps s unmasked at output row p + s. A tile gathers instead of
scattering, so that no program writes another's rows and no atomics are needed: it recomputes z at
the W shifted row sets p + s at once, as a (WP, BT, BC) tensor (WP = W rounded up to a power of two;
one (WP, BT, BC) input load per tap, L1 hits), then reduces over s. (Building z from the 2W-1 distinct
shifted 2-D tiles instead needs a (WP, BC) weight matrix per shift: more registers on sm_90.) A program walks CHUNK rows in tiles of BT and keeps its dweight / dbias partial sums
in registers, stored once per program into a float32 buffer (one (C, W+1) slice per program) that the
caller sums: deterministic. Programs of the first chunk also form the conv state's gradient (inputs
at rows -(W-1)..-1, the same gather).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _doc_start(cu_ptr, rows, N_SEQ, LOG_N):
    """Start offset of the document holding each row (any shape): the largest cu[i] <= row (binary search)."""
    lo = tl.zeros_like(rows)
    hi = tl.zeros_like(rows) + N_SEQ
    for _ in range(LOG_N):
        mid = (lo + hi) // 2
        v = tl.load(cu_ptr + mid).to(tl.int32)
        go = v <= rows
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return tl.load(cu_ptr + lo).to(tl.int32)


@triton.jit
def _load_in(x_ptr, s_ptr, rows, row_min, cols, mask, T, stride_xt, stride_sc, stride_sk,
             W: tl.constexpr, HAS_STATE: tl.constexpr, ACC: tl.constexpr):
    """The input at positions `rows` and channels `cols` (broadcastable index tensors; `mask` masks
    channels / padding): x for rows >= 0, the conv state for -(W-1) <= rows < 0 (rounded to x's dtype),
    zero elsewhere; returned in the ACC dtype. `row_min` (scalar, <= every row) skips the state load
    for tiles that start at row 0 or later."""
    in_x = (rows >= 0) & (rows < T) & mask
    v = tl.load(x_ptr + rows.to(tl.int64) * stride_xt + cols, mask=in_x, other=0.0).to(ACC)
    if HAS_STATE:
        if row_min < 0:
            in_s = (rows < 0) & (rows >= 1 - W) & mask
            sv = tl.load(s_ptr + (rows + W - 1) * stride_sk + cols * stride_sc, mask=in_s, other=0.0)
            v += sv.to(x_ptr.dtype.element_ty).to(ACC)
    return v


@triton.jit
def conv_fwd_kernel(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, y_ptr, ns_ptr,
                    T, C, N_SEQ, LOG_N,
                    stride_xb, stride_xt, stride_sb, stride_sc, stride_sk, stride_wc, stride_wk,
                    stride_yb, stride_yt, stride_nb, stride_nc, stride_nk,
                    W: tl.constexpr, BS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    VARLEN: tl.constexpr, SILU: tl.constexpr, WRITE_STATE: tl.constexpr, ACC: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr):
    pid_t, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    x_ptr += pid_b * stride_xb
    s_ptr += pid_b * stride_sb
    row0 = pid_t * BT
    rows = row0 + tl.arange(0, BT)
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    z = tl.zeros((BT, BC), dtype=ACC)
    if VARLEN:
        pos = rows - _doc_start(cu_ptr, rows, N_SEQ, LOG_N)
    for j in tl.static_range(W):
        v = _load_in(x_ptr, s_ptr, (rows - j)[:, None], row0 - j, offs_c[None, :], mask_c[None, :], T,
                     stride_xt, stride_sc, stride_sk, W, HAS_STATE, ACC)
        if VARLEN:
            v = tl.where((pos >= j)[:, None], v, 0.0)
        wj = tl.load(w_ptr + offs_c * stride_wc + (W - 1 - j) * stride_wk, mask=mask_c, other=0.0)
        z += wj.to(XDT).to(ACC)[None, :] * v
    if HAS_BIAS:
        z += tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(XDT).to(ACC)[None, :]
    if SILU:
        z = z / (1.0 + tl.exp(-z))
    tl.store(y_ptr + pid_b * stride_yb + rows[:, None].to(tl.int64) * stride_yt + offs_c[None, :], z.to(XDT),
             mask=(rows < T)[:, None] & mask_c[None, :])
    if WRITE_STATE:
        if (pid_t + 1) * BT >= T:  # the last tile: new state = inputs at T-(W-1) .. T-1
            k = tl.arange(0, BS)
            last = _load_in(x_ptr, s_ptr, (T - (W - 1) + k)[:, None], T - (W - 1), offs_c[None, :], mask_c[None, :],
                            T, stride_xt, stride_sc, stride_sk, W, HAS_STATE, ACC)
            tl.store(ns_ptr + pid_b * stride_nb + k[:, None] * stride_nk + offs_c[None, :] * stride_nc,
                     last.to(XDT), mask=(k < W - 1)[:, None] & mask_c[None, :])


@triton.jit
def _grad_tile(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, row0, offs_c, mask_c, T, N_SEQ, LOG_N,
               stride_xt, stride_sc, stride_sk, stride_wc, stride_wk, stride_dt,
               W: tl.constexpr, WP: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, HAS_STATE: tl.constexpr,
               HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
               XDT: tl.constexpr):
    """For input positions p = row0 .. row0+BR-1: (dLoss/d input[p], dLoss/dz[p]), both (BR, BC)."""
    sidx = tl.arange(0, WP)  # row set s: output rows p + s
    ridx = tl.arange(0, BR)
    rows2 = row0 + sidx[:, None] + ridx[None, :]  # (WP, BR) output rows
    c3 = offs_c[None, None, :]
    mc3 = mask_c[None, None, :]
    live2 = (rows2 >= 0) & (rows2 < T) & (sidx < W)[:, None]
    g = tl.load(dy_ptr + rows2[:, :, None].to(tl.int64) * stride_dt + c3, mask=live2[:, :, None] & mc3,
                other=0.0).to(ACC)  # (WP, BR, BC)
    if VARLEN:
        pos2 = rows2 - _doc_start(cu_ptr, rows2, N_SEQ, LOG_N)
    if SILU:
        z = tl.zeros((WP, BR, BC), dtype=ACC)
        for j in tl.static_range(W):  # tap j of row set s reads input row p + s - j
            xin = _load_in(x_ptr, s_ptr, (rows2 - j)[:, :, None], row0 - j, c3, mc3, T,
                           stride_xt, stride_sc, stride_sk, W, HAS_STATE, ACC)  # (WP, BR, BC)
            if VARLEN:
                xin = tl.where((pos2 >= j)[:, :, None], xin, 0.0)
            wj = tl.load(w_ptr + offs_c * stride_wc + (W - 1 - j) * stride_wk, mask=mask_c, other=0.0)
            z += wj.to(XDT).to(ACC)[None, None, :] * xin
        if HAS_BIAS:
            z += tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(XDT).to(ACC)[None, None, :]
        sig = 1.0 / (1.0 + tl.exp(-z))
        g = g * sig * (1.0 + z * (1.0 - sig))
    g0 = tl.sum(tl.where((sidx == 0)[:, None, None], g, 0.0), axis=0)
    ws = tl.load(w_ptr + offs_c[None, :] * stride_wc + (W - 1 - sidx)[:, None] * stride_wk,
                 mask=(sidx < W)[:, None] & mask_c[None, :], other=0.0).to(XDT).to(ACC)  # tap s
    gw = g * ws[:, None, :]
    if VARLEN:
        gw = tl.where((pos2 >= sidx[:, None])[:, :, None], gw, 0.0)
    return tl.sum(gw, axis=0), g0


@triton.jit
def conv_bwd_kernel(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, dx_ptr, ds_ptr, part_ptr,
                    T, C, N_SEQ, LOG_N, CHUNK,
                    stride_xb, stride_xt, stride_sb, stride_sc, stride_sk, stride_wc, stride_wk,
                    stride_db, stride_dt, stride_dxb, stride_dxt, stride_gb, stride_gc, stride_gk,
                    stride_ob, stride_oc, stride_ok,
                    W: tl.constexpr, WP: tl.constexpr, BS: tl.constexpr, HAS_STATE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, SILU: tl.constexpr, STATE_GRAD: tl.constexpr,
                    ACC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    pid_t, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    x_ptr += pid_b * stride_xb
    s_ptr += pid_b * stride_sb
    dy_ptr += pid_b * stride_db
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    kidx = tl.arange(0, WP)  # weight column k = tap W-1-k
    ridx = tl.arange(0, BT)
    dw = tl.zeros((WP, BC), dtype=ACC)
    db = tl.zeros((BC,), dtype=ACC)
    t_start = pid_t * CHUNK
    t_end = tl.minimum(t_start + CHUNK, T)
    for t0 in range(t_start, t_end, BT):
        rows = t0 + ridx
        dx, g = _grad_tile(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, t0, offs_c, mask_c, T, N_SEQ, LOG_N,
                           stride_xt, stride_sc, stride_sk, stride_wc, stride_wk, stride_dt,
                           W, WP, BT, BC, HAS_STATE, HAS_BIAS, VARLEN, SILU, ACC, XDT)
        tl.store(dx_ptr + pid_b * stride_dxb + rows[:, None].to(tl.int64) * stride_dxt + offs_c[None, :],
                 dx.to(XDT), mask=(rows < T)[:, None] & mask_c[None, :])
        # dweight[:, k] += sum_p g[p] * input[p - (W-1-k)] over unmasked taps
        rows3 = (rows[None, :] - (W - 1) + kidx[:, None])[:, :, None]  # (WP, BT, 1)
        xin = _load_in(x_ptr, s_ptr, rows3, t0 - (W - 1), offs_c[None, None, :],
                       (kidx < W)[:, None, None] & mask_c[None, None, :], T, stride_xt, stride_sc, stride_sk,
                       W, HAS_STATE, ACC)
        if VARLEN:
            pos = rows - _doc_start(cu_ptr, rows, N_SEQ, LOG_N)
            xin = tl.where((pos[None, :] >= (W - 1 - kidx)[:, None])[:, :, None], xin, 0.0)
        dw += tl.sum(g[None, :, :] * xin, axis=1)
        if HAS_BIAS:
            db += tl.sum(g, axis=0)
    part = part_ptr + (pid_b * tl.num_programs(0) + pid_t) * stride_gb + offs_c * stride_gc
    tl.store(part[None, :] + kidx[:, None] * stride_gk, dw, mask=(kidx < W)[:, None] & mask_c[None, :])
    if HAS_BIAS:
        tl.store(part + W * stride_gk, db, mask=mask_c)
    if STATE_GRAD:
        if pid_t == 0:  # the conv state's gradient: inputs at positions -(W-1) .. -1
            k = tl.arange(0, BS)
            ds, _ = _grad_tile(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, 1 - W, offs_c, mask_c, T, N_SEQ,
                               LOG_N, stride_xt, stride_sc, stride_sk, stride_wc, stride_wk, stride_dt,
                               W, WP, BS, BC, HAS_STATE, HAS_BIAS, VARLEN, SILU, ACC, XDT)
            tl.store(ds_ptr + pid_b * stride_ob + k[:, None] * stride_ok + offs_c[None, :] * stride_oc,
                     ds.to(ds_ptr.dtype.element_ty), mask=(k < W - 1)[:, None] & mask_c[None, :])
