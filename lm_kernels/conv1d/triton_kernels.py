"""Triton kernels of the depthwise causal conv1d (launched by triton_conv1d.py).

Layout: x (B, T, C) read through its batch and time strides (a split view of a larger projection:
stride_t != C) with contiguous channels (the wrapper ensures stride_c == 1), so that a row of a tile is
one vectorised load. The optional x_add (same shape, its own strides, channels contiguous) is added to x
on load, in float32 (float64 for float64 x) and rounded to x's dtype, so the kernels see exactly PyTorch's
x + x_add without the sum being written. A forward program owns a tile of BT time steps x BC channels; tap j
(0 <= j < W) multiplies the input j steps back by weight[:, W-1-j]. "Input at position p" means x[p] (+ x_add[p]) for
p >= 0 and conv_state[:, W-1+p] for -(W-1) <= p < 0 (zero without a state); only tiles (or rows) before
row 0 read the state (a scalar branch). With packed documents (VARLEN) tap j is masked at rows whose
position inside their document is < j; the document of a row is found by a binary search of cu_seqlens
(LOG_N steps; the backward searches once per program and then follows the document starts as its rows advance).
Shifted tiles are L1/L2 hits: DRAM sees each row about once.

Forward (conv_fwd_kernel): y = act(bias + sum_j w_j in[p - j]) in float32 (float64 for float64 x),
stored in x's dtype; the program holding the last row also writes the new conv state (the last W-1
inputs). Weight, bias and conv state are rounded to x's dtype first, as the PyTorch reference does.

Backward (conv_bwd_kernel), one pass: a program owns CHUNK rows x BC channels of one batch row and walks
its rows one at a time, the channels across its threads (4 per thread). Per row p it recomputes z[p] from the
inputs, forms g[p] = dy[p] * act'(z[p]) in float32 (g = dy without an activation), adds g[p] * input[p - j] to
the dweight sums of tap j (and g[p] to dbias), and scatters g[p] into the dx of the rows p - k it reaches
(dx[p - k] += w[:, W-1-k] g[p], where p - k lies in p's document); row p - (W-1) is then complete and is stored.
The last W-1 inputs and the W-1 open dx rows are kept in registers, so a row shift is a renaming, not a memory
round trip: g never leaves the registers. Each loop step takes 4 rows and fetches the next step's 4 rows of x
and dy, so that their DRAM latency overlaps the step's work. A program forms its chunk's rows and then W-1 more
(their g completes the dx of its last rows; they are not added to its dweight sums). The dweight / dbias sums
are stored as one (C, W+1) float32 slice per program that the caller sums (deterministic, no atomics); in the
first chunk the dx rows -(W-1)..-1 that the scatter completes first are the conv state's gradient.
On an H100 (B16 T2048 C2304 W4 bf16, docs/performance.md) this takes 0.223 ms against 0.260 for the
tile-wise kernel it replaced, which staged g in a scratch ring in global memory for the row shifts (one CTA
barrier per tile); the earlier two-pass backward (g written to DRAM in float32 and read back) took 0.354 + 0.160.
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
def _x_row(x_ptr, xa_ptr, r, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD: tl.constexpr, ACC: tl.constexpr):
    """x (+ x_add, summed in ACC and rounded to x's dtype) at the row r (r < T, else zero; mask_c also masks rows
    before 0 where r may be negative), in x's dtype: what the backward fetches one loop step ahead."""
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    m = mask_c & (offs_c * 0 + r < T)  # the row as a vector: masks of the channels' shape
    v = tl.load(x_ptr + r.to(tl.int64) * stride_xt + offs_c, mask=m, other=0.0)
    if HAS_ADD:
        v = (v.to(ACC) + tl.load(xa_ptr + r.to(tl.int64) * stride_at + offs_c, mask=m, other=0.0).to(ACC)).to(XDT)
    return v


@triton.jit
def _in_before(x_ptr, xa_ptr, s_ptr, r0, j: tl.constexpr, offs_c, mask_c, T, stride_xt, stride_at, stride_sc,
               stride_sk, W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_ADD: tl.constexpr, ACC: tl.constexpr,
               BC: tl.constexpr):
    """Tap j's input for the row r0 (a scalar), the input at the one position r = r0 - j for a block of channels,
    in ACC: x (+ x_add, rounded to x's dtype) for 0 <= r < T, the conv state (rounded to x's dtype) for
    -(W-1) <= r < 0, zero elsewhere (_load_in for a row) and for taps j >= W."""
    if j < W:
        XDT: tl.constexpr = x_ptr.dtype.element_ty
        r = r0 - j
        rv = offs_c * 0 + r
        v = _x_row(x_ptr, xa_ptr, r, offs_c, mask_c & (rv >= 0), T, stride_xt, stride_at, HAS_ADD, ACC).to(ACC)
        if HAS_STATE:
            if r < 0:
                sv = tl.load(s_ptr + (r + W - 1) * stride_sk + offs_c * stride_sc, mask=mask_c & (rv >= 1 - W),
                             other=0.0)
                v += sv.to(XDT).to(ACC)
    else:
        v = tl.zeros((BC,), dtype=ACC)
    return v


