"""Notation and the small jitted helpers every SSD kernel uses (chunk / sequence coordinates, softplus).

Per head; a chunk is at most L consecutive tokens of one sequence:
    dt  processed step (softplus(dt + bias), clamped), cs = in-chunk cumsum of dt*A, a = cs[last]
    S_c state at the start of chunk c (S_0 = initial state), S_{c+1} = e^a S_c + sum_l w_l x_l B_l^T,
        w_l = dt_l e^{a - cs_l}
    y_m = e^{cs_m} S_c C_m + sum_{l<=m} (C_m.B_l) e^{cs_m - cs_l} dt_l x_l + D x_m, then y *= silu(z)
Backward: G_c = dLoss/dS_c runs in reverse, G_c = e^a G_{c+1} + sum_m e^{cs_m} dy_m C_m^T. dstate_bwd
stores G_{c+1} per chunk ("dstates") and then every gradient is chunk-local:
    dx_l   = dt_l * t_l + D dy_l,  t_l = e^{a-cs_l} G_{c+1} B_l + sum_{m>=l} (C_m.B_l) e^{cs_m-cs_l} dy_m
    ddt_l  = x_l.t_l  (+ the part through cs)
    Q_ml   = sum_heads (dy_m.x_l) e^{cs_m-cs_l} dt_l           (m >= l; per group)
    dC_m   = sum_heads e^{cs_m} dy_m S_c + sum_l Q_ml B_l
    dB_l   = sum_heads w_l x_l G_{c+1} + sum_m Q_ml C_m
    d(dt*A)_l = sum_{k>=l} dy_k.y_off_k + sum_{k<l} x_k.dx_state_k + <G_{c+1}, e^a S_c>
                + sum_{m>=l} sum_{s<l} (Q_h * CB)[m, s]       (all float32, no large cancelling terms)
Chunks: fixed-length batches use chunk = (batch, c); packed documents use a chunk table (the chunk's
first token and length), so chunks never cross a document boundary and states restart per document.
Internal per-token buffers (dt, cs, ...) are float32, laid out (H, B*T). Chunk states (c, h) are stored
(p, n) row-major at (c * H + h) * P * N. Products take their operands in DOT_DT (the input dtype on GPU;
float32 under the interpreter, whose bf16 dot is wrong).
"""
import triton
import triton.language as tl


@triton.jit
def chunk_coords(pid_c, T, NC, chunk_t0_ptr, chunk_len_ptr, L: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Global chunk id -> (batch, first token in the batch row, length); length 0 = no chunk."""
    if IS_VARLEN:
        b = pid_c * 0
        t0 = tl.load(chunk_t0_ptr + pid_c)
        clen = tl.load(chunk_len_ptr + pid_c)
    else:
        b = pid_c // NC
        t0 = (pid_c % NC) * L
        clen = tl.minimum(L, T - t0)
    return b, t0, clen


@triton.jit
def seq_coords(pid_s, T, NC, cu_ptr, chunk_first_ptr, IS_VARLEN: tl.constexpr):
    """Sequence id -> (batch, first token, length, first global chunk, number of chunks)."""
    if IS_VARLEN:
        b = pid_s * 0
        t_begin = tl.load(cu_ptr + pid_s).to(tl.int32)
        seqlen = tl.load(cu_ptr + pid_s + 1).to(tl.int32) - t_begin
        c_begin = tl.load(chunk_first_ptr + pid_s)
        n_chunks = tl.load(chunk_first_ptr + pid_s + 1) - c_begin
    else:
        b = pid_s
        t_begin = pid_s * 0
        seqlen = T
        c_begin = pid_s * NC
        n_chunks = NC
    return b, t_begin, seqlen, c_begin, n_chunks


@triton.jit
def state_walk_start(pid_s, pid_pn, h, start_ptr, x_ptr, B_ptr, cu_ptr, chunk_first_ptr, T, H, P, N, NC, R,
                     s_x_b, s_x_h, s_B_b, s_B_g, BP: tl.constexpr, BN: tl.constexpr, HAS_START: tl.constexpr,
                     IS_VARLEN: tl.constexpr):
    """What a program that walks one sequence's chunk states (forward or reverse) needs before its loop: its
    (BP, BN) block pid_pn of the P x N state (p / n offsets, mask, offsets in the (p, n) layout), the sequence's
    coordinates (seq_coords), the starting float32 state (start_ptr's (sequence, head) block if HAS_START, else
    zeros) and the bases of the per-token x-like (head h) and B-like (h's group) operands."""
    n_nb = tl.cdiv(N, BN)
    offs_p = (pid_pn // n_nb) * BP + tl.arange(0, BP)
    offs_n = (pid_pn % n_nb) * BN + tl.arange(0, BN)
    pn_mask = (offs_p[:, None] < P) & (offs_n[None, :] < N)
    pn_off = offs_p[:, None] * N + offs_n[None, :]
    g = h // R
    b, t_begin, seqlen, c_begin, n_chunks = seq_coords(pid_s, T, NC, cu_ptr, chunk_first_ptr, IS_VARLEN)
    if HAS_START:
        S = tl.load(start_ptr + (pid_s * H + h) * P * N + pn_off, mask=pn_mask, other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BP, BN), dtype=tl.float32)
    x_base = x_ptr + b * s_x_b + h * s_x_h
    B_base = B_ptr + b * s_B_b + g * s_B_g
    return offs_p, offs_n, pn_mask, pn_off, b, t_begin, seqlen, c_begin, n_chunks, S, x_base, B_base


@triton.jit
def softplus(v):
    return tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))
