"""The RMSNorm kernels and the gated norm's custom operators.

Forward (`rms_norm_fwd`): one program per (row, group), the group's channels in one block; it is both the no-grad
call (`lm_kernels.rmsnorm.rms_norm_triton`) and the forward of lm::gated_rms_norm_fwd, which also writes the
per-group rstd for the backward.

Backward of the gated norm (`gated_rms_norm_bwd_launch`): one pass. A program takes a chunk of consecutive rows of one
group (grid: (row chunks, groups)) and walks it BR rows at a time: it reads x, z (+ z_add) and dy, writes dx and dz,
and keeps the weight gradient's sum over its rows in registers, stored once as a float32 partial (row chunk, group's
channels). Each step's rows are loaded during the step before, so that two steps' loads are in flight (at 2
programs of 16 warps per SM, one step's alone left the pass latency-bound: 0.28 -> 0.245 ms per Mamba2-350M layer on
an H100). The caller sums the partials over the chunks: deterministic, no atomics.
(Inductor's backward of the traced formula is two kernels: 0.47 ms per Mamba2-350M layer on an H100 at 16 x 2048
tokens, bf16, where this pass's bytes take ~0.22 ms.)

lm::gated_rms_norm_fwd / lm::gated_rms_norm_bwd are the gated norm's one Triton path, eager and under torch.compile
(one opaque node each: no autograd.Function for dynamo to trace). On CPU the kernels run under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..autotune import autotune, launch, tuning
from ..backend import CUSTOM_OP_TAGS, absent, cdiv, interpreted, next_pow2, num_sms, on_side

@triton.jit
def _rmsnorm_fwd_kernel(x, z, za, w, y, r, rsc, s, rs, sx, sz, sza, sy, sr, ss, G, NG, eps, BG: tl.constexpr,
                        HAS_Z: tl.constexpr, HAS_ADD: tl.constexpr, HAS_W: tl.constexpr, HAS_R: tl.constexpr,
                        HAS_RS: tl.constexpr, WRITE_RSTD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1)
    o = grp * G + tl.arange(0, BG)
    m = tl.arange(0, BG) < G
    u = tl.load(x + row * sx + o, mask=m, other=0.0).to(tl.float32)
    if HAS_R:  # the residual sum x + r, rounded to its dtype as the unfused add would round it, is what is normed
        b_r = tl.load(r + row * sr + o, mask=m, other=0.0)
        if HAS_RS:  # r scaled per row first, rounded to r's dtype: (r * scale).to(r.dtype) + x
            b_r = (b_r.to(tl.float32) * tl.load(rsc + row)).to(r.dtype.element_ty)
        u = (u + b_r.to(tl.float32)).to(s.dtype.element_ty)
        tl.store(s + row * ss + o, u, mask=m)
        u = u.to(tl.float32)
    if HAS_Z:
        b_z = tl.load(z + row * sz + o, mask=m, other=0.0).to(tl.float32)
        if HAS_ADD:  # the gate's input z + z_add, rounded to z's dtype as the PyTorch add rounds it
            b_z = (b_z + tl.load(za + row * sza + o, mask=m, other=0.0).to(tl.float32)).to(z.dtype.element_ty)
            b_z = b_z.to(tl.float32)
        u = u * (b_z * tl.sigmoid(b_z))
    rstd = tl.rsqrt(tl.sum(u * u, 0) / G + eps)
    if WRITE_RSTD:
        tl.store(rs + row * NG + grp, rstd)
    out = u * rstd
    if HAS_W:
        out = out * tl.load(w + o, mask=m, other=0.0).to(tl.float32)
    tl.store(y + row * sy + o, out.to(y.dtype.element_ty), mask=m)


@triton.jit
def _gated_bwd_rows(x, z, za, dy, rs, r0, end, cols, cm, sx, sz, sza, sdy, grp, NG, BR: tl.constexpr,
                    HAS_ADD: tl.constexpr):
    """x, z, z_add (z again without it), dy (in their dtypes) and rstd of rows r0 .. r0 + BR - 1 (< end)."""
    rows = r0 + tl.arange(0, BR)
    rm = rows < end
    m = rm[:, None] & cm[None, :]
    b_x = tl.load(x + rows[:, None] * sx + cols[None, :], mask=m, other=0.0)
    b_z = tl.load(z + rows[:, None] * sz + cols[None, :], mask=m, other=0.0)
    b_za = b_z
    if HAS_ADD:
        b_za = tl.load(za + rows[:, None] * sza + cols[None, :], mask=m, other=0.0)
    b_dy = tl.load(dy + rows[:, None] * sdy + cols[None, :], mask=m, other=0.0)
    return b_x, b_z, b_za, b_dy, tl.load(rs + rows * NG + grp, mask=rm, other=0.0)


@triton.jit
def _gated_rmsnorm_bwd_kernel(dy, x, z, za, w, rs, dx, dz, part, sdy, sx, sz, sza, sdx, sdz, sp, N, G, NG, CHUNK,
                              BG: tl.constexpr, BR: tl.constexpr, HAS_ADD: tl.constexpr, HAS_W: tl.constexpr,
                              DY_SCALED: tl.constexpr):
    """Rows [pid * CHUNK, min(N, (pid + 1) * CHUNK)) of group program_id(1); per row (all in float32, per group)
    s = z (+ z_add), gate = silu(s), u = x * gate, xhat = u * rstd, g = dy * w,
    du = rstd * (g - xhat * mean(g * xhat)), dx = du * gate, dz = du * x * silu'(s), dweight += dy * xhat.
    DY_SCALED (no weight): dy is rstd times xhat's gradient (the folded norm, lm_kernels.mamba2), g = dy / rstd.
    BR rows per loop step (tuned, _bwd_kernel)."""
    grp = tl.program_id(1)
    start = tl.program_id(0).to(tl.int64) * CHUNK
    end = tl.minimum(start + CHUNK, N)
    cols = grp * G + tl.arange(0, BG)
    cm = tl.arange(0, BG) < G
    if HAS_W:
        b_w = tl.load(w + cols, mask=cm, other=0.0).to(tl.float32)
    acc = tl.zeros((BR, BG), dtype=tl.float32)  # dy * xhat of this program's rows, reduced once at the end
    # the loop step's rows are fetched one step ahead (their DRAM latency overlaps the step before)
    n_x, n_z, n_za, n_dy, n_rs = _gated_bwd_rows(x, z, za, dy, rs, start, end, cols, cm, sx, sz, sza, sdy, grp, NG, BR,
                                                 HAS_ADD)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        rm = rows < end
        m = rm[:, None] & cm[None, :]
        b_x = n_x.to(tl.float32)
        b_z = n_z.to(tl.float32)
        if HAS_ADD:  # as in the forward: the sum rounded to z's dtype
            b_z = (b_z + n_za.to(tl.float32)).to(z.dtype.element_ty).to(tl.float32)
        b_dy = n_dy.to(tl.float32)
        rstd = n_rs
        n_x, n_z, n_za, n_dy, n_rs = _gated_bwd_rows(x, z, za, dy, rs, r0 + BR, end, cols, cm, sx, sz, sza, sdy, grp,
                                                     NG, BR, HAS_ADD)
        sig = tl.sigmoid(b_z)
        gate = b_z * sig
        xhat = b_x * gate * rstd[:, None]
        g = b_dy
        if DY_SCALED:  # (rows past the end load rstd 0: divide by 1 there)
            g = g / tl.where(rstd > 0.0, rstd, 1.0)[:, None]
        if HAS_W:
            acc += b_dy * xhat
            g = g * b_w[None, :]
        c = tl.sum(g * xhat, 1) / G
        du = rstd[:, None] * (g - xhat * c[:, None])
        tl.store(dx + rows[:, None] * sdx + cols[None, :], (du * gate).to(dx.dtype.element_ty), mask=m)
        b_dz = du * b_x * sig * (1.0 + b_z * (1.0 - sig))
        tl.store(dz + rows[:, None] * sdz + cols[None, :], b_dz.to(dz.dtype.element_ty), mask=m)
    if HAS_W:
        tl.store(part + tl.program_id(0).to(tl.int64) * sp + cols, tl.sum(acc, 0), mask=cm)


@triton.jit
def _norm_bwd_rows(dy, ds, u, rs, r, rsc, r0, end, cols, cm, sdy, sds, su, sr, BR: tl.constexpr, HAS_DS: tl.constexpr,
                   HAS_RS: tl.constexpr, WRITE_DRS: tl.constexpr):
    """dy, ds, the normed input u, the residual r (in their dtypes; ds and r: dy again where absent), rstd and the
    residual's row scale of rows r0 .. r0 + BR - 1 (< end)."""
    rows = r0 + tl.arange(0, BR)
    rm = rows < end
    m = rm[:, None] & cm[None, :]
    b_dy = tl.load(dy + rows[:, None] * sdy + cols[None, :], mask=m, other=0.0)
    b_u = tl.load(u + rows[:, None] * su + cols[None, :], mask=m, other=0.0)
    b_ds = b_dy
    if HAS_DS:
        b_ds = tl.load(ds + rows[:, None] * sds + cols[None, :], mask=m, other=0.0)
    b_rs = tl.load(rs + rows, mask=rm, other=0.0)
    b_r = b_dy
    b_sc = b_rs
    if HAS_RS:
        b_sc = tl.load(rsc + rows, mask=rm, other=0.0)
    if WRITE_DRS:
        b_r = tl.load(r + rows[:, None] * sr + cols[None, :], mask=m, other=0.0)
    return b_dy, b_ds, b_u, b_r, b_rs, b_sc


