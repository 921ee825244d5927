"""The RMSNorm forward kernel: one program per (row, group), the group's channels in one block."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_fwd_kernel(x, z, w, y, r, s, sx, sz, sy, sr, ss, G, eps, BG: tl.constexpr, HAS_Z: tl.constexpr,
                        HAS_W: tl.constexpr, HAS_R: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * G + tl.arange(0, BG)
    m = tl.arange(0, BG) < G
    u = tl.load(x + row * sx + o, mask=m, other=0.0).to(tl.float32)
    if HAS_R:  # the residual sum x + r, rounded to its dtype as the unfused add would round it, is what is normed
        u = (u + tl.load(r + row * sr + o, mask=m, other=0.0).to(tl.float32)).to(s.dtype.element_ty)
        tl.store(s + row * ss + o, u, mask=m)
        u = u.to(tl.float32)
    if HAS_Z:
        b_z = tl.load(z + row * sz + o, mask=m, other=0.0).to(tl.float32)
        u = u * (b_z * tl.sigmoid(b_z))
    rstd = tl.rsqrt(tl.sum(u * u, 0) / G + eps)
    out = u * rstd
    if HAS_W:
        out = out * tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * sy + o, out.to(y.dtype.element_ty), mask=m)


def _rows(t, d):
    """t as (rows, d) with unit channel stride (a view where the layout allows)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, d)


@torch.compiler.disable  # torch.compile: one opaque call
def rms_norm_fwd(x, weight, eps, z=None, group_size=None, residual=None):
    """See lm_kernels.rmsnorm. x (..., d) float16/bfloat16/float32, z and residual like x, weight (d,) or None."""
    d = x.shape[-1]
    group = group_size or d
    if d % group:
        raise ValueError(f"rms_norm: dim {d} is not a multiple of group_size {group}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"rms_norm: z has shape {tuple(z.shape)}, expected x's {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rms_norm: residual has shape {tuple(residual.shape)} and dtype {residual.dtype}, expected "
                         f"x's {tuple(x.shape)} and {x.dtype}")
    if weight is not None and weight.shape != (d,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({d},)")
    x2 = _rows(x, d)
    z2 = _rows(z, d) if z is not None else x2
    r2 = _rows(residual, d) if residual is not None else x2
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    if x2.numel():
        BG = triton.next_power_of_2(group)
        _rmsnorm_fwd_kernel[(x2.shape[0], d // group)](
            x2, z2, weight.contiguous() if weight is not None else x2, y, r2, s, x2.stride(0), z2.stride(0),
            y.stride(0), r2.stride(0), s.stride(0), group, float(eps), BG=BG, HAS_Z=z is not None,
            HAS_W=weight is not None, HAS_R=residual is not None, num_warps=min(16, max(1, BG // 512)))
    if residual is not None:
        return y.view(x.shape), s.view(x.shape)
    return y.view(x.shape)
