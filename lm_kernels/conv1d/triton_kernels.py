"""Triton kernels of the depthwise causal conv1d (launched by triton_conv1d.py).

Layout: x (B, T, C) read through its batch and time strides (a split view of a larger projection:
stride_t != C) with contiguous channels (the wrapper ensures stride_c == 1), so that a row of a tile is
one vectorised load. The optional x_add (same shape, its own strides, channels contiguous) is added to x
on load, in float32 (float64 for float64 x) and rounded to x's dtype, so the kernels see exactly PyTorch's
x + x_add without the sum being written. A program owns tiles of BT time steps x BC channels; tap j (0 <= j < W)
multiplies the input j steps back by weight[:, W-1-j]. "Input at position p" means x[p] (+ x_add[p]) for
p >= 0 and conv_state[:, W-1+p] for -(W-1) <= p < 0 (zero without a state); only tiles that start before
row 0 read the state (a scalar branch). With packed documents (VARLEN) tap j is masked at rows whose
position inside their document is < j; the document of a row is found by a binary search of cu_seqlens
(LOG_N steps). Shifted tiles are L1/L2 hits: DRAM sees each row about once.

Forward (conv_fwd_kernel): y = act(bias + sum_j w_j in[p - j]) in float32 (float64 for float64 x),
stored in x's dtype; the program holding the last row also writes the new conv state (the last W-1
inputs). Weight, bias and conv state are rounded to x's dtype first, as the PyTorch reference does.

Backward (conv_bwd_kernel), one pass: a program owns CHUNK rows x BC channels of one batch row and walks
its BT-row tiles from the first to the last. Per tile it recomputes z from the inputs, forms
g = dy * act'(z) in float32 (g = dy without an activation), adds g * input[p - j] to per-row dweight
partials (and g to the dbias ones), and gathers the previous tile's dx[p] = sum_s w[:, W-1-s] g[p + s] over
the taps s unmasked at row p + s (p + s < T, inside p's document). g never goes to DRAM: the earlier two-pass
backward wrote it in float32 and read it back, and on an H100 (B16 T2048 C2304 W4 bf16) its two kernels
took 0.354 + 0.160 ms against ~0.15 ms for the bytes that must move (x and dy read, dx written).
Rows p + s lie in this tile or the next one; a register tile cannot be shifted by s rows, so g goes through a
per-program float32 scratch in global memory (L1/L2 resident, a few MB in all): a ring of three BT-row slots,
tile k in slot k % 3, and the dx of tile k - 1 takes tap 0 from that tile's g (kept in registers) and taps
s >= 1 from slot rows base + s .. base + s + BT - 1, wrapping into tile k's slot. One step past the chunk's last
tile forms the g of the next chunk's first rows (zero past T) for the last tile's dx. One CTA barrier per step,
between the store of g and the shifted loads, orders everything: slot k % 3 was last read at step k - 2 (the dx
of tile k - 3), before the barrier of step k - 1. Each step fetches the next tile's own rows (x at tap 0 and dy)
by hand, so that their DRAM latency overlaps the step's work; the shifted taps then mostly hit L1. The dweight /
dbias partials are stored as one (C, W+1) float32 slice per program that the caller sums (deterministic, no
atomics); programs of the first chunk also form the conv state's gradient (inputs at rows -(W-1)..-1) from tile
0's g, in slot 0 after step 0's barrier.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _doc_index(cu_ptr, rows, N_SEQ, LOG_N):
    """Index of the document holding each row (any shape): the largest i < N_SEQ with cu[i] <= row (binary
    search); cu[i] is the document's start and cu[i + 1] (> row for rows < T) the next one's."""
    lo = tl.zeros_like(rows)
    hi = tl.zeros_like(rows) + N_SEQ
    for _ in range(LOG_N):
        mid = (lo + hi) // 2
        v = tl.load(cu_ptr + mid).to(tl.int32)
        go = v <= rows
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _doc_start(cu_ptr, rows, N_SEQ, LOG_N):
    """Start offset of the document holding each row (any shape)."""
    return tl.load(cu_ptr + _doc_index(cu_ptr, rows, N_SEQ, LOG_N)).to(tl.int32)


@triton.jit
def _load_in(x_ptr, xa_ptr, s_ptr, rows, row_min, cols, mask, T, stride_xt, stride_at, stride_sc, stride_sk,
             W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_ADD: tl.constexpr, ACC: tl.constexpr):
    """The input at positions `rows` and channels `cols` (broadcastable index tensors; `mask` masks
    channels / padding): x (+ x_add, summed in ACC and rounded to x's dtype like PyTorch's add) for
    rows >= 0, the conv state for -(W-1) <= rows < 0 (rounded to x's dtype), zero elsewhere; returned in
    the ACC dtype. `row_min` (scalar, <= every row) skips the state load for tiles that start at row 0 or
    later."""
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    in_x = (rows >= 0) & (rows < T) & mask
    r64 = rows.to(tl.int64)
    v = tl.load(x_ptr + r64 * stride_xt + cols, mask=in_x, other=0.0).to(ACC)
    if HAS_ADD:
        a = tl.load(xa_ptr + r64 * stride_at + cols, mask=in_x, other=0.0).to(ACC)
        v = (v + a).to(XDT).to(ACC)
    if HAS_STATE:
        if row_min < 0:
            in_s = (rows < 0) & (rows >= 1 - W) & mask
            sv = tl.load(s_ptr + (rows + W - 1) * stride_sk + cols * stride_sc, mask=in_s, other=0.0)
            v += sv.to(XDT).to(ACC)
    return v


@triton.jit
def _tap_in(x_ptr, xa_ptr, s_ptr, rows, row0, pos, j: tl.constexpr, offs_c, mask_c, T, stride_xt, stride_at,
            stride_sc, stride_sk, W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_ADD: tl.constexpr,
            VARLEN: tl.constexpr, ACC: tl.constexpr):
    """Tap j's operand for a tile of rows: input[rows - j], zero where the tap crosses a document start."""
    v = _load_in(x_ptr, xa_ptr, s_ptr, (rows - j)[:, None], row0 - j, offs_c[None, :], mask_c[None, :], T,
                 stride_xt, stride_at, stride_sc, stride_sk, W, HAS_STATE, HAS_ADD, ACC)
    if VARLEN:
        v = tl.where((pos >= j)[:, None], v, 0.0)
    return v


@triton.jit
def _tap_weight(w_ptr, j: tl.constexpr, offs_c, mask_c, stride_wc, stride_wk, W: tl.constexpr, XDT: tl.constexpr,
                ACC: tl.constexpr, BC: tl.constexpr):
    """Tap j's multiplier weight[:, W-1-j] as a (1, BC) row rounded to x's dtype, in ACC (zero for j >= W).
    Loaded once per program: a weight column is a strided load whose layout conversion costs a shared-memory
    round trip and two CTA barriers, which a load per tile would repeat."""
    if j < W:
        w = tl.load(w_ptr + offs_c[None, :] * stride_wc + (W - 1 - j) * stride_wk, mask=mask_c[None, :], other=0.0)
        w = w.to(XDT).to(ACC)
    else:
        w = tl.zeros((1, BC), dtype=ACC)
    return w


@triton.jit
def _pick(j: tl.constexpr, v0, v1, v2, v3, v4, v5, v6, v7):
    """v_j for a compile-time j (tensors kept in registers cannot be indexed by a loop variable)."""
    if j == 0:
        v = v0
    elif j == 1:
        v = v1
    elif j == 2:
        v = v2
    elif j == 3:
        v = v3
    elif j == 4:
        v = v4
    elif j == 5:
        v = v5
    elif j == 6:
        v = v6
    else:
        v = v7
    return v


@triton.jit
def _preact(x_ptr, xa_ptr, s_ptr, rows, row0, pos, offs_c, mask_c, T, stride_xt, stride_at, stride_sc, stride_sk,
            w0, w1, w2, w3, w4, w5, w6, w7, bias, W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_ADD: tl.constexpr, VARLEN: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """z = sum_j w_j input[rows - j] (+ bias) for a (BT, BC) tile, w_j = weight[:, W-1-j] (_tap_weight) and
    bias (1, BC) already rounded to x's dtype: taps that cross a document start (pos < j) masked."""
    z = tl.zeros((BT, BC), dtype=ACC)
    for j in tl.static_range(W):
        v = _tap_in(x_ptr, xa_ptr, s_ptr, rows, row0, pos, j, offs_c, mask_c, T, stride_xt, stride_at, stride_sc,
                    stride_sk, W, HAS_STATE, HAS_ADD, VARLEN, ACC)
        z += _pick(j, w0, w1, w2, w3, w4, w5, w6, w7) * v
    if HAS_BIAS:
        z += bias
    return z


@triton.jit
def _weights(w_ptr, b_ptr, offs_c, mask_c, stride_wc, stride_wk, W: tl.constexpr, HAS_BIAS: tl.constexpr,
             XDT: tl.constexpr, ACC: tl.constexpr, BC: tl.constexpr):
    """The eight tap multipliers (zero past W) and the bias (zero without), each (1, BC) in ACC."""
    bias = tl.zeros((1, BC), dtype=ACC)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_c[None, :], mask=mask_c[None, :], other=0.0).to(XDT).to(ACC)
    return (_tap_weight(w_ptr, 0, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC),
            _tap_weight(w_ptr, 1, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC),
            _tap_weight(w_ptr, 2, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC),
            _tap_weight(w_ptr, 3, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC),
            _tap_weight(w_ptr, 4, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC),
            _tap_weight(w_ptr, 5, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC),
            _tap_weight(w_ptr, 6, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC),
            _tap_weight(w_ptr, 7, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC),
            bias)


@triton.jit
def conv_fwd_kernel(x_ptr, xa_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, y_ptr, ns_ptr,
                    T, C, N_SEQ, LOG_N,
                    stride_xb, stride_xt, stride_ab, stride_at, stride_sb, stride_sc, stride_sk, stride_wc,
                    stride_wk, stride_yb, stride_yt, stride_nb, stride_nc, stride_nk,
                    W: tl.constexpr, BS: tl.constexpr, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_ADD: tl.constexpr, VARLEN: tl.constexpr, SILU: tl.constexpr, WRITE_STATE: tl.constexpr,
                    ACC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    pid_t, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    x_ptr += pid_b * stride_xb
    xa_ptr += pid_b * stride_ab
    s_ptr += pid_b * stride_sb
    row0 = pid_t * BT
    rows = row0 + tl.arange(0, BT)
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    pos = rows
    if VARLEN:
        pos = rows - _doc_start(cu_ptr, rows, N_SEQ, LOG_N)
    w0, w1, w2, w3, w4, w5, w6, w7, bias = _weights(w_ptr, b_ptr, offs_c, mask_c, stride_wc, stride_wk, W, HAS_BIAS,
                                                    XDT, ACC, BC)
    z = _preact(x_ptr, xa_ptr, s_ptr, rows, row0, pos, offs_c, mask_c, T, stride_xt, stride_at, stride_sc, stride_sk,
                w0, w1, w2, w3, w4, w5, w6, w7, bias, W, HAS_STATE, HAS_BIAS, HAS_ADD, VARLEN, ACC, BT, BC)
    if SILU:
        z = z / (1.0 + tl.exp(-z))
    tl.store(y_ptr + pid_b * stride_yb + rows[:, None].to(tl.int64) * stride_yt + offs_c[None, :], z.to(XDT),
             mask=(rows < T)[:, None] & mask_c[None, :])
    if WRITE_STATE:
        if (pid_t + 1) * BT >= T:  # the last tile: new state = inputs at T-(W-1) .. T-1
            k = tl.arange(0, BS)
            last = _load_in(x_ptr, xa_ptr, s_ptr, (T - (W - 1) + k)[:, None], T - (W - 1), offs_c[None, :],
                            mask_c[None, :], T, stride_xt, stride_at, stride_sc, stride_sk, W, HAS_STATE, HAS_ADD,
                            ACC)
            tl.store(ns_ptr + pid_b * stride_nb + k[:, None] * stride_nk + offs_c[None, :] * stride_nc,
                     last.to(XDT), mask=(k < W - 1)[:, None] & mask_c[None, :])


@triton.jit
def _rows_in(x_ptr, xa_ptr, rows, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD: tl.constexpr, ACC: tl.constexpr):
    """x (+ x_add, summed in ACC and rounded to x's dtype) at rows 0 <= rows < T, zero elsewhere, in x's dtype: the
    tile the backward fetches one step ahead (exactly _load_in's value, kept in half the registers)."""
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    m = ((rows >= 0) & (rows < T))[:, None] & mask_c[None, :]
    r64 = rows[:, None].to(tl.int64)
    v = tl.load(x_ptr + r64 * stride_xt + offs_c[None, :], mask=m, other=0.0)
    if HAS_ADD:
        a = tl.load(xa_ptr + r64 * stride_at + offs_c[None, :], mask=m, other=0.0)
        v = (v.to(ACC) + a.to(ACC)).to(XDT)
    return v


@triton.jit
def conv_bwd_kernel(x_ptr, xa_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, dx_ptr, ds_ptr, part_ptr, scr_ptr,
                    T, C, N_SEQ, LOG_N, CHUNK,
                    stride_xb, stride_xt, stride_ab, stride_at, stride_sb, stride_sc, stride_sk, stride_wc,
                    stride_wk, stride_db, stride_dt, stride_dxb, stride_dxt, stride_ob, stride_oc, stride_ok,
                    stride_pb, stride_pc, stride_pk, stride_rb, stride_rt,
                    W: tl.constexpr, WP: tl.constexpr, BS: tl.constexpr, HAS_STATE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, VARLEN: tl.constexpr, SILU: tl.constexpr,
                    STATE_GRAD: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """The whole backward of CHUNK rows x BC channels (module docstring): dx, the per-program dweight / dbias
    partial sums, and (first chunk, STATE_GRAD) the conv state's gradient. The partials are kept per row,
    one (BT, BC) accumulator per tap (W <= 8; the unused ones are dead code), and summed over the rows once
    after the loop: no cross-row reduction per step and tap (H100: 0.19 vs 0.52 ms at B8 T2048 C2304 W4,
    lm_kernels/conv1d/BENCH.md). One (W, BT, BC) accumulator fed by a 3-D load instead gave wrong dweight on
    the H100 at W = 3 with a conv state (right in the interpreter), so the taps are unrolled by hand.
    scr_ptr: this launch's float32 scratch, (programs along t and b) x (>= 3 BT rows) x C."""
    tl.static_assert(BS <= BT)  # the state's gradient reads g at rows 0..W-2, all in tile 0
    pid_t, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    x_ptr += pid_b * stride_xb
    xa_ptr += pid_b * stride_ab
    s_ptr += pid_b * stride_sb
    dy_ptr += pid_b * stride_db
    dx_ptr += pid_b * stride_dxb
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    scr = scr_ptr + (pid_b * tl.num_programs(0) + pid_t) * stride_rb + offs_c[None, :]  # + slot row * stride_rt
    RING: tl.constexpr = 3 * BT
    w0, w1, w2, w3, w4, w5, w6, w7, bias = _weights(w_ptr, b_ptr, offs_c, mask_c, stride_wc, stride_wk, W, HAS_BIAS,
                                                    XDT, ACC, BC)
    kidx = tl.arange(0, WP)  # weight column k = tap W-1-k
    i = tl.arange(0, BT)
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
    n_tiles = tl.cdiv(t_end - t_start, BT)
    # tile 0's own rows (tap 0 and dy), fetched ahead like every later tile's
    xn = _rows_in(x_ptr, xa_ptr, t_start + i, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD, ACC)
    dyn = tl.load(dy_ptr + (t_start + i)[:, None].to(tl.int64) * stride_dt + offs_c[None, :],
                  mask=((t_start + i) < T)[:, None] & mask_c[None, :], other=0.0)
    nxt_p = tl.zeros_like(i) + T
    g_p = tl.zeros((BT, BC), dtype=ACC)  # the previous tile's g
    # The tiles from the chunk's first to its last, then one more (the next chunk's first rows: the g the last tile's
    # dx needs). Step `it` forms tile it's g and the dx of tile it - 1 (rows p need g[p + s], s < W, from the next
    # tile). num_stages=1: no software pipelining, which could hoist the scratch loads above the barrier; the next
    # tile's own rows are fetched by hand instead, one step ahead, so that their DRAM latency overlaps this step.
    for it in tl.range(0, n_tiles + 1, num_stages=1):
        t0 = t_start + it * BT
        rows = t0 + i
        pos = rows
        nxt = tl.zeros_like(rows) + T
        if VARLEN:
            d = _doc_index(cu_ptr, rows, N_SEQ, LOG_N)
            pos = rows - tl.load(cu_ptr + d).to(tl.int32)
            nxt = tl.load(cu_ptr + d + 1).to(tl.int32)  # the next document's start (T for the last one)
        xc = xn.to(ACC)
        live = (rows < T)[:, None] & mask_c[None, :]
        g = dyn.to(ACC)
        xn = _rows_in(x_ptr, xa_ptr, rows + BT, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD, ACC)
        dyn = tl.load(dy_ptr + (rows + BT)[:, None].to(tl.int64) * stride_dt + offs_c[None, :],
                      mask=((rows + BT) < T)[:, None] & mask_c[None, :], other=0.0)
        if SILU:  # z = sum_j w_j input[p - j] (+ bias): tap 0 is the fetched tile, taps j >= 1 mostly L1 hits
            z = w0 * xc
            for j in tl.static_range(1, W):
                z += _pick(j, w0, w1, w2, w3, w4, w5, w6, w7) * _tap_in(
                    x_ptr, xa_ptr, s_ptr, rows, t0, pos, j, offs_c, mask_c, T, stride_xt, stride_at, stride_sc,
                    stride_sk, W, HAS_STATE, HAS_ADD, VARLEN, ACC)
            if HAS_BIAS:
                z += bias
            sig = 1.0 / (1.0 + tl.exp(-z))
            g = tl.where(live, g * sig * (1.0 + z * (1.0 - sig)), 0.0)  # (an inf z past T would give 0 * nan)
        gm = tl.where((rows < t_end)[:, None], g, 0.0)  # the chunk's own rows only: the last step's belong to the next
        a0 += gm * xc
        for j in tl.static_range(1, W):  # a_j[p] += g[p] * input[p - j]: per-row partials, summed after the loop
            v = _tap_in(x_ptr, xa_ptr, s_ptr, rows, t0, pos, j, offs_c, mask_c, T, stride_xt, stride_at, stride_sc,
                        stride_sk, W, HAS_STATE, HAS_ADD, VARLEN, ACC)
            if j == 1:
                a1 += gm * v
            elif j == 2:
                a2 += gm * v
            elif j == 3:
                a3 += gm * v
            elif j == 4:
                a4 += gm * v
            elif j == 5:
                a5 += gm * v
            elif j == 6:
                a6 += gm * v
            else:
                a7 += gm * v
        if HAS_BIAS:
            db2 += gm
        base = (it % 3) * BT
        tl.store(scr + (base + i)[:, None] * stride_rt, g, mask=mask_c[None, :])
        # the one barrier per step: makes this store visible to the loads below; the slot it overwrote was last read
        # two steps ago (the dx of tile it - 3), before the previous step's barrier
        tl.debug_barrier()
        if it > 0:  # dx[p] = sum_s w_s g[p + s] for the previous tile's rows p, w_s = weight[:, W-1-s]
            rows_p = rows - BT
            base_p = ((it - 1) % 3) * BT
            dx = w0 * g_p  # tap 0 from the registers, taps s >= 1 from the ring
            for s in tl.static_range(1, W):
                r = base_p + s + i
                r = tl.where(r >= RING, r - RING, r)
                ok = (rows_p + s < nxt_p) & (rows_p + s < T)
                gs = tl.load(scr + r[:, None] * stride_rt, mask=ok[:, None] & mask_c[None, :], other=0.0)
                dx += _pick(s, w0, w1, w2, w3, w4, w5, w6, w7) * gs
            tl.store(dx_ptr + rows_p[:, None].to(tl.int64) * stride_dxt + offs_c[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=(rows_p < T)[:, None] & mask_c[None, :])
        if STATE_GRAD:
            if (it == 0) & (pid_t == 0):  # inputs at rows -(W-1)+kc: sum_s w[:, W-1-s] g[q], q = row + s in 0..W-2
                kc = tl.arange(0, BS)
                ds = tl.zeros((BS, BC), dtype=ACC)
                for s in tl.static_range(1, W):
                    q = kc - (W - 1) + s
                    ok = (q >= 0) & (q < T)
                    if VARLEN:
                        ok = ok & (q - _doc_start(cu_ptr, q, N_SEQ, LOG_N) >= s)
                    gs = tl.load(scr + q[:, None] * stride_rt, mask=ok[:, None] & mask_c[None, :], other=0.0)
                    ds += _pick(s, w0, w1, w2, w3, w4, w5, w6, w7) * gs
                tl.store(ds_ptr + pid_b * stride_ob + kc[:, None] * stride_ok + offs_c[None, :] * stride_oc,
                         ds.to(ds_ptr.dtype.element_ty), mask=(kc < W - 1)[:, None] & mask_c[None, :])
        nxt_p = nxt
        g_p = g
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
def conv_wsum_kernel(part_ptr, dw_ptr, db_ptr, ROWS, NCOL, stride_pr, stride_wc, stride_wk,
                     W: tl.constexpr, HAS_BIAS: tl.constexpr, BR: tl.constexpr, BJ: tl.constexpr):
    """dweight (C, W) and dbias (C,) as the column sums of conv_bwd_kernel's partials, part (ROWS, NCOL = C * (W +
    HAS_BIAS)): column c * (W + HAS_BIAS) + k is channel c's weight column k, then its bias. One launch for both (two
    strided torch reductions before: ~11 us each at Mamba2-350M's 64 x 2304 x 5 partials), in part's dtype."""
    W1: tl.constexpr = W + HAS_BIAS
    j = tl.program_id(0) * BJ + tl.arange(0, BJ)
    jm = j < NCOL
    acc = tl.zeros((BR, BJ), dtype=part_ptr.dtype.element_ty)
    for r in range(0, ROWS, BR):
        rr = r + tl.arange(0, BR)
        acc += tl.load(part_ptr + rr[:, None].to(tl.int64) * stride_pr + j[None, :],
                       mask=(rr[:, None] < ROWS) & jm[None, :], other=0.0)
    tot = tl.sum(acc, 0)
    c = j // W1
    k = j % W1
    tl.store(dw_ptr + c * stride_wc + k * stride_wk, tot, mask=jm & (k < W))
    if HAS_BIAS:
        tl.store(db_ptr + c, tot, mask=jm & (k == W))