@triton.jit
def _rmsnorm_bwd_kernel(dy, ds, u, w, rs, r, rsc, dx, dr, drs, part, sdy, sds, su, sr, sdx, sdr, sp, N, G, NG, CHUNK,
                        BG: tl.constexpr, BR: tl.constexpr, HAS_DS: tl.constexpr, HAS_W: tl.constexpr,
                        WRITE_DR: tl.constexpr, HAS_RS: tl.constexpr, WRITE_DRS: tl.constexpr):
    """The plain norm's backward (one group: the whole row, G channels) over rows [pid * CHUNK, min(N, (pid + 1) *
    CHUNK)); per row, in float32: xhat = u * rstd (u: what was normed, the residual sum where there was one),
    g = dy * w, t = rstd * (g - xhat * mean(g * xhat)) (+ ds, the gradient that reaches the sum from elsewhere):
    dx = t. WRITE_DR: the residual's gradient too, t rounded to its dtype (g_r); with its row scale (HAS_RS, the
    residual was (r * scale).to(r.dtype)) dr = g_r * scale, and (WRITE_DRS) the scale's gradient
    drs[row] = sum(g_r * r).
    dweight += dy * xhat, stored once per program as a float32 partial. BR rows per loop step, fetched one step
    ahead (as the gated norm's backward)."""
    start = tl.program_id(0).to(tl.int64) * CHUNK
    end = tl.minimum(start + CHUNK, N)
    cols = tl.arange(0, BG)
    cm = cols < G
    if HAS_W:
        b_w = tl.load(w + cols, mask=cm, other=0.0).to(tl.float32)
    acc = tl.zeros((BR, BG), dtype=tl.float32)
    n_dy, n_ds, n_u, n_r, n_rs, n_sc = _norm_bwd_rows(dy, ds, u, rs, r, rsc, start, end, cols, cm, sdy, sds, su, sr,
                                                      BR, HAS_DS, HAS_RS, WRITE_DRS)
    for r0 in range(start, end, BR):
        rows = r0 + tl.arange(0, BR)
        rm = rows < end
        m = rm[:, None] & cm[None, :]
        b_dy = n_dy.to(tl.float32)
        b_u = n_u.to(tl.float32)
        b_ds, b_r, rstd, b_sc = n_ds, n_r, n_rs, n_sc
        n_dy, n_ds, n_u, n_r, n_rs, n_sc = _norm_bwd_rows(dy, ds, u, rs, r, rsc, r0 + BR, end, cols, cm, sdy, sds, su,
                                                          sr, BR, HAS_DS, HAS_RS, WRITE_DRS)
        xhat = b_u * rstd[:, None]
        g = b_dy
        if HAS_W:
            acc += b_dy * xhat
            g = g * b_w[None, :]
        c = tl.sum(g * xhat, 1) / G
        t = rstd[:, None] * (g - xhat * c[:, None])
        if HAS_DS:
            t += b_ds.to(tl.float32)
        tl.store(dx + rows[:, None] * sdx + cols[None, :], t.to(dx.dtype.element_ty), mask=m)
        if WRITE_DR:
            g_r = t.to(dr.dtype.element_ty)
            if HAS_RS:
                g_f = g_r.to(tl.float32)
                if WRITE_DRS:
                    tl.store(drs + rows, tl.sum(g_f * b_r.to(tl.float32), 1), mask=rm)
                g_r = (g_f * b_sc[:, None]).to(dr.dtype.element_ty)
            tl.store(dr + rows[:, None] * sdr + cols[None, :], g_r, mask=m)
    if HAS_W:
        tl.store(part + tl.program_id(0).to(tl.int64) * sp + cols, tl.sum(acc, 0), mask=cm)


