"""Argument checks and the dt preprocessing shared by every SSD backend (pure functions)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..varlen import check_cu_seqlens, check_max_seqlen


def compute_dtype(*tensors) -> torch.dtype:
    """float64 when any floating input is float64, else float32 (the accumulation dtype)."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def process_dt(dt: torch.Tensor, dt_bias, dt_softplus: bool, dt_limit, dtype) -> torch.Tensor:
    """dt -> clamp(softplus(dt + dt_bias), *dt_limit) in `dtype` (bias added, softplus if asked)."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(min=lo, max=hi)
    return dt


def _shape_err(name, tensor, expected):
    return ValueError(f"ssd: `{name}` has shape {tuple(tensor.shape)}, expected {expected}")


def _check_skip_gate_bias(x, D, z, dt_bias, h, p):
    """D (h,) or (h, p), z x's shape, dt_bias (h,), each where given (the scan's and the step's check alike)."""
    if D is not None and D.shape not in ((h,), (h, p)):
        raise _shape_err("D", D, f"({h},) or ({h}, {p})")
    if z is not None and z.shape != x.shape:
        raise _shape_err("z", z, tuple(x.shape))
    if dt_bias is not None and dt_bias.shape != (h,):
        raise _shape_err("dt_bias", dt_bias, (h,))


def check_scan_args(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_limit, *, values=True,
                    max_seqlen=None):
    """Validate shapes of ssd_scan's arguments; returns (b, t, h, p, g, n, num_seqs). The offsets in cu_seqlens are
    read on the host and checked unless values=False (torch.compile would break its graph there) or `max_seqlen` is
    given (an int: the caller has checked them, lm_kernels.varlen.packed_offsets); else only their shape and dtype
    are checked, and nothing waits for the device."""
    if x.dim() != 4:
        raise ValueError(f"ssd: `x` must be (batch, seqlen, nheads, headdim), got shape {tuple(x.shape)}")
    b, t, h, p = x.shape
    if dt.shape != (b, t, h):
        raise _shape_err("dt", dt, (b, t, h))
    if A.shape != (h,):
        raise _shape_err("A", A, (h,))
    if B.dim() != 4 or B.shape[:2] != (b, t):
        raise _shape_err("B", B, f"({b}, {t}, ngroups, dstate)")
    g, n = B.shape[2], B.shape[3]
    if C.shape != B.shape:
        raise _shape_err("C", C, tuple(B.shape))
    if g < 1 or h % g != 0:
        raise ValueError(f"ssd: nheads ({h}) must be a multiple of ngroups ({g}) (B/C dim 2)")
    _check_skip_gate_bias(x, D, z, dt_bias, h, p)
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"ssd: chunk_size must be a positive int, got {chunk_size!r}")
    if len(dt_limit) != 2 or float(dt_limit[0]) > float(dt_limit[1]):
        raise ValueError(f"ssd: dt_limit must be (low, high) with low <= high, got {dt_limit!r}")
    num_seqs = b
    if cu_seqlens is not None:
        if max_seqlen is not None:
            check_max_seqlen(max_seqlen, "ssd")
        num_seqs = check_cu_seqlens(cu_seqlens, b, t if values and max_seqlen is None else None, "ssd")
    if initial_state is not None and initial_state.shape != (num_seqs, h, p, n):
        what = "num_seqs" if cu_seqlens is not None else "batch"
        raise _shape_err("initial_state", initial_state, f"({what}={num_seqs}, {h}, {p}, {n})")
    return b, t, h, p, g, n, num_seqs


def check_step_args(state, x, dt, A, B, C, D, z, dt_bias):
    if x.dim() != 3:
        raise ValueError(f"ssd_step: `x` must be (batch, nheads, headdim), got shape {tuple(x.shape)}")
    b, h, p = x.shape
    if dt.shape != (b, h):
        raise _shape_err("dt", dt, (b, h))
    if A.shape != (h,):
        raise _shape_err("A", A, (h,))
    if B.dim() != 3 or B.shape[0] != b:
        raise _shape_err("B", B, f"({b}, ngroups, dstate)")
    g, n = B.shape[1], B.shape[2]
    if C.shape != B.shape:
        raise _shape_err("C", C, tuple(B.shape))
    if h % g != 0:
        raise ValueError(f"ssd_step: nheads ({h}) must be a multiple of ngroups ({g})")
    if state.shape != (b, h, p, n):
        raise _shape_err("state", state, (b, h, p, n))
    _check_skip_gate_bias(x, D, z, dt_bias, h, p)
    return b, h, p, g, n


def apply_skip_and_gate(y, x, D, z, dtype):
    """y += D*x (D (h,) or (h,p)); then y *= silu(z). y is (..., h, p) in `dtype`."""
    if D is not None:
        Dd = D.to(dtype)
        y = y + (Dd[:, None] if Dd.dim() == 1 else Dd) * x.to(dtype)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y


def split_xbc(xbc: torch.Tensor, h: int, p: int, g: int, n: int):
    """Views x (b, t, h, p), B and C (b, t, g, n) of Mamba2's conv output x | B | C, (b, t, h*p + 2*g*n); a
    ValueError for another shape."""
    hp, gn = h * p, g * n
    if xbc.dim() != 3 or xbc.shape[-1] != hp + 2 * gn:
        raise ValueError(f"ssd_scan_xbc: xbc must be (b, t, {hp + 2 * gn}) = x | B | C for {h} heads of {p}, {g} "
                         f"groups of dstate {n}; got {tuple(xbc.shape)}")
    return (xbc[..., :hp].unflatten(-1, (h, p)), xbc[..., hp:hp + gn].unflatten(-1, (g, n)),
            xbc[..., hp + gn:].unflatten(-1, (g, n)))
