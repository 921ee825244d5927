"""Row-wise L2 normalisation of the query / key heads as one Triton kernel each way (the op's use_qk_l2norm).

    y = x / sqrt(sum(x^2) + eps)   over the last dim, computed in float32, stored in x's dtype

The PyTorch form (`_common.l2norm`) runs as ~6 eager kernels forward and ~8 backward inside the op, which
torch.compile treats as one opaque call: on an H100 they were ~100 ms of a 365 ms DeltaProduct-392M training step
(H100, docs/performance.md). Here the forward reads x once (any strides over its three leading
dims: q and k arrive as views of the fused projection) and writes y contiguous plus one float32 factor per row;
the backward reads y, that factor and dy once:
    r = (sum(x^2) + eps)^-1/2,  y = r x,  dx = r (dy - y sum(y dy))
Saving y rather than x costs no memory of its own: the DeltaProduct op saves y (its q and k) anyway, while x, the
short conv's output, would be kept alive only for this backward (3072 B per token per layer of DeltaProduct-392M,
~4.8 GB at micro-batch 16; docs/performance.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import cdiv, next_pow2
from ._common import L2NORM_EPS

_BR = 16  # rows per program


@triton.jit
def _load_rows(x, R, T, Hn, sb, st, sh, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """This program's BR rows (b, t, h) = divmod(row) of x, a [B, T, H, D] tensor with strides (sb, st, sh, 1), in
    float32; with the row indices, the offsets of the same rows in a contiguous [R, D] tensor, and the mask."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    r64 = rows.to(tl.int64)
    h = r64 % Hn
    t = (r64 // Hn) % T
    b = r64 // (Hn * T)
    m = (rows < R)[:, None] & (cols < D)[None, :]
    xv = tl.load(x + (b * sb + t * st + h * sh)[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
    return xv, rows, r64[:, None] * D + cols[None, :], m


@triton.jit
def _l2norm_fwd_kernel(x, y, r, R, T, Hn, sb, st, sh, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    xv, rows, out, m = _load_rows(x, R, T, Hn, sb, st, sh, D, BD, BR)
    rr = tl.rsqrt(tl.sum(xv * xv, 1) + eps)
    tl.store(y + out, (xv * rr[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(r + rows, rr, mask=rows < R)


@triton.jit
def _l2norm_bwd_kernel(y, r, dy, dx, R, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    out = rows.to(tl.int64)[:, None] * D + cols[None, :]
    m = (rows < R)[:, None] & (cols < D)[None, :]
    yv = tl.load(y + out, mask=m, other=0.0).to(tl.float32)
    rr = tl.load(r + rows, mask=rows < R, other=0.0)
    dyv = tl.load(dy + out, mask=m, other=0.0).to(tl.float32)
    s = tl.sum(yv * dyv, 1)
    tl.store(dx + out, (rr[:, None] * (dyv - yv * s[:, None])).to(dx.dtype.element_ty), mask=m)


def _geometry(x):
    if x.dim() != 4 or x.stride(-1) != 1:  # as rows of a contiguous copy (no copy when x is contiguous)
        x = x.contiguous().reshape(-1, 1, 1, x.shape[-1])
    B, T, Hn, D = x.shape
    return x, B * T * Hn, T, Hn, x.stride(0), x.stride(1), x.stride(2), D


def _fwd(x, eps):
    x, R, T, Hn, sb, st, sh, D = _geometry(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    r = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        _l2norm_fwd_kernel[(cdiv(R, _BR),)](x, y, r, R, T, Hn, sb, st, sh, eps, D=D, BD=next_pow2(D), BR=_BR,
                                            num_warps=4)
    return x, y, r


class _L2NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        _, y, r = _fwd(x, eps)
        y = y.reshape(x.shape)
        ctx.save_for_backward(y, r)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, r = ctx.saved_tensors
        R, D = r.numel(), y.shape[-1]
        dy = dy.contiguous()
        dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)
        if R:
            _l2norm_bwd_kernel[(cdiv(R, _BR),)](y, r, dy, dx, R, D=D, BD=next_pow2(D), BR=_BR, num_warps=4)
        return dx, None


def l2norm_triton(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (float32 inside, x's dtype out), contiguous; differentiable.
    x: (B, T, H, D) with any strides over B, T, H and a unit stride over D (other layouts are copied first)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _L2NormFn.apply(x, float(eps))
    return _fwd(x, float(eps))[1].reshape(x.shape)