# (rows per loop step BR, warps). A config is kept for a group block of BG channels where each thread holds 2, 4 or 8
# elements of a row block (BR * BG / (32 * warps)), 4 first: for sm_90 (bf16, z_add, weight; cuobjdump) 4 elements
# compile to 58-74 registers (64 for BG 2048 with the rows fetched ahead, triton 3.6: still 2 programs of 16 warps per
# SM), 8 to 128-140 (16 bytes of stack at 16 warps, whose threads get at most 128), 16 to 255 registers or 0.3-1.1 KB
# of stack (spills).
_BWD_PAIRS = [(br, w) for br in (1, 2, 4, 8) for w in (4, 8, 16)]
_EPT_PREFERENCE = (4, 8, 2)


def _bwd_kernel(BG: int, plain: bool = False):
    """The gated (or, `plain`, the plain) norm's backward kernel autotuned (key: group, the flags, and the tensors'
    dtypes) over the configs that suit a group block of BG channels, for the settings read now (TRITON_INTERPRET,
    LM_RMSNORM_AUTOTUNE=0: the first config only, LM_TRITON_AUTOTUNE_CACHE)."""
    return _build_bwd(BG, plain, *tuning("rmsnorm"))


@functools.lru_cache(maxsize=None)
def _build_bwd(BG: int, plain: bool, interpret: bool, tune: bool, cache: bool):
    """_bwd_kernel's autotuner for these settings: the fewest elements per thread if no config suits BG (BG > 4096).
    Interpreter: one small config (BR = 128 / BG rows, at most 8) so that tiny test groups take several rows per
    step."""
    if interpret:
        pairs = [(max(1, min(8, 128 // BG)), 1)]
    else:
        ept = {(br, w): br * BG // (32 * w) for br, w in _BWD_PAIRS}
        pairs = [p for p in _BWD_PAIRS if ept[p] in _EPT_PREFERENCE]
        pairs = sorted(pairs, key=lambda p: _EPT_PREFERENCE.index(ept[p])) or [(1, 16)]
        if not tune:
            pairs = pairs[:1]
    configs = [triton.Config(dict(BR=br), num_warps=w) for br, w in pairs]
    if plain:
        return autotune(configs=configs, key=["G", "HAS_DS", "HAS_W", "WRITE_DR", "HAS_RS", "WRITE_DRS"], cache=cache)(
            _rmsnorm_bwd_kernel)
    return autotune(configs=configs, key=["G", "HAS_ADD", "HAS_W", "DY_SCALED"], cache=cache)(_gated_rmsnorm_bwd_kernel)


def _bwd_rows(n_rows: int, n_groups: int, device) -> int:
    """Rows per backward program: enough programs to fill the GPU ~8 times over
    (the loads of several programs per SM in flight), rounded up to a multiple of 8 (whole loop steps). The weight
    partials are (programs, channels) float32: 8.6 MB at 1056 programs x 2048 channels, written and read once, ~2.5%
    of the pass's ~670 MB at 16 x 2048 tokens in bf16. Interpreter: 3 rows, so that CPU tests cross program borders
    inside a loop step."""
    if interpreted():
        return 3
    want = max(1, cdiv(8 * num_sms(device), n_groups))
    return cdiv(max(1, cdiv(n_rows, want)), 8) * 8


def _rows(t, d):
    """t as (rows, d) with unit channel stride (a view where the layout allows)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, d)


def _check(x, weight, group, z=None, z_add=None):
    d = x.shape[-1]
    if d % group:
        raise ValueError(f"rms_norm: dim {d} is not a multiple of group_size {group}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"rms_norm: z has shape {tuple(z.shape)}, expected x's {tuple(x.shape)}")
    if z_add is not None and (z is None or z_add.shape != z.shape or z_add.dtype != z.dtype):
        raise ValueError(f"rms_norm: z_add must come with z and have its shape and dtype, got {tuple(z_add.shape)} "
                         f"{z_add.dtype}")
    if weight is not None and weight.shape != (d,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({d},)")


def _fwd_launch(x, weight, eps, group, z=None, z_add=None, residual=None, write_rstd=False, residual_scale=None,
                out_dtype=None):
    """(y, residual sum or None, rstd (rows, groups) float32 or None): y (rows, d) in out_dtype (default x's dtype),
    the sum x + residual (times residual_scale per row, rounded to the residual's dtype, if given) in the dtype
    PyTorch's add gives."""
    d = x.shape[-1]
    x2 = _rows(x, d)
    z2 = _rows(z, d) if z is not None else x2
    za2 = _rows(z_add, d) if z_add is not None else x2
    r2 = _rows(residual, d) if residual is not None else x2
    rsc = residual_scale.reshape(-1).float().contiguous() if residual_scale is not None else None
    y = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
    s = (torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
         if residual is not None else None)
    rstd = torch.empty(x2.shape[0], d // group, dtype=torch.float32, device=x.device) if write_rstd else None
    if x2.numel():
        BG = next_pow2(group)
        _rmsnorm_fwd_kernel[(x2.shape[0], d // group)](
            x2, z2, za2, weight.contiguous() if weight is not None else x2, y, r2, rsc if rsc is not None else y,
            s if s is not None else y, rstd if rstd is not None else y, x2.stride(0), z2.stride(0), za2.stride(0),
            y.stride(0), r2.stride(0), s.stride(0) if s is not None else 0, group, d // group, float(eps), BG=BG,
            HAS_Z=z is not None, HAS_ADD=z_add is not None, HAS_W=weight is not None, HAS_R=residual is not None,
            HAS_RS=rsc is not None, WRITE_RSTD=write_rstd, num_warps=min(16, max(1, BG // 512)))
    return y, s, rstd


@triton.jit
def _rstd_from_sumsq_kernel(ss, rs, N, K, inv_g, eps, BR: tl.constexpr, BK: tl.constexpr):
    """rs[row] = 1 / sqrt(sum(ss[row, :K]) / G + eps) for BR rows per program (ss (N, K) float32 contiguous)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BK)
    m = (rows < N)[:, None] & (cols < K)[None, :]
    v = tl.load(ss + rows[:, None] * K + cols[None, :], mask=m, other=0.0)
    tl.store(rs + rows, tl.rsqrt(tl.sum(v, 1) * inv_g + eps), mask=rows < N)


def rstd_from_sumsq(ss, group, eps):
    """(rows,) float32 reciprocal RMS of rows whose sum of squares over `group` channels is split into ss's columns
    ((rows, k) float32: per head, lm_kernels.ssd's STORE_SS), one launch."""
    n, k = ss.shape
    rs = torch.empty(n, dtype=torch.float32, device=ss.device)
    if n:
        bk = next_pow2(k)
        br = max(1, min(128, 4096 // bk))
        _rstd_from_sumsq_kernel[(cdiv(n, br),)](ss, rs, n, k, 1.0 / group, float(eps), BR=br, BK=bk, num_warps=4)
    return rs


@torch.compiler.disable  # torch.compile: one opaque call
def rms_norm_fwd(x, weight, eps, z=None, group_size=None, residual=None, residual_scale=None, out_dtype=None):
    """See lm_kernels.rmsnorm. x (..., d) float16/bfloat16/float32, z like x, residual of x's shape (any of those
    dtypes; the sum in the dtype PyTorch's add gives), residual_scale one value per row or None, weight (d,) or None;
    y in out_dtype (default x's dtype)."""
    group = group_size or x.shape[-1]
    _check(x, weight, group, z=z)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual has shape {tuple(residual.shape)}, expected x's {tuple(x.shape)}")
    y, s, _ = _fwd_launch(x, weight, eps, group, z=z, residual=residual, residual_scale=residual_scale,
                          out_dtype=out_dtype)
    if residual is not None:
        return y.view(x.shape), s.view(x.shape)
    return y.view(x.shape)


def gated_rms_norm_bwd_launch(dy, x, z, z_add, weight, rstd, group, dz_out=None, side=None, dy_scaled=False):
    """(dx in x's dtype, dz in z's dtype (also z_add's gradient), dweight in weight's dtype or None): one kernel pass
    over the rows and the sum of its per-program weight partials. dz_out: dz is written there (z's shape and dtype,
    rows of unit channel stride at any row stride: a column block of a larger gradient), else into a new tensor.
    side: a second stream (lm_kernels.backend.side_stream) that the partials' sum runs on, beside the caller's next
    kernels; the caller joins it before it reads dweight. dy_scaled (weight None): dy is rstd times the normalized
    output's gradient, as the folded norm's projection hands it back (lm_kernels.mamba2)."""
    if dy_scaled and weight is not None:
        raise ValueError("gated_rms_norm_bwd_launch: dy_scaled takes no weight (the projection holds it)")
    d = x.shape[-1]
    x2, z2, dy2 = _rows(x, d), _rows(z, d), _rows(dy, d)
    za2 = _rows(z_add, d) if z_add is not None else z2
    n, ng = x2.shape[0], d // group
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(x2.shape, dtype=z.dtype, device=x.device) if dz_out is None else dz_out.view(-1, d)
    chunk = _bwd_rows(n, ng, x.device)
    n_chunks = cdiv(n, chunk)
    part = torch.empty(n_chunks, d, dtype=torch.float32, device=x.device) if weight is not None else None
    if n:
        bg = next_pow2(group)
        flags = dict(BG=bg, HAS_ADD=z_add is not None, HAS_W=weight is not None, DY_SCALED=bool(dy_scaled))
        launch(_bwd_kernel(bg), (group, dy.dtype, x.dtype, z.dtype, *flags.values()), (n_chunks, ng), (
            dy2, x2, z2, za2, weight.contiguous() if weight is not None else x2, rstd.contiguous(), dx, dz,
            part if part is not None else dx, dy2.stride(0), x2.stride(0), z2.stride(0), za2.stride(0), dx.stride(0),
            dz.stride(0), d, n, group, ng, chunk), flags)
    dweight = None
    if weight is not None and not n:
        dweight = torch.zeros_like(weight)
    elif weight is not None:
        # allocated here (the current stream's memory), written on `side`
        dweight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        with on_side(side):
            if dweight.dtype == torch.float32:
                torch.sum(part, 0, out=dweight)
            else:
                dweight.copy_(part.sum(0))
        if side is not None:
            part.record_stream(side)  # its memory is not reused before the side stream's sum is done
    return dx.view(x.shape), dz.view(z.shape), dweight


def rms_norm_bwd_launch(dy, ds, u, weight, rstd, residual=None, residual_scale=None, dr_dtype=None):
    """The plain norm's backward, one kernel pass over the rows and the sum of its weight partials: (du in u's dtype,
    dr in dr_dtype or None, dscale (rows,) float32 or None, dweight in weight's dtype or None). u: what the forward
    normed (the residual sum where there was one), rstd its (rows,) float32 rstd; ds: the gradient that reaches the
    sum from elsewhere (added to du) or None. dr_dtype: also write the residual's gradient in that dtype (du rounded
    to it); with residual_scale (rows,) (the residual was (residual * scale).to(its dtype)) it is the gradient of the
    unscaled residual, and, where `residual` (unscaled) is given, dscale is the scale's."""
    d = u.shape[-1]
    u2, dy2 = _rows(u, d), _rows(dy, d)
    ds2 = _rows(ds, d) if ds is not None else dy2
    n = u2.shape[0]
    has_rs = residual_scale is not None
    drs = has_rs and residual is not None
    if has_rs and dr_dtype is None:
        raise ValueError("rms_norm_bwd_launch: a residual scale needs dr_dtype (the scaled residual's gradient)")
    r2 = _rows(residual, d) if drs else dy2
    rsc = residual_scale.reshape(-1).float().contiguous() if has_rs else None
    du = torch.empty(u2.shape, dtype=u.dtype, device=u.device)
    dr = torch.empty(u2.shape, dtype=dr_dtype, device=u.device) if dr_dtype is not None else None
    dscale = torch.empty(n, dtype=torch.float32, device=u.device) if drs else None
    chunk = _bwd_rows(n, 1, u.device)
    n_chunks = cdiv(n, chunk)
    part = torch.empty(n_chunks, d, dtype=torch.float32, device=u.device) if weight is not None else None
    if n:
        bg = next_pow2(d)
        flags = dict(BG=bg, HAS_DS=ds is not None, HAS_W=weight is not None, WRITE_DR=dr is not None, HAS_RS=has_rs,
                     WRITE_DRS=drs)
        launch(_bwd_kernel(bg, True), (d, dy.dtype, u.dtype, ds2.dtype, dr_dtype, r2.dtype, *flags.values()),
               (n_chunks, 1), (
                   dy2, ds2, u2, weight.contiguous() if weight is not None else u2, rstd.reshape(-1).contiguous(),
                   r2, rsc if has_rs else u2, du, dr if dr is not None else du, dscale if drs else u2,
                   part if part is not None else du, dy2.stride(0), ds2.stride(0), u2.stride(0), r2.stride(0),
                   du.stride(0), dr.stride(0) if dr is not None else 0, d, n, d, 1, chunk), flags)
    dweight = None
    if weight is not None:
        dweight = part.sum(0).to(weight.dtype) if n else torch.zeros_like(weight)
    return du.view(u.shape), dr.view(u.shape) if dr is not None else None, dscale, dweight


# --- the custom operators -------------------------------------------------------------------------------------------
# x, z and z_add are read through their row strides (channels contiguous; other layouts are copied inside): the
# exact-stride tag makes inductor pass them with the strides they had when traced.
@torch.library.custom_op("lm::gated_rms_norm_fwd", mutates_args=(), tags=CUSTOM_OP_TAGS)
def gated_rms_norm_fwd(x: torch.Tensor, z: torch.Tensor, z_add: Optional[torch.Tensor],
                       weight: Optional[torch.Tensor], group: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y (..., d) contiguous in x's dtype, rstd (..., d // group) float32) of u = x * silu(z (+ z_add)), the sum
    rounded to z's dtype; y = u * rstd (per group) * weight."""
    y, _, rstd = _fwd_launch(x, weight, eps, group, z=z, z_add=z_add, write_rstd=True)
    return y.view(x.shape), rstd.view(*x.shape[:-1], x.shape[-1] // group)


@gated_rms_norm_fwd.register_fake
def _(x, z, z_add, weight, group, eps):
    return x.new_empty(x.shape), x.new_empty(*x.shape[:-1], x.shape[-1] // group, dtype=torch.float32)


@torch.library.custom_op("lm::gated_rms_norm_bwd", mutates_args=(), tags=CUSTOM_OP_TAGS)
def gated_rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor, z_add: Optional[torch.Tensor],
                       weight: Optional[torch.Tensor], rstd: torch.Tensor, group: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dz, dweight (empty without weight)); dz is the gradient of z and of z_add alike. rstd: the forward's."""
    dx, dz, dweight = gated_rms_norm_bwd_launch(dy, x, z, z_add, weight, rstd, group)
    return dx, dz, dweight if dweight is not None else absent(x)


@gated_rms_norm_bwd.register_fake
def _(dy, x, z, z_add, weight, rstd, group):
    return x.new_empty(x.shape), z.new_empty(z.shape), weight.new_empty(weight.shape) if weight is not None \
        else absent(x)


def _gated_setup_context(ctx, inputs, output):
    x, z, z_add, weight, group, eps = inputs
    ctx.save_for_backward(x, z, z_add, weight, output[1])  # the inputs in their dtypes and the float32 rstd
    ctx.mark_non_differentiable(output[1])
    ctx.group = group


def _gated_backward(ctx, dy, _drstd):
    x, z, z_add, weight, rstd = ctx.saved_tensors
    dx, dz, dweight = torch.ops.lm.gated_rms_norm_bwd(dy, x, z, z_add, weight, rstd, ctx.group)
    need = ctx.needs_input_grad
    # d(z + z_add) reaches z and z_add alike: one tensor returned for both (as the conv op's x / x_add)
    return (dx if need[0] else None, dz if need[1] else None, dz if z_add is not None and need[2] else None,
            dweight if weight is not None and need[3] else None, None, None)


gated_rms_norm_fwd.register_autograd(_gated_backward, setup_context=_gated_setup_context)


def gated_rms_norm(x, z, weight, eps, group_size=None, z_add=None):
    """See lm_kernels.rmsnorm: y of lm::gated_rms_norm_fwd, with its autograd formula."""
    group = group_size or x.shape[-1]
    _check(x, weight, group, z=z, z_add=z_add)
    return torch.ops.lm.gated_rms_norm_fwd(x, z, z_add, weight, group, float(eps))[0]


# lm::rms_norm_fwd / lm::rms_norm_bwd: the plain norm with autograd (training), eager and under torch.compile, where
# the traced formula's backward cost several times its bytes (two inductor kernels with a float32 copy of the
# activation between them): y = norm(x (+ residual, optionally scaled per row)) * weight, written in out_dtype (the
# autocast dtype where the next layer reads it through one projection), the residual sum in the dtype PyTorch's add
# gives; the backward is one pass that also adds the gradient reaching the sum from elsewhere.
@torch.library.custom_op("lm::rms_norm_fwd", mutates_args=(), tags=CUSTOM_OP_TAGS)
def rms_norm_op_fwd(x: torch.Tensor, residual: Optional[torch.Tensor], residual_scale: Optional[torch.Tensor],
                    weight: Optional[torch.Tensor], eps: float, out_dtype: Optional[torch.dtype]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y in out_dtype (default x's), the sum s = x + residual (empty without residual), rstd (..., 1) float32)."""
    d = x.shape[-1]
    y, s, rstd = _fwd_launch(x, weight, eps, d, residual=residual, write_rstd=True, residual_scale=residual_scale,
                             out_dtype=out_dtype)
    return y.view(x.shape), s.view(x.shape) if s is not None else absent(x), rstd.view(*x.shape[:-1], 1)


@rms_norm_op_fwd.register_fake
def _(x, residual, residual_scale, weight, eps, out_dtype):
    s = (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype)) if residual is not None
         else absent(x))
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype), s, x.new_empty(*x.shape[:-1], 1, dtype=torch.float32)


@torch.library.custom_op("lm::rms_norm_bwd", mutates_args=(), tags=CUSTOM_OP_TAGS)
def rms_norm_op_bwd(dy: torch.Tensor, ds: Optional[torch.Tensor], u: torch.Tensor, weight: Optional[torch.Tensor],
                    rstd: torch.Tensor, residual: Optional[torch.Tensor], residual_scale: Optional[torch.Tensor],
                    dr_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(du, dr (empty unless dr_dtype), dscale (empty unless residual_scale and residual), dweight (empty without
    weight)): rms_norm_bwd_launch."""
    du, dr, dscale, dweight = rms_norm_bwd_launch(dy, ds, u, weight, rstd, residual, residual_scale, dr_dtype)
    return (du, dr if dr is not None else absent(u), dscale if dscale is not None else absent(u, torch.float32),
            dweight if dweight is not None else absent(u))


@rms_norm_op_bwd.register_fake
def _(dy, ds, u, weight, rstd, residual, residual_scale, dr_dtype):
    rows = u.numel() // u.shape[-1] if u.shape[-1] else 0
    drs = residual_scale is not None and residual is not None
    return (u.new_empty(u.shape), u.new_empty(u.shape, dtype=dr_dtype) if dr_dtype is not None else absent(u),
            u.new_empty(rows, dtype=torch.float32) if drs else absent(u, torch.float32),
            weight.new_empty(weight.shape) if weight is not None else absent(u))


def _norm_setup_context(ctx, inputs, output):
    x, residual, residual_scale, weight, _eps, _out_dtype = inputs
    _y, s, rstd = output
    u = s if residual is not None else x  # what was normed
    # the unscaled residual only for the scale's gradient (Mamba2's folded norm hands its scale in without one)
    scale_grad = residual_scale is not None and residual_scale.requires_grad
    ctx.save_for_backward(u, weight, rstd, residual if scale_grad else None, residual_scale)
    ctx.mark_non_differentiable(rstd)
    ctx.set_materialize_grads(False)
    ctx.x_dtype = x.dtype
    ctx.r_dtype = residual.dtype if residual is not None else None


def _norm_backward(ctx, dy, ds, _drstd):
    u, weight, rstd, residual, scale = ctx.saved_tensors
    need = ctx.needs_input_grad
    if dy is None:
        dy = torch.zeros(u.shape, dtype=u.dtype, device=u.device)
    if ctx.r_dtype is None:  # no residual: the sum's output is an empty placeholder
        ds = None
    # the residual's gradient of its own only where it differs from the sum's: another dtype, or a scaled residual
    own = (ctx.r_dtype is not None and (need[1] or residual is not None)
           and (ctx.r_dtype != u.dtype or scale is not None))
    du, dr, dscale, dweight = torch.ops.lm.rms_norm_bwd(dy, ds, u, weight, rstd, residual, scale,
                                                        ctx.r_dtype if own else None)
    dx = du if ctx.x_dtype == u.dtype else du.to(ctx.x_dtype)
    dr = dr if own else du if ctx.r_dtype is not None else None
    return (dx if need[0] else None, dr if need[1] else None,
            dscale.view(scale.shape).to(scale.dtype) if residual is not None and need[2] else None,
            dweight if weight is not None and need[3] else None, None, None)


rms_norm_op_fwd.register_autograd(_norm_backward, setup_context=_norm_setup_context)


def rms_norm_autograd(x, weight, eps, residual=None, residual_scale=None, out_dtype=None):
    """See lm_kernels.rmsnorm: the plain norm through lm::rms_norm_fwd and its autograd formula; (y, s) with a
    residual, else y."""
    _check(x, weight, x.shape[-1])
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual has shape {tuple(residual.shape)}, expected x's {tuple(x.shape)}")
    if residual_scale is not None and (residual is None or residual_scale.numel() != x.numel() // x.shape[-1]):
        raise ValueError("rms_norm: residual_scale takes one value per row and needs a residual")
    y, s, _ = torch.ops.lm.rms_norm_fwd(x, residual, residual_scale, weight, float(eps), out_dtype)
    return (y, s) if residual is not None else y
