"""silu(g) * u: one program per (row, block of BLOCK channels)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import cdiv, next_pow2


@triton.jit
def _silu_mul_kernel(g, u, y, N, sg_r, sg_c, su_r, su_c, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    b_g = tl.load(g + row * sg_r + o * sg_c, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + row * su_r + o * su_c, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * N + o, (b_g * tl.sigmoid(b_g) * b_u).to(y.dtype.element_ty), mask=m)


def _rows(t, n):
    """t as (rows, n), a view where the layout allows."""
    return t.reshape(-1, n) if t.dim() != 2 else t


@torch.compiler.disable  # torch.compile: one opaque call
def silu_mul_fwd(g, u):
    """See lm_kernels.swiglu."""
    if g.shape != u.shape:
        raise ValueError(f"silu_mul: g has shape {tuple(g.shape)}, u {tuple(u.shape)}; expected one shape")
    n = g.shape[-1]
    g2, u2 = _rows(g, n), _rows(u, n)
    y = torch.empty(g2.shape, dtype=g.dtype, device=g.device)
    if g2.numel():
        block = min(1024, next_pow2(n))
        _silu_mul_kernel[(g2.shape[0], cdiv(n, block))](
            g2, u2, y, n, g2.stride(0), g2.stride(1), u2.stride(0), u2.stride(1), BLOCK=block,
            num_warps=max(1, min(8, block // 256)))
    return y.view(g.shape)
