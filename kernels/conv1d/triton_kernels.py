"""Triton kernels of the depthwise causal conv1d (launched by triton_conv1d.py).

Layout: x (B, T, C) read through its strides (a split view of a larger projection: stride_t != C),
channels innermost so that a row of a tile is one vectorised load. A program owns a tile of BT
time steps x BC channels; tap j (0 <= j < W) multiplies the input j steps back by weight[:, W-1-j].
"Input at position p" means x[p] for p >= 0 and conv_state[:, W-1+p] for -(W-1) <= p < 0 (zero
without a state). Shifted tiles are re-read per tap (they are L1/L2 hits: DRAM sees each row once
per program plus a W-1 row halo). With packed documents (VARLEN) tap j is masked at rows whose
position inside their document is < j; the document start of a row is found by a binary search of
cu_seqlens (LOG_N steps).

Forward (conv_fwd_kernel): y = act(bias + sum_j w_j in[p - j]) in float32 (float64 for float64 x),
stored in x's dtype; the program holding the last row also writes the new conv state (the last W-1
inputs). Weight, bias and conv state are rounded to x's dtype first, as the PyTorch reference does.

Backward (conv_bwd_kernel): g[r] = dy[r] * act'(z[r]) with the pre-activation z recomputed from x;
dx[p] = sum_s w_s g[p + s] (tap s of output p + s unmasked), computed by gathering: for each s the
program recomputes g at rows p + s (W^2 tap products, from cached loads), so no program writes rows
of another and no atomics are needed. A program walks CHUNK rows in tiles of BT and keeps its
dweight / dbias partial sums (W + 1, BC) in registers, stored once per program into a float32 buffer
that the caller sums (deterministic). Programs of the first chunk also form the conv state's
gradient (rows -(W-1)..-1, the same gather).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _doc_start(cu_ptr, rows, N_SEQ, LOG_N):
    """Start offset of the document holding each row: the largest cu[i] <= row (binary search)."""
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
def _load_in(x_ptr, s_ptr, rows, offs_c, mask_c, T, stride_xt, stride_xc, stride_sc, stride_sk,
             W: tl.constexpr, HAS_STATE: tl.constexpr, ACC: tl.constexpr):
    """The input at positions `rows` (BR,) x channels `offs_c` (BC,): x for rows >= 0, the conv state for
    -(W-1) <= rows < 0 (rounded to x's dtype), zero elsewhere; returned in the ACC dtype."""
    in_x = (rows >= 0) & (rows < T)
    v = tl.load(x_ptr + rows[:, None] * stride_xt + offs_c[None, :] * stride_xc,
                mask=in_x[:, None] & mask_c[None, :], other=0.0).to(ACC)
    if HAS_STATE:
        in_s = (rows < 0) & (rows >= 1 - W)
        sv = tl.load(s_ptr + (rows + W - 1)[:, None] * stride_sk + offs_c[None, :] * stride_sc,
                     mask=in_s[:, None] & mask_c[None, :], other=0.0)
        v += sv.to(x_ptr.dtype.element_ty).to(ACC)
    return v


@triton.jit
def _tap_weight(w_ptr, offs_c, mask_c, stride_wc, stride_wk, j, W: tl.constexpr, ACC: tl.constexpr,
                XDT: tl.constexpr):
    """weight[:, W-1-j] (the tap looking j steps back), rounded to x's dtype, as ACC."""
    return tl.load(w_ptr + offs_c * stride_wc + (W - 1 - j) * stride_wk, mask=mask_c, other=0.0).to(XDT).to(ACC)


@triton.jit
def _preact(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, rows, offs_c, mask_c, T, N_SEQ, LOG_N,
            stride_xt, stride_xc, stride_sc, stride_sk, stride_wc, stride_wk,
            W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, HAS_STATE: tl.constexpr,
            HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, ACC: tl.constexpr, XDT: tl.constexpr):
    """Pre-activation z at output rows `rows` (BR,): bias + sum over unmasked taps."""
    z = tl.zeros((BR, BC), dtype=ACC)
    if VARLEN:
        pos = rows - _doc_start(cu_ptr, rows, N_SEQ, LOG_N)
    for j in tl.static_range(W):
        v = _load_in(x_ptr, s_ptr, rows - j, offs_c, mask_c, T, stride_xt, stride_xc, stride_sc, stride_sk,
                     W, HAS_STATE, ACC)
        if VARLEN:
            v = tl.where((pos >= j)[:, None], v, 0.0)
        z += _tap_weight(w_ptr, offs_c, mask_c, stride_wc, stride_wk, j, W, ACC, XDT)[None, :] * v
    if HAS_BIAS:
        z += tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(XDT).to(ACC)[None, :]
    return z


@triton.jit
def conv_fwd_kernel(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, y_ptr, ns_ptr,
                    T, C, N_SEQ, LOG_N,
                    stride_xb, stride_xt, stride_xc, stride_sb, stride_sc, stride_sk, stride_wc, stride_wk,
                    stride_yb, stride_yt, stride_nb, stride_nc, stride_nk,
                    W: tl.constexpr, BS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    VARLEN: tl.constexpr, SILU: tl.constexpr, WRITE_STATE: tl.constexpr, ACC: tl.constexpr,
                    BT: tl.constexpr, BC: tl.constexpr):
    pid_t, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    x_ptr += pid_b * stride_xb
    s_ptr += pid_b * stride_sb
    rows = pid_t * BT + tl.arange(0, BT)
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    z = _preact(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, rows, offs_c, mask_c, T, N_SEQ, LOG_N,
                stride_xt, stride_xc, stride_sc, stride_sk, stride_wc, stride_wk,
                W, BT, BC, HAS_STATE, HAS_BIAS, VARLEN, ACC, XDT)
    if SILU:
        z = z / (1.0 + tl.exp(-z))
    tl.store(y_ptr + pid_b * stride_yb + rows[:, None] * stride_yt + offs_c[None, :], z.to(XDT),
             mask=(rows < T)[:, None] & mask_c[None, :])
    if WRITE_STATE:
        if (pid_t + 1) * BT >= T:  # the last tile: new state = inputs at T-(W-1) .. T-1
            k = tl.arange(0, BS)
            v = _load_in(x_ptr, s_ptr, T - (W - 1) + k, offs_c, mask_c, T, stride_xt, stride_xc, stride_sc,
                         stride_sk, W, HAS_STATE, ACC)
            tl.store(ns_ptr + pid_b * stride_nb + k[:, None] * stride_nk + offs_c[None, :] * stride_nc,
                     v.to(XDT), mask=(k < W - 1)[:, None] & mask_c[None, :])


@triton.jit
def _grad_preact(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, rows, offs_c, mask_c, T, N_SEQ, LOG_N,
                 stride_xt, stride_xc, stride_sc, stride_sk, stride_wc, stride_wk, stride_dt,
                 W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, HAS_STATE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
                 XDT: tl.constexpr):
    """dLoss/dz at output rows `rows` (zero outside 0 <= row < T)."""
    live = (rows >= 0) & (rows < T)
    g = tl.load(dy_ptr + rows[:, None] * stride_dt + offs_c[None, :], mask=live[:, None] & mask_c[None, :],
                other=0.0).to(ACC)
    if SILU:
        z = _preact(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, rows, offs_c, mask_c, T, N_SEQ, LOG_N,
                    stride_xt, stride_xc, stride_sc, stride_sk, stride_wc, stride_wk,
                    W, BR, BC, HAS_STATE, HAS_BIAS, VARLEN, ACC, XDT)
        sig = 1.0 / (1.0 + tl.exp(-z))
        g = g * sig * (1.0 + z * (1.0 - sig))
    return g


@triton.jit
def _grad_input(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, rows, offs_c, mask_c, T, N_SEQ, LOG_N,
                stride_xt, stride_xc, stride_sc, stride_sk, stride_wc, stride_wk, stride_dt,
                W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, HAS_STATE: tl.constexpr,
                HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
                XDT: tl.constexpr):
    """dLoss/d(input at positions `rows`) = sum_s w_s g[rows + s] over unmasked taps s; also returns g[rows]."""
    dx = tl.zeros((BR, BC), dtype=ACC)
    g0 = tl.zeros((BR, BC), dtype=ACC)
    for s in tl.static_range(W):
        r = rows + s
        g = _grad_preact(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, r, offs_c, mask_c, T, N_SEQ, LOG_N,
                         stride_xt, stride_xc, stride_sc, stride_sk, stride_wc, stride_wk, stride_dt,
                         W, BR, BC, HAS_STATE, HAS_BIAS, VARLEN, SILU, ACC, XDT)
        if s == 0:
            g0 = g
        if VARLEN:
            g = tl.where((r - _doc_start(cu_ptr, r, N_SEQ, LOG_N) >= s)[:, None], g, 0.0)
        dx += _tap_weight(w_ptr, offs_c, mask_c, stride_wc, stride_wk, s, W, ACC, XDT)[None, :] * g
    return dx, g0


@triton.jit
def conv_bwd_kernel(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, dx_ptr, ds_ptr, part_ptr,
                    T, C, N_SEQ, LOG_N, CHUNK,
                    stride_xb, stride_xt, stride_xc, stride_sb, stride_sc, stride_sk, stride_wc, stride_wk,
                    stride_db, stride_dt, stride_dxb, stride_dxt, stride_gb, stride_gc, stride_gk,
                    stride_ob, stride_oc, stride_ok,
                    W: tl.constexpr, BS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    VARLEN: tl.constexpr, SILU: tl.constexpr, STATE_GRAD: tl.constexpr, ACC: tl.constexpr,
                    WB: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    pid_t, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    x_ptr += pid_b * stride_xb
    s_ptr += pid_b * stride_sb
    dy_ptr += pid_b * stride_db
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    taps = tl.arange(0, WB)  # rows of the partial buffer: weight column k (tap W-1-k) for k < W, bias at W
    part = tl.zeros((WB, BC), dtype=ACC)
    t_start = pid_t * CHUNK
    t_end = tl.minimum(t_start + CHUNK, T)
    for t0 in range(t_start, t_end, BT):
        rows = t0 + tl.arange(0, BT)
        dx, g = _grad_input(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, rows, offs_c, mask_c, T, N_SEQ, LOG_N,
                            stride_xt, stride_xc, stride_sc, stride_sk, stride_wc, stride_wk, stride_dt,
                            W, BT, BC, HAS_STATE, HAS_BIAS, VARLEN, SILU, ACC, XDT)
        tl.store(dx_ptr + pid_b * stride_dxb + rows[:, None] * stride_dxt + offs_c[None, :], dx.to(XDT),
                 mask=(rows < T)[:, None] & mask_c[None, :])
        if VARLEN:
            pos = rows - _doc_start(cu_ptr, rows, N_SEQ, LOG_N)
        for j in tl.static_range(W):
            v = _load_in(x_ptr, s_ptr, rows - j, offs_c, mask_c, T, stride_xt, stride_xc, stride_sc, stride_sk,
                         W, HAS_STATE, ACC)
            if VARLEN:
                v = tl.where((pos >= j)[:, None], v, 0.0)
            part += tl.where((taps == W - 1 - j)[:, None], tl.sum(g * v, axis=0)[None, :], 0.0)
        if HAS_BIAS:
            part += tl.where((taps == W)[:, None], tl.sum(g, axis=0)[None, :], 0.0)
    tl.store(part_ptr + (pid_b * tl.num_programs(0) + pid_t) * stride_gb + taps[:, None] * stride_gk
             + offs_c[None, :] * stride_gc, part, mask=(taps <= W)[:, None] & mask_c[None, :])
    if STATE_GRAD:
        if pid_t == 0:  # the conv state's gradient: inputs at positions -(W-1) .. -1
            k = tl.arange(0, BS)
            ds, _ = _grad_input(x_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, k - (W - 1), offs_c, mask_c, T, N_SEQ,
                                LOG_N, stride_xt, stride_xc, stride_sc, stride_sk, stride_wc, stride_wk, stride_dt,
                                W, BS, BC, HAS_STATE, HAS_BIAS, VARLEN, SILU, ACC, XDT)
            tl.store(ds_ptr + pid_b * stride_ob + k[:, None] * stride_ok + offs_c[None, :] * stride_oc,
                     ds.to(ds_ptr.dtype.element_ty), mask=(k < W - 1)[:, None] & mask_c[None, :])
