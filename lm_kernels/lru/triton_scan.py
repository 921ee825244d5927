"""Triton kernels of the chunked block-diagonal scan h_t = A_t h_{t-1} + x_t (m x m blocks, m <= 8).

Forward, three launches (chunks of L tokens; a program owns BN blocks of one chunk of one sequence):
  1. `_fwd_chunk_kernel`  per chunk, from a zero state: the chunk's end state y_c and its transition
                          C_c = A_end ... A_start (zeroed when a document starts inside the chunk; the
                          document's initial state is injected into y_c there).
  2. `_fwd_pass_kernel`   per block, sequential over chunks: s_{c+1} = C_c s_c + y_c (chunk entry states).
  3. `_fwd_out_kernel`    per chunk, the recurrence again from s_c: writes h_t, and the final state at
                          every document end.
Backward (adjoint g_t = dh_t + A_{t+1}^T g_{t+1}, cut at document starts; dx_t = g_t,
dA_t = g_t h_{t-1}^T, dh0_doc = A_s^T g_s at the document start s), the same three steps backward in
time: `_bwd_chunk_kernel` (local adjoint from zero, r_c), `_bwd_pass_kernel` (u_{c-1} = C_c^T u_c + r_c)
and `_bwd_out_kernel` (the adjoint from u_c; writes dx, dA, dh0). h_{t-1} for dA comes from the stored
output h (so in x's dtype).

Inside a program every step is a batched m x m mat-vec on a (BN, MP, MP) register tile (MP = next power
of two >= m, masked); loads of step t+1 are issued before step t is computed. A is read through its
strides, so an expanded (stride-0) A is never copied. Accumulation in ACC (float32, or float64 for
float64 inputs). Each kernel runs under TRITON_INTERPRET=1 on CPU. Measured on an H100: docs/performance.md.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..backend import next_pow2


@triton.jit
def _doc_info(SEQ, b, t, T, IS_VARLEN: tl.constexpr):
    """(is_start, is_end, doc) of token t of sequence b."""
    if IS_VARLEN:
        sid = tl.load(SEQ + t)
        sprev = tl.load(SEQ + t - 1, mask=t > 0, other=-1)
        snext = tl.load(SEQ + t + 1, mask=t + 1 < T, other=-1)
        return sid != sprev, sid != snext, sid
    else:
        return t == 0, t == T - 1, b


@triton.jit
def _fwd_chunk_kernel(A, X, SEQ, H0, CT, YT,
                      sAb, sAt, sAn, sAi, sAj, sxb, sxt, sxn, sxi,
                      T, NB, NC,
                      M: tl.constexpr, MP: tl.constexpr, L: tl.constexpr, BN: tl.constexpr,
                      IS_VARLEN: tl.constexpr, A_ROWS: tl.constexpr, HAS_H0: tl.constexpr, ACC: tl.constexpr):
    pid_n = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, MP)
    n3 = offs_n[:, None, None]
    i3 = offs_m[None, :, None]
    j3 = offs_m[None, None, :]
    if M == MP:  # no padding inside a block: masks depend on n only, so loads vectorise along j
        mask_a = (n3 < NB) & (i3 >= 0) & (j3 >= 0)
    else:
        mask_a = (n3 < NB) & (i3 < M) & (j3 < M)
    n2 = offs_n[:, None]
    i2 = offs_m[None, :]
    if M == MP:
        mask_x = (n2 < NB) & (i2 >= 0)
    else:
        mask_x = (n2 < NB) & (i2 < M)
    if A_ROWS:  # A's blocks row-major (sAi == M, sAj == 1) and x's last dim contiguous: aligned vector loads
        a_off = n3 * sAn + i3 * M + j3
    else:
        a_off = n3 * sAn + i3 * sAi + j3 * sAj
    if A_ROWS:
        x_off = n2 * sxn + i2
    else:
        x_off = n2 * sxn + i2 * sxi
    A_b = A + b * sAb
    X_b = X + b * sxb

    t0 = c * L
    nsteps = tl.minimum(L, T - t0)
    y = tl.zeros((BN, MP), dtype=ACC)
    Ct = tl.zeros((BN, MP, MP), dtype=ACC) + tl.where(i3 == j3, 1.0, 0.0).to(ACC)  # C transposed
    a_nx = tl.load(A_b + t0 * sAt + a_off, mask=mask_a, other=0.0)
    x_nx = tl.load(X_b + t0 * sxt + x_off, mask=mask_x, other=0.0)
    for k in range(0, nsteps):
        t = t0 + k
        a = a_nx.to(ACC)
        xv = x_nx.to(ACC)
        more = k + 1 < nsteps
        a_nx = tl.load(A_b + (t + 1) * sAt + a_off, mask=tl.where(more, mask_a, False), other=0.0)
        x_nx = tl.load(X_b + (t + 1) * sxt + x_off, mask=tl.where(more, mask_x, False), other=0.0)
        is_start, is_end, doc = _doc_info(SEQ, b, t, T, IS_VARLEN)
        if HAS_H0:
            h0 = tl.load(H0 + doc * NB * M + n2 * M + i2, mask=tl.where(is_start, mask_x, False), other=0.0).to(ACC)
            y = tl.where(is_start, h0, y)
        else:
            y = tl.where(is_start, 0.0, y)
        Ct = tl.where(is_start, 0.0, Ct)
        y = tl.sum(a * y[:, None, :], axis=2) + xv
        # Ct[n, k, i] <- sum_j A[n, i, j] Ct[n, k, j]: reduce over the in-thread (contiguous) axis j
        Ct = tl.sum(a[:, None, :, :] * Ct[:, :, None, :], axis=3)
    base = (b * NC + c) * NB
    tl.store(YT + (base + n2) * M + i2, y, mask=mask_x)
    tl.store(CT + ((base + n3) * M + j3) * M + i3, Ct, mask=mask_a)


@triton.jit
def _fwd_pass_kernel(CT, YT, S, NB, NC,
                     M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr):
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, MP)
    n3 = offs_n[:, None, None]
    i3 = offs_m[None, :, None]
    j3 = offs_m[None, None, :]
    if M == MP:  # no padding inside a block: masks depend on n only, so loads vectorise along j
        mask_a = (n3 < NB) & (i3 >= 0) & (j3 >= 0)
    else:
        mask_a = (n3 < NB) & (i3 < M) & (j3 < M)
    n2 = offs_n[:, None]
    i2 = offs_m[None, :]
    if M == MP:
        mask_x = (n2 < NB) & (i2 >= 0)
    else:
        mask_x = (n2 < NB) & (i2 < M)
    s = tl.zeros((BN, MP), dtype=ACC)
    for c in range(0, NC):
        base = (b * NC + c) * NB
        tl.store(S + (base + n2) * M + i2, s, mask=mask_x)
        Cc = tl.load(CT + ((base + n3) * M + i3) * M + j3, mask=mask_a, other=0.0)
        yc = tl.load(YT + (base + n2) * M + i2, mask=mask_x, other=0.0)
        s = tl.sum(Cc * s[:, None, :], axis=2) + yc


@triton.jit
def _fwd_out_kernel(A, X, SEQ, H0, S, H, FIN,
                    sAb, sAt, sAn, sAi, sAj, sxb, sxt, sxn, sxi,
                    T, NB, NC,
                    M: tl.constexpr, MP: tl.constexpr, L: tl.constexpr, BN: tl.constexpr,
                    IS_VARLEN: tl.constexpr, A_ROWS: tl.constexpr, HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr,
                    ACC: tl.constexpr):
    pid_n = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, MP)
    n3 = offs_n[:, None, None]
    i3 = offs_m[None, :, None]
    j3 = offs_m[None, None, :]
    if M == MP:  # no padding inside a block: masks depend on n only, so loads vectorise along j
        mask_a = (n3 < NB) & (i3 >= 0) & (j3 >= 0)
    else:
        mask_a = (n3 < NB) & (i3 < M) & (j3 < M)
    n2 = offs_n[:, None]
    i2 = offs_m[None, :]
    if M == MP:
        mask_x = (n2 < NB) & (i2 >= 0)
    else:
        mask_x = (n2 < NB) & (i2 < M)
    if A_ROWS:  # A's blocks row-major (sAi == M, sAj == 1) and x's last dim contiguous: aligned vector loads
        a_off = n3 * sAn + i3 * M + j3
    else:
        a_off = n3 * sAn + i3 * sAi + j3 * sAj
    if A_ROWS:
        x_off = n2 * sxn + i2
    else:
        x_off = n2 * sxn + i2 * sxi
    A_b = A + b * sAb
    X_b = X + b * sxb
    H_b = H + b * T * NB * M

    t0 = c * L
    nsteps = tl.minimum(L, T - t0)
    h = tl.load(S + ((b * NC + c) * NB + n2) * M + i2, mask=mask_x, other=0.0)
    a_nx = tl.load(A_b + t0 * sAt + a_off, mask=mask_a, other=0.0)
    x_nx = tl.load(X_b + t0 * sxt + x_off, mask=mask_x, other=0.0)
    for k in range(0, nsteps):
        t = t0 + k
        a = a_nx.to(ACC)
        xv = x_nx.to(ACC)
        more = k + 1 < nsteps
        a_nx = tl.load(A_b + (t + 1) * sAt + a_off, mask=tl.where(more, mask_a, False), other=0.0)
        x_nx = tl.load(X_b + (t + 1) * sxt + x_off, mask=tl.where(more, mask_x, False), other=0.0)
        is_start, is_end, doc = _doc_info(SEQ, b, t, T, IS_VARLEN)
        if HAS_H0:
            h0 = tl.load(H0 + doc * NB * M + n2 * M + i2, mask=tl.where(is_start, mask_x, False), other=0.0).to(ACC)
            h = tl.where(is_start, h0, h)
        else:
            h = tl.where(is_start, 0.0, h)
        h = tl.sum(a * h[:, None, :], axis=2) + xv
        tl.store(H_b + (t * NB + n2) * M + i2, h.to(H.dtype.element_ty), mask=mask_x)
        if STORE_FINAL:
            tl.store(FIN + doc * NB * M + n2 * M + i2, h, mask=tl.where(is_end, mask_x, False))


@triton.jit
def _bwd_chunk_kernel(A, DH, SEQ, DFIN, RT,
                      sAb, sAt, sAn, sAi, sAj,
                      T, NB, NC,
                      M: tl.constexpr, MP: tl.constexpr, L: tl.constexpr, BN: tl.constexpr,
                      IS_VARLEN: tl.constexpr, A_ROWS: tl.constexpr, HAS_DFIN: tl.constexpr, ACC: tl.constexpr):
    pid_n = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, MP)
    n3 = offs_n[:, None, None]
    i3 = offs_m[None, :, None]
    j3 = offs_m[None, None, :]
    if M == MP:  # no padding inside a block: masks depend on n only, so loads vectorise along j
        mask_a = (n3 < NB) & (i3 >= 0) & (j3 >= 0)
    else:
        mask_a = (n3 < NB) & (i3 < M) & (j3 < M)
    n2 = offs_n[:, None]
    i2 = offs_m[None, :]
    if M == MP:
        mask_x = (n2 < NB) & (i2 >= 0)
    else:
        mask_x = (n2 < NB) & (i2 < M)
    if A_ROWS:  # A's blocks row-major (sAi == M, sAj == 1) and x's last dim contiguous: aligned vector loads
        a_off = n3 * sAn + i3 * M + j3
    else:
        a_off = n3 * sAn + i3 * sAi + j3 * sAj
    A_b = A + b * sAb
    DH_b = DH + b * T * NB * M

    t0 = c * L
    nsteps = tl.minimum(L, T - t0)
    t_last = t0 + nsteps - 1
    carry = tl.zeros((BN, MP), dtype=ACC)
    a_nx = tl.load(A_b + t_last * sAt + a_off, mask=mask_a, other=0.0)
    d_nx = tl.load(DH_b + (t_last * NB + n2) * M + i2, mask=mask_x, other=0.0)
    for k in range(0, nsteps):
        t = t_last - k
        a = a_nx.to(ACC)
        g = d_nx.to(ACC) + carry
        more = k + 1 < nsteps
        a_nx = tl.load(A_b + (t - 1) * sAt + a_off, mask=tl.where(more, mask_a, False), other=0.0)
        d_nx = tl.load(DH_b + ((t - 1) * NB + n2) * M + i2, mask=tl.where(more, mask_x, False), other=0.0)
        is_start, is_end, doc = _doc_info(SEQ, b, t, T, IS_VARLEN)
        if HAS_DFIN:
            g += tl.load(DFIN + doc * NB * M + n2 * M + i2, mask=tl.where(is_end, mask_x, False), other=0.0).to(ACC)
        ag = tl.sum(a * g[:, :, None], axis=1)
        carry = tl.where(is_start, 0.0, ag)
    tl.store(RT + ((b * NC + c) * NB + n2) * M + i2, carry, mask=mask_x)


@triton.jit
def _bwd_pass_kernel(CT, RT, U, NB, NC,
                     M: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr):
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, MP)
    n3 = offs_n[:, None, None]
    i3 = offs_m[None, :, None]
    j3 = offs_m[None, None, :]
    if M == MP:  # no padding inside a block: masks depend on n only, so loads vectorise along j
        mask_a = (n3 < NB) & (i3 >= 0) & (j3 >= 0)
    else:
        mask_a = (n3 < NB) & (i3 < M) & (j3 < M)
    n2 = offs_n[:, None]
    i2 = offs_m[None, :]
    if M == MP:
        mask_x = (n2 < NB) & (i2 >= 0)
    else:
        mask_x = (n2 < NB) & (i2 < M)
    u = tl.zeros((BN, MP), dtype=ACC)
    for cc in range(0, NC):
        c = NC - 1 - cc
        base = (b * NC + c) * NB
        tl.store(U + (base + n2) * M + i2, u, mask=mask_x)
        Cc = tl.load(CT + ((base + n3) * M + i3) * M + j3, mask=mask_a, other=0.0)
        r = tl.load(RT + (base + n2) * M + i2, mask=mask_x, other=0.0)
        u = tl.sum(Cc * u[:, :, None], axis=1) + r


@triton.jit
def _bwd_out_kernel(A, DH, H, SEQ, H0, DFIN, U, DA, DX, DH0,
                    sAb, sAt, sAn, sAi, sAj,
                    T, NB, NC,
                    M: tl.constexpr, MP: tl.constexpr, L: tl.constexpr, BN: tl.constexpr,
                    IS_VARLEN: tl.constexpr, A_ROWS: tl.constexpr, HAS_H0: tl.constexpr, HAS_DFIN: tl.constexpr,
                    NEED_DA: tl.constexpr, NEED_DH0: tl.constexpr, ACC: tl.constexpr):
    pid_n = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, MP)
    n3 = offs_n[:, None, None]
    i3 = offs_m[None, :, None]
    j3 = offs_m[None, None, :]
    if M == MP:  # no padding inside a block: masks depend on n only, so loads vectorise along j
        mask_a = (n3 < NB) & (i3 >= 0) & (j3 >= 0)
    else:
        mask_a = (n3 < NB) & (i3 < M) & (j3 < M)
    n2 = offs_n[:, None]
    i2 = offs_m[None, :]
    if M == MP:
        mask_x = (n2 < NB) & (i2 >= 0)
    else:
        mask_x = (n2 < NB) & (i2 < M)
    if A_ROWS:  # A's blocks row-major (sAi == M, sAj == 1) and x's last dim contiguous: aligned vector loads
        a_off = n3 * sAn + i3 * M + j3
    else:
        a_off = n3 * sAn + i3 * sAi + j3 * sAj
    A_b = A + b * sAb
    tok = b * T * NB * M  # offset of sequence b in the contiguous (b, t, nb, m) tensors

    t0 = c * L
    nsteps = tl.minimum(L, T - t0)
    t_last = t0 + nsteps - 1
    carry = tl.load(U + ((b * NC + c) * NB + n2) * M + i2, mask=mask_x, other=0.0)
    a_nx = tl.load(A_b + t_last * sAt + a_off, mask=mask_a, other=0.0)
    d_nx = tl.load(DH + tok + (t_last * NB + n2) * M + i2, mask=mask_x, other=0.0)
    for k in range(0, nsteps):
        t = t_last - k
        a = a_nx.to(ACC)
        g = d_nx.to(ACC) + carry
        more = k + 1 < nsteps
        a_nx = tl.load(A_b + (t - 1) * sAt + a_off, mask=tl.where(more, mask_a, False), other=0.0)
        d_nx = tl.load(DH + tok + ((t - 1) * NB + n2) * M + i2, mask=tl.where(more, mask_x, False), other=0.0)
        is_start, is_end, doc = _doc_info(SEQ, b, t, T, IS_VARLEN)
        if HAS_DFIN:
            g += tl.load(DFIN + doc * NB * M + n2 * M + i2, mask=tl.where(is_end, mask_x, False), other=0.0).to(ACC)
        tl.store(DX + tok + (t * NB + n2) * M + i2, g.to(DX.dtype.element_ty), mask=mask_x)
        if NEED_DA:
            prev_ok = tl.where(is_start, False, tl.where(t > 0, mask_x, False))
            hp = tl.load(H + tok + ((t - 1) * NB + n2) * M + i2, mask=prev_ok, other=0.0).to(ACC)
            if HAS_H0:
                h0 = tl.load(H0 + doc * NB * M + n2 * M + i2, mask=tl.where(is_start, mask_x, False), other=0.0).to(ACC)
                hp = tl.where(is_start, h0, hp)
            da = g[:, :, None] * hp[:, None, :]
            tl.store(DA + tok * M + ((t * NB + n3) * M + i3) * M + j3, da.to(DA.dtype.element_ty),
                     mask=mask_a)
        ag = tl.sum(a * g[:, :, None], axis=1)
        if NEED_DH0:
            tl.store(DH0 + doc * NB * M + n2 * M + i2, ag, mask=tl.where(is_start, mask_x, False))
        carry = tl.where(is_start, 0.0, ag)


# {m: (BN, BN_CHUNK, num_warps)} replaces the heuristic below for block size m: the tile sweep of `lm bench lru`
# (lm/benchmarks/lru.py) sets it per candidate and clears it after; tests/test_lru_scan_triton.py forces small tiles.
CONFIG_OVERRIDE: dict = {}


def launch_config(m: int, nb: int):
    """(MP, BN, BN_CHUNK, num_warps) for block size m and nb blocks: a fixed config, no autotuning.

    BN blocks per program keep a (BN, MP, MP) tile at ~1024 elements (2048 for MP = 4, measured); the
    forward chunk kernel, which also carries the chunk transition through a (BN, MP, MP, MP) product,
    uses BN_CHUNK <= BN.
    """
    mp = next_pow2(m)
    cap = next_pow2(nb)
    if m in CONFIG_OVERRIDE:
        bn, bn_chunk, warps = CONFIG_OVERRIDE[m]
    else:
        bn, bn_chunk, warps = 1024 // (mp * mp), max(1, 2048 // (mp * mp * mp)), 4
        if mp == 4:  # H100, B8 T2048 nb 1024: BN 128 gave fwd+bwd 2.06 ms vs 2.38 (64), 4.33 (32)
            bn = 128
    return mp, max(1, min(bn, cap)), max(1, min(bn_chunk, bn, cap)), warps
