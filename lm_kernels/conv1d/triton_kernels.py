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

Backward, two forward-like passes of 2-D tiles (an H100 run of a one-pass gather, which recomputed z
at the W shifted row sets as (WP, BT, BC) tensors, took 1.1 ms at b 8, t 2048, c 2304, 16x the forward):
  conv_bwd_g_kernel: g = dy * act'(z) with z recomputed from x (stored in float32; without an
    activation g = dy and nothing is stored), and dweight / dbias partial sums: a program walks CHUNK
    rows in tiles of BT and stores one (C, W+1) float32 slice that the caller sums (deterministic);
  conv_bwd_dx_kernel: dx[p] = sum_s w_s g[p + s] over taps s unmasked at output row p + s, a gather
    (every program owns its rows, no atomics); programs of the first row tile also form the conv state's
    gradient (inputs at rows -(W-1)..-1).
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
def _preact(x_ptr, s_ptr, w_ptr, b_ptr, rows, row0, pos, offs_c, mask_c, T, stride_xt, stride_sc, stride_sk,
            stride_wc, stride_wk, W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr,
            VARLEN: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """z = sum_j w[:, W-1-j] input[rows - j] (+ bias) for a (BT, BC) tile: taps that cross a document
    start (pos < j) masked; weight and bias rounded to x's dtype, accumulated in ACC."""
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    z = tl.zeros((BT, BC), dtype=ACC)
    for j in tl.static_range(W):
        v = _load_in(x_ptr, s_ptr, (rows - j)[:, None], row0 - j, offs_c[None, :], mask_c[None, :], T,
                     stride_xt, stride_sc, stride_sk, W, HAS_STATE, ACC)
        if VARLEN:
            v = tl.where((pos >= j)[:, None], v, 0.0)
        wj = tl.load(w_ptr + offs_c * stride_wc + (W - 1 - j) * stride_wk, mask=mask_c, other=0.0)
        z += wj.to(XDT).to(ACC)[None, :] * v
    if HAS_BIAS:
        z += tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(XDT).to(ACC)[None, :]
    return z


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
    pos = rows
    if VARLEN:
        pos = rows - _doc_start(cu_ptr, rows, N_SEQ, LOG_N)
    z = _preact(x_ptr, s_ptr, w_ptr, b_ptr, rows, row0, pos, offs_c, mask_c, T, stride_xt, stride_sc, stride_sk,
                stride_wc, stride_wk, W, HAS_STATE, HAS_BIAS, VARLEN, ACC, BT, BC)
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
def conv_bwd_g_kernel(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, g_ptr, part_ptr,
                      T, C, N_SEQ, LOG_N, CHUNK,
                      stride_xb, stride_xt, stride_sb, stride_sc, stride_sk, stride_wc, stride_wk,
                      stride_db, stride_dt, stride_gb, stride_gt, stride_pb, stride_pc, stride_pk,
                      W: tl.constexpr, WP: tl.constexpr, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      VARLEN: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
                      BT: tl.constexpr, BC: tl.constexpr):
    """Backward pass 1: g = dy * act'(z) (z recomputed; stored in float32 when SILU, else g = dy is not
    stored) and the per-program dweight / dbias partial sums over CHUNK rows. The partials are kept per row,
    one (BT, BC) accumulator per tap (W <= 8; the unused ones are dead code), and summed over the rows once
    after the loop: no cross-row reduction per step and tap (H100: 0.19 vs 0.52 ms at B8 T2048 C2304 W4,
    lm_kernels/conv1d/BENCH.md). One (W, BT, BC) accumulator fed by a 3-D load instead gave wrong dweight on
    the H100 at W = 3 with a conv state (right in the interpreter), so the taps are unrolled by hand."""
    pid_t, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    x_ptr += pid_b * stride_xb
    s_ptr += pid_b * stride_sb
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    kidx = tl.arange(0, WP)  # weight column k = tap W-1-k
    a0 = tl.zeros((BT, BC), dtype=ACC)
    a1 = tl.zeros((BT, BC), dtype=ACC)
    a2 = tl.zeros((BT, BC), dtype=ACC)
    a3 = tl.zeros((BT, BC), dtype=ACC)
    a4 = tl.zeros((BT, BC), dtype=ACC)
    a5 = tl.zeros((BT, BC), dtype=ACC)
    a6 = tl.zeros((BT, BC), dtype=ACC)
    a7 = tl.zeros((BT, BC), dtype=ACC)
    db2 = tl.zeros((BT, BC), dtype=ACC)
    t_start = pid_t * CHUNK
    t_end = tl.minimum(t_start + CHUNK, T)
    for t0 in range(t_start, t_end, BT):
        rows = t0 + tl.arange(0, BT)
        live = (rows < T)[:, None] & mask_c[None, :]
        g = tl.load(dy_ptr + pid_b * stride_db + rows[:, None].to(tl.int64) * stride_dt + offs_c[None, :],
                    mask=live, other=0.0).to(ACC)
        pos = rows
        if VARLEN:
            pos = rows - _doc_start(cu_ptr, rows, N_SEQ, LOG_N)
        if SILU:
            z = _preact(x_ptr, s_ptr, w_ptr, b_ptr, rows, t0, pos, offs_c, mask_c, T, stride_xt, stride_sc,
                        stride_sk, stride_wc, stride_wk, W, HAS_STATE, HAS_BIAS, VARLEN, ACC, BT, BC)
            sig = 1.0 / (1.0 + tl.exp(-z))
            g = g * sig * (1.0 + z * (1.0 - sig))
            tl.store(g_ptr + pid_b * stride_gb + rows[:, None].to(tl.int64) * stride_gt + offs_c[None, :],
                     g.to(g_ptr.dtype.element_ty), mask=live)
        for j in tl.static_range(W):  # a_j[p] += g[p] * input[p - j]: per-row partials, summed after the loop
            v = _load_in(x_ptr, s_ptr, (rows - j)[:, None], t0 - j, offs_c[None, :], mask_c[None, :], T,
                         stride_xt, stride_sc, stride_sk, W, HAS_STATE, ACC)
            if VARLEN:
                v = tl.where((pos >= j)[:, None], v, 0.0)
            if j == 0:
                a0 += g * v
            elif j == 1:
                a1 += g * v
            elif j == 2:
                a2 += g * v
            elif j == 3:
                a3 += g * v
            elif j == 4:
                a4 += g * v
            elif j == 5:
                a5 += g * v
            elif j == 6:
                a6 += g * v
            else:
                a7 += g * v
        if HAS_BIAS:
            db2 += g
    dw = tl.zeros((WP, BC), dtype=ACC)  # weight column k = tap W-1-k
    dw = tl.where((kidx == W - 1)[:, None], tl.sum(a0, axis=0)[None, :], dw)
    if W > 1:
        dw = tl.where((kidx == W - 2)[:, None], tl.sum(a1, axis=0)[None, :], dw)
    if W > 2:
        dw = tl.where((kidx == W - 3)[:, None], tl.sum(a2, axis=0)[None, :], dw)
    if W > 3:
        dw = tl.where((kidx == W - 4)[:, None], tl.sum(a3, axis=0)[None, :], dw)
    if W > 4:
        dw = tl.where((kidx == W - 5)[:, None], tl.sum(a4, axis=0)[None, :], dw)
    if W > 5:
        dw = tl.where((kidx == W - 6)[:, None], tl.sum(a5, axis=0)[None, :], dw)
    if W > 6:
        dw = tl.where((kidx == W - 7)[:, None], tl.sum(a6, axis=0)[None, :], dw)
    if W > 7:
        dw = tl.where((kidx == W - 8)[:, None], tl.sum(a7, axis=0)[None, :], dw)
    part = part_ptr + (pid_b * tl.num_programs(0) + pid_t) * stride_pb + offs_c * stride_pc
    tl.store(part[None, :] + kidx[:, None] * stride_pk, dw, mask=(kidx < W)[:, None] & mask_c[None, :])
    if HAS_BIAS:
        tl.store(part + W * stride_pk, tl.sum(db2, axis=0), mask=mask_c)


@triton.jit
def _gather_g(g_ptr, cu_ptr, w_ptr, row0, offs_c, mask_c, T, N_SEQ, LOG_N, stride_gt, stride_wc, stride_wk,
              W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, VARLEN: tl.constexpr, ACC: tl.constexpr,
              XDT: tl.constexpr):
    """dLoss/d input[p] = sum_s w_s g[p + s] over taps s unmasked at output row p + s, p = row0 .. row0+BR-1."""
    acc = tl.zeros((BR, BC), dtype=ACC)
    for s in tl.static_range(W):
        r = row0 + s + tl.arange(0, BR)
        ok = (r >= 0) & (r < T)
        if VARLEN:
            ok = ok & (r - _doc_start(cu_ptr, r, N_SEQ, LOG_N) >= s)
        gs = tl.load(g_ptr + r[:, None].to(tl.int64) * stride_gt + offs_c[None, :], mask=ok[:, None] & mask_c[None, :],
                     other=0.0).to(ACC)
        ws = tl.load(w_ptr + offs_c * stride_wc + (W - 1 - s) * stride_wk, mask=mask_c, other=0.0)
        acc += ws.to(XDT).to(ACC)[None, :] * gs
    return acc


@triton.jit
def conv_bwd_dx_kernel(g_ptr, w_ptr, cu_ptr, dx_ptr, ds_ptr,
                       T, C, N_SEQ, LOG_N,
                       stride_gb, stride_gt, stride_wc, stride_wk, stride_dxb, stride_dxt,
                       stride_ob, stride_oc, stride_ok,
                       W: tl.constexpr, BS: tl.constexpr, VARLEN: tl.constexpr, STATE_GRAD: tl.constexpr,
                       ACC: tl.constexpr, XDT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Backward pass 2: dx[p] = sum_s w_s g[p + s] (a gather: every program owns its rows); programs of the
    first row tile also write the conv state's gradient (inputs at rows -(W-1) .. -1)."""
    pid_t, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    g_ptr += pid_b * stride_gb
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    rows = pid_t * BT + tl.arange(0, BT)
    dx = _gather_g(g_ptr, cu_ptr, w_ptr, pid_t * BT, offs_c, mask_c, T, N_SEQ, LOG_N, stride_gt, stride_wc,
                   stride_wk, W, BT, BC, VARLEN, ACC, XDT)
    tl.store(dx_ptr + pid_b * stride_dxb + rows[:, None].to(tl.int64) * stride_dxt + offs_c[None, :],
             dx.to(dx_ptr.dtype.element_ty), mask=(rows < T)[:, None] & mask_c[None, :])
    if STATE_GRAD:
        if pid_t == 0:
            k = tl.arange(0, BS)
            ds = _gather_g(g_ptr, cu_ptr, w_ptr, 1 - W, offs_c, mask_c, T, N_SEQ, LOG_N, stride_gt, stride_wc,
                           stride_wk, W, BS, BC, VARLEN, ACC, XDT)
            tl.store(ds_ptr + pid_b * stride_ob + k[:, None] * stride_ok + offs_c[None, :] * stride_oc,
                     ds.to(ds_ptr.dtype.element_ty), mask=(k < W - 1)[:, None] & mask_c[None, :])