@triton.jit
def _dy_row(dy_ptr, r, offs_c, mask_c, T, stride_dt):
    """dy at the row r (0 <= r < T, else zero), in its dtype."""
    return tl.load(dy_ptr + r.to(tl.int64) * stride_dt + offs_c, mask=mask_c & (offs_c * 0 + r < T), other=0.0)


@triton.jit
def _wcol(w_ptr, j: tl.constexpr, offs_c, mask_c, stride_wc, stride_wk, W: tl.constexpr, XDT: tl.constexpr,
          ACC: tl.constexpr, BC: tl.constexpr):
    """Tap j's multiplier weight[:, W-1-j] for a block of channels, rounded to x's dtype, in ACC (zero for j >= W)."""
    if j < W:
        w = tl.load(w_ptr + offs_c * stride_wc + (W - 1 - j) * stride_wk, mask=mask_c, other=0.0).to(XDT).to(ACC)
    else:
        w = tl.zeros((BC,), dtype=ACC)
    return w


@triton.jit
def conv_bwd_kernel(x_ptr, xa_ptr, s_ptr, w_ptr, b_ptr, cu_ptr, dy_ptr, dx_ptr, ds_ptr, part_ptr,
                    T, C, N_SEQ, LOG_N, CHUNK,
                    stride_xb, stride_xt, stride_ab, stride_at, stride_sb, stride_sc, stride_sk, stride_wc,
                    stride_wk, stride_db, stride_dt, stride_dxb, stride_dxt, stride_ob, stride_oc, stride_ok,
                    stride_pb, stride_pc, stride_pk,
                    W: tl.constexpr, HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr,
                    VARLEN: tl.constexpr, SILU: tl.constexpr, STATE_GRAD: tl.constexpr, ACC: tl.constexpr,
                    BC: tl.constexpr):
    """The whole backward of CHUNK rows x BC channels (module docstring), one row at a time: dx, the per-program
    dweight / dbias partial sums and (first chunk, STATE_GRAD) the conv state's gradient."""
    U: tl.constexpr = 4  # rows per loop step; the next step's rows are fetched during this one
    pid_t, pid_c, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    x_ptr += pid_b * stride_xb
    xa_ptr += pid_b * stride_ab
    s_ptr += pid_b * stride_sb
    dy_ptr += pid_b * stride_db
    dx_ptr += pid_b * stride_dxb
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask_c = offs_c < C
    w0 = _wcol(w_ptr, 0, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC)
    w1 = _wcol(w_ptr, 1, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC)
    w2 = _wcol(w_ptr, 2, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC)
    w3 = _wcol(w_ptr, 3, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC)
    w4 = _wcol(w_ptr, 4, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC)
    w5 = _wcol(w_ptr, 5, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC)
    w6 = _wcol(w_ptr, 6, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC)
    w7 = _wcol(w_ptr, 7, offs_c, mask_c, stride_wc, stride_wk, W, XDT, ACC, BC)
    bias = tl.zeros((BC,), dtype=ACC)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(XDT).to(ACC)
    zero = tl.zeros((BC,), dtype=ACC)
    t_start = pid_t * CHUNK
    t_end = tl.minimum(t_start + CHUNK, T)
    # the inputs before the first row (x, the conv state or zero): i_j = input[p - j] for the row p being formed
    i1 = _in_before(x_ptr, xa_ptr, s_ptr, t_start, 1, offs_c, mask_c, T, stride_xt, stride_at, stride_sc, stride_sk,
                    W, HAS_STATE, HAS_ADD, ACC, BC)
    i2 = _in_before(x_ptr, xa_ptr, s_ptr, t_start, 2, offs_c, mask_c, T, stride_xt, stride_at, stride_sc, stride_sk,
                    W, HAS_STATE, HAS_ADD, ACC, BC)
    i3 = _in_before(x_ptr, xa_ptr, s_ptr, t_start, 3, offs_c, mask_c, T, stride_xt, stride_at, stride_sc, stride_sk,
                    W, HAS_STATE, HAS_ADD, ACC, BC)
    i4 = _in_before(x_ptr, xa_ptr, s_ptr, t_start, 4, offs_c, mask_c, T, stride_xt, stride_at, stride_sc, stride_sk,
                    W, HAS_STATE, HAS_ADD, ACC, BC)
    i5 = _in_before(x_ptr, xa_ptr, s_ptr, t_start, 5, offs_c, mask_c, T, stride_xt, stride_at, stride_sc, stride_sk,
                    W, HAS_STATE, HAS_ADD, ACC, BC)
    i6 = _in_before(x_ptr, xa_ptr, s_ptr, t_start, 6, offs_c, mask_c, T, stride_xt, stride_at, stride_sc, stride_sk,
                    W, HAS_STATE, HAS_ADD, ACC, BC)
    i7 = _in_before(x_ptr, xa_ptr, s_ptr, t_start, 7, offs_c, mask_c, T, stride_xt, stride_at, stride_sc, stride_sk,
                    W, HAS_STATE, HAS_ADD, ACC, BC)
    # e_k: the dx of row p - k summed over the g of rows <= p (k < W - 1); row p - (W-1) is then complete
    e0 = zero
    e1 = zero
    e2 = zero
    e3 = zero
    e4 = zero
    e5 = zero
    e6 = zero
    # per-tap dweight sums a_j = sum_p g[p] input[p - j] over the chunk's rows, and dbias
    a0 = zero
    a1 = zero
    a2 = zero
    a3 = zero
    a4 = zero
    a5 = zero
    a6 = zero
    a7 = zero
    db = zero
    d_start = t_start  # the start of the document holding the row (packed sequences), and the next one's
    d_next = T
    if VARLEN:
        d = _doc_index(cu_ptr, t_start, N_SEQ, LOG_N)
        d_start = tl.load(cu_ptr + d).to(tl.int32)
        d_next = tl.load(cu_ptr + d + 1).to(tl.int32)
    # rows t_start .. t_end - 1 and then W - 1 more (their g completes the dx of the chunk's last rows)
    n_steps = tl.cdiv(t_end - t_start + W - 1, U)
    nx0 = _x_row(x_ptr, xa_ptr, t_start, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD, ACC)
    nx1 = _x_row(x_ptr, xa_ptr, t_start + 1, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD, ACC)
    nx2 = _x_row(x_ptr, xa_ptr, t_start + 2, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD, ACC)
    nx3 = _x_row(x_ptr, xa_ptr, t_start + 3, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD, ACC)
    nd0 = _dy_row(dy_ptr, t_start, offs_c, mask_c, T, stride_dt)
    nd1 = _dy_row(dy_ptr, t_start + 1, offs_c, mask_c, T, stride_dt)
    nd2 = _dy_row(dy_ptr, t_start + 2, offs_c, mask_c, T, stride_dt)
    nd3 = _dy_row(dy_ptr, t_start + 3, offs_c, mask_c, T, stride_dt)
    for step in range(0, n_steps):
        p0 = t_start + step * U
        cx0, cx1, cx2, cx3 = nx0, nx1, nx2, nx3
        cd0, cd1, cd2, cd3 = nd0, nd1, nd2, nd3
        q = p0 + U
        nx0 = _x_row(x_ptr, xa_ptr, q, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD, ACC)
        nx1 = _x_row(x_ptr, xa_ptr, q + 1, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD, ACC)
        nx2 = _x_row(x_ptr, xa_ptr, q + 2, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD, ACC)
        nx3 = _x_row(x_ptr, xa_ptr, q + 3, offs_c, mask_c, T, stride_xt, stride_at, HAS_ADD, ACC)
        nd0 = _dy_row(dy_ptr, q, offs_c, mask_c, T, stride_dt)
        nd1 = _dy_row(dy_ptr, q + 1, offs_c, mask_c, T, stride_dt)
        nd2 = _dy_row(dy_ptr, q + 2, offs_c, mask_c, T, stride_dt)
        nd3 = _dy_row(dy_ptr, q + 3, offs_c, mask_c, T, stride_dt)
        for u in tl.static_range(U):
            p = p0 + u
            xr = _pick(u, cx0, cx1, cx2, cx3, cx3, cx3, cx3, cx3).to(ACC)  # u < U = 4
            g = _pick(u, cd0, cd1, cd2, cd3, cd3, cd3, cd3, cd3).to(ACC)
            pos = p  # the row's position in its document: tap j reaches back into it only if pos >= j
            if VARLEN:
                while (p >= d_next) & (d < N_SEQ - 1):  # rows past T stay in the last document
                    d += 1
                    d_start = d_next
                    d_next = tl.load(cu_ptr + d + 1).to(tl.int32)
                pos = p - d_start
            # tap j's input masked where it crosses a document start
            v1 = i1
            v2 = i2
            v3 = i3
            v4 = i4
            v5 = i5
            v6 = i6
            v7 = i7
            if VARLEN:
                v1 = tl.where(pos >= 1, i1, 0.0)
                v2 = tl.where(pos >= 2, i2, 0.0)
                v3 = tl.where(pos >= 3, i3, 0.0)
                v4 = tl.where(pos >= 4, i4, 0.0)
                v5 = tl.where(pos >= 5, i5, 0.0)
                v6 = tl.where(pos >= 6, i6, 0.0)
                v7 = tl.where(pos >= 7, i7, 0.0)
            if SILU:
                z = w0 * xr + bias
                if W > 1:
                    z += w1 * v1
                if W > 2:
                    z += w2 * v2
                if W > 3:
                    z += w3 * v3
                if W > 4:
                    z += w4 * v4
                if W > 5:
                    z += w5 * v5
                if W > 6:
                    z += w6 * v6
                if W > 7:
                    z += w7 * v7
                sig = 1.0 / (1.0 + tl.exp(-z))
                g = g * sig * (1.0 + z * (1.0 - sig))  # rows past T have dy = 0 and a finite z: g = 0
            # dweight / dbias from the chunk's own rows only (the rows after it belong to the next program)
            gm = tl.where(p < t_end, g, 0.0)
            a0 += gm * xr
            if W > 1:
                a1 += gm * v1
            if W > 2:
                a2 += gm * v2
            if W > 3:
                a3 += gm * v3
            if W > 4:
                a4 += gm * v4
            if W > 5:
                a5 += gm * v5
            if W > 6:
                a6 += gm * v6
            if W > 7:
                a7 += gm * v7
            if HAS_BIAS:
                db += gm
            # g[p] reaches dx[p - k] through tap k when p - k lies in p's document (pos >= k)
            gk1 = g
            gk2 = g
            gk3 = g
            gk4 = g
            gk5 = g
            gk6 = g
            gk7 = g
            if VARLEN:
                gk1 = tl.where(pos >= 1, g, 0.0)
                gk2 = tl.where(pos >= 2, g, 0.0)
                gk3 = tl.where(pos >= 3, g, 0.0)
                gk4 = tl.where(pos >= 4, g, 0.0)
                gk5 = tl.where(pos >= 5, g, 0.0)
                gk6 = tl.where(pos >= 6, g, 0.0)
                gk7 = tl.where(pos >= 7, g, 0.0)
            if W == 1:
                done = w0 * g
            elif W == 2:
                done = e0 + w1 * gk1
            elif W == 3:
                done = e1 + w2 * gk2
            elif W == 4:
                done = e2 + w3 * gk3
            elif W == 5:
                done = e3 + w4 * gk4
            elif W == 6:
                done = e4 + w5 * gk5
            elif W == 7:
                done = e5 + w6 * gk6
            else:
                done = e6 + w7 * gk7
            if W > 7:
                e6 = e5 + w6 * gk6
            if W > 6:
                e5 = e4 + w5 * gk5
            if W > 5:
                e4 = e3 + w4 * gk4
            if W > 4:
                e3 = e2 + w3 * gk3
            if W > 3:
                e2 = e1 + w2 * gk2
            if W > 2:
                e1 = e0 + w1 * gk1
            if W > 1:
                e0 = w0 * g
            r = p - (W - 1)  # the completed row: this chunk's dx, or (first chunk) the conv state's gradient
            tl.store(dx_ptr + r.to(tl.int64) * stride_dxt + offs_c, done.to(dx_ptr.dtype.element_ty),
                     mask=mask_c & (offs_c * 0 + r >= t_start) & (offs_c * 0 + r < t_end))
            if STATE_GRAD:
                if r < 0:
                    tl.store(ds_ptr + pid_b * stride_ob + (r + W - 1) * stride_ok + offs_c * stride_oc,
                             done.to(ds_ptr.dtype.element_ty), mask=mask_c)
            if W > 7:
                i7 = i6
            if W > 6:
                i6 = i5
            if W > 5:
                i5 = i4
            if W > 4:
                i4 = i3
            if W > 3:
                i3 = i2
            if W > 2:
                i2 = i1
            if W > 1:
                i1 = xr
    part = part_ptr + (pid_b * tl.num_programs(0) + pid_t) * stride_pb + offs_c * stride_pc
    tl.store(part + (W - 1) * stride_pk, a0, mask=mask_c)  # weight column W-1-j: tap j
    if W > 1:
        tl.store(part + (W - 2) * stride_pk, a1, mask=mask_c)
    if W > 2:
        tl.store(part + (W - 3) * stride_pk, a2, mask=mask_c)
    if W > 3:
        tl.store(part + (W - 4) * stride_pk, a3, mask=mask_c)
    if W > 4:
        tl.store(part + (W - 5) * stride_pk, a4, mask=mask_c)
    if W > 5:
        tl.store(part + (W - 6) * stride_pk, a5, mask=mask_c)
    if W > 6:
        tl.store(part + (W - 7) * stride_pk, a6, mask=mask_c)
    if W > 7:
        tl.store(part + (W - 8) * stride_pk, a7, mask=mask_c)
    if HAS_BIAS:
        tl.store(part + W * stride_pk, db, mask=mask_c)


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
