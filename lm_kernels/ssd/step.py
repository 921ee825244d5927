"""The one-token SSD recurrence (Mamba2 generation) as one Triton kernel.

Same contract as `naive.ssd_step` (the PyTorch reference, ~20 small kernels per call):
    dt = clamp(softplus(dt + dt_bias), *dt_limit);  S <- exp(dt A) S + dt x B^T;  y = S C + D x;  y *= silu(z)
One program per (block of headdim rows, batch x head): it loads its [BP, N] slice of the state, updates it in
registers and writes y and the new state (float32). The inputs are read through their strides, so the views the
Mamba2 mixer splits out of its conv output need no copy. `out_state` may be the input state itself: every program
reads its own slice before writing it, so the update in place (a static decode cache's buffer) is safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import cdiv, next_pow2
from .kernel_common import softplus


@triton.jit
def _ssd_step_kernel(s_in, x, dt, A, B, C, D, z, dt_bias, y, s_out,
                     H, P, N, HPG, dt_lo, dt_hi,
                     ss_b, ss_h, ss_p, ss_n, sx_b, sx_h, sx_p, sdt_b, sdt_h, sB_b, sB_g, sB_n, sC_b, sC_g, sC_n,
                     sz_b, sz_h, sz_p, sy_b, sy_h, sy_p, so_b, so_h, so_p, so_n,
                     BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, D_HP: tl.constexpr,
                     HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr,
                     A_LOG: tl.constexpr):
    i_p, i_bh = tl.program_id(0), tl.program_id(1)
    i_b = (i_bh // H).to(tl.int64)
    i_h = i_bh % H
    i_g = i_h // HPG
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    mp = o_p < P
    mn = o_n < N
    m_pn = mp[:, None] & mn[None, :]

    d = tl.load(dt + i_b * sdt_b + i_h * sdt_h).to(tl.float32)
    if HAS_BIAS:
        d += tl.load(dt_bias + i_h).to(tl.float32)
    if SOFTPLUS:
        d = softplus(d)
    if CLAMP:
        d = tl.minimum(tl.maximum(d, dt_lo), dt_hi)
    a = tl.load(A + i_h).to(tl.float32)
    if A_LOG:  # A holds the mixer's A_log parameter: A = -exp(A_log)
        a = -tl.exp(a)
    decay = tl.exp(d * a)

    b_x = tl.load(x + i_b * sx_b + i_h * sx_h + o_p * sx_p, mask=mp, other=0.0).to(tl.float32)
    b_B = tl.load(B + i_b * sB_b + i_g * sB_g + o_n * sB_n, mask=mn, other=0.0).to(tl.float32)
    b_C = tl.load(C + i_b * sC_b + i_g * sC_g + o_n * sC_n, mask=mn, other=0.0).to(tl.float32)
    p_s = s_in + i_b * ss_b + i_h * ss_h + o_p[:, None] * ss_p + o_n[None, :] * ss_n
    b_s = tl.load(p_s, mask=m_pn, other=0.0).to(tl.float32)
    b_s = b_s * decay + (d * b_x)[:, None] * b_B[None, :]
    b_y = tl.sum(b_s * b_C[None, :], 1)
    if HAS_D:
        if D_HP:
            b_y += tl.load(D + i_h * P + o_p, mask=mp, other=0.0).to(tl.float32) * b_x
        else:
            b_y += tl.load(D + i_h).to(tl.float32) * b_x
    if HAS_Z:
        b_z = tl.load(z + i_b * sz_b + i_h * sz_h + o_p * sz_p, mask=mp, other=0.0).to(tl.float32)
        b_y = b_y * b_z * tl.sigmoid(b_z)
    tl.store(y + i_b * sy_b + i_h * sy_h + o_p * sy_p, b_y.to(y.dtype.element_ty), mask=mp)
    p_o = s_out + i_b * so_b + i_h * so_h + o_p[:, None] * so_p + o_n[None, :] * so_n
    tl.store(p_o, b_s, mask=m_pn)


def ssd_step_triton(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=True,
                    dt_limit=(0.0, float("inf")), out_state=None, a_log=False):
    """Triton form of `ssd_step` (arguments checked by the caller; no float64). Returns (y (b,h,p) in x's dtype,
    new state float32: `out_state` when given, else a new tensor). a_log: A is log(-A) (computed in the kernel)."""
    b, h, p, n = state.shape
    g = B.shape[1]
    s_out = torch.empty(b, h, p, n, dtype=torch.float32, device=state.device) if out_state is None else out_state
    y = torch.empty(b, h, p, dtype=x.dtype, device=x.device)
    if b * h * p == 0:
        return y, s_out
    A, D, dt_bias = (v.contiguous() if v is not None else None for v in (A, D, dt_bias))  # indexed per head
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    BN = max(16, next_pow2(n))
    BP = min(max(16, next_pow2(p)), max(16, 2048 // BN))  # [BP, BN] fp32 tile: 16 regs / thread
    zz = z if z is not None else x
    _ssd_step_kernel[(cdiv(p, BP), b * h)](
        state, x, dt, A, B, C, D if D is not None else A, zz, dt_bias if dt_bias is not None else A, y, s_out,
        h, p, n, h // g, lo, hi if hi < float("inf") else 3.0e38,
        *state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *zz.stride(), *y.stride(),
        *s_out.stride(),
        BP=BP, BN=BN, HAS_D=D is not None, D_HP=D is not None and D.dim() == 2, HAS_Z=z is not None,
        HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), CLAMP=lo > 0.0 or hi < float("inf"),
        A_LOG=bool(a_log), num_warps=4)
    return y, s_out
