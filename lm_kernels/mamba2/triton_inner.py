"""Mamba2's inner path as one pair of custom operators, lm::mamba2_inner_fwd / lm::mamba2_inner_bwd: from in_proj's
output z | xBC | dt (one (b, t, 2*d_inner + 2*G*N + H) tensor) to the gated norm's output, through the Triton conv
(lm_kernels.conv1d), SSD (lm_kernels.ssd) and gated RMSNorm (lm_kernels.rmsnorm) launches.

Why one operator: in_proj runs as one GEMM and its gradient is one GEMM only if the gradients of z, xBC and dt land
in one tensor. Three operators return three tensors, and autograd (or inductor) then writes them into one with a
pass over the whole projection's gradient per layer; here the gated norm's backward writes dz, the SSD's ddt and the
conv's dx straight into their column blocks of that tensor. The forward reads z, xBC and dt as column views of the
projection (the kernels take row strides).

The implicit models' injection enters as `add`, one tensor of the projection's shape (the same for all layers):
the conv adds its xBC columns on load, the gated norm its z columns, and its dt columns are added to dt here (a
(b, t, H) tensor). Its gradient is the projection's, dzxbcdt, whole: autograd sums the layers' contiguous gradients
(three per layer, strided, when the injection was three column blocks: docs/performance.md). conv_state /
initial_state: the caches' states in, with gradients; the new conv state and the final SSD state out (the final
state only with return_final_state), with gradients.
When no gradient is needed the forward runs outside autograd and nothing is saved (the fixed-point iterations).
`fold` (lm_kernels.mamba2's fold_norm): no norm pass; the scan gates its output and writes each row's sum of squares
per head, rstd_from_sumsq makes the rows' rstd, and the backward's gated-norm kernel takes dy as rstd times the
normalized output's gradient (what the caller's folded projection hands back).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..backend import absent, join, side_stream
from ..conv1d.triton_conv1d import (MAX_WIDTH, _add_new_state_grad, _channels_contiguous, check_conv_args, conv1d_bwd,
                                   conv1d_fwd)
from ..rmsnorm.triton_rmsnorm import _check as check_norm_args
from ..rmsnorm.triton_rmsnorm import _fwd_launch as norm_fwd_launch
from ..rmsnorm.triton_rmsnorm import gated_rms_norm_bwd_launch, rstd_from_sumsq
from ..ssd import launch as ln
from ..ssd.common import check_scan_args, split_xbc
from ..ssd.triton_ssd import _backward as ssd_backward
from ..ssd.triton_ssd import _forward as ssd_forward
from ..ssd.triton_ssd import _prep as ssd_prep
from ..ssd.triton_ssd import state_dtype


# The operators read zxbcdt (and the injection parts) through their row strides, so inductor may hand them any row
# stride: only the stride order is fixed. (Under the exact-stride tag of the other ops, a projection whose output
# inductor pads to aligned rows (4384 -> 4416 columns at Mamba2-350M's widths on the GPU) was copied back to the
# traced unpadded layout before the forward and again before the backward: 2 x 9 ms per step on an H100.)
_TAGS = (torch.Tag.needs_fixed_stride_order,)


def _split(zxbcdt, dims):
    """(z, xBC, dt) column views of the projection; dims = [d_inner, headdim, ngroups, dstate, norm_group]."""
    d_inner, _p, g, n, _ng = dims
    conv_dim = d_inner + 2 * g * n
    return (zxbcdt[..., :d_inner], zxbcdt[..., d_inner:d_inner + conv_dim], zxbcdt[..., d_inner + conv_dim:])


def _adds(add, dims):
    """(z_add, x_add, dt_add): column views of the injection, or Nones."""
    return _split(add, dims) if add is not None else (None, None, None)


def _ssd_inputs(xbc, dt, dt_add, dims, initial_state, cu_seqlens, chunk_size, table=None):
    """(x, dt (+ dt_add), B, C, initial state, plan) of the scan on the conv output x | B | C."""
    _d, p, g, n, _ng = dims
    x, dt, B, C, _ = ssd_prep(xbc, dt if dt_add is None else dt + dt_add, None, None, None, [p, g, n])
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    return x, dt, B, C, initial_state, ln.plan(x, B, cu_seqlens, chunk_size, table)


@torch.library.custom_op("lm::mamba2_inner_fwd", mutates_args=(), tags=_TAGS)
def mamba2_inner_fwd(zxbcdt: torch.Tensor, add: Optional[torch.Tensor], conv_weight: torch.Tensor, conv_bias: Optional[torch.Tensor],
                     conv_state: Optional[torch.Tensor], A: torch.Tensor, D: Optional[torch.Tensor],
                     dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
                     norm_weight: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], dims: list[int],
                     chunk_size: int, dt_lo: float, dt_hi: float, eps: float, return_final_state: bool, save: bool,
                     fold: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (b, t, d_inner) in the projection's dtype, new conv state (b, conv_dim, w-1), final SSD state (empty unless
    return_final_state), and what the backward reads: the conv output x | B | C, the SSD output, its dt / cumsum,
    chunk start states and chunk table (ssd_scan_fwd's), the norm's rstd). fold (one norm group, no norm weight):
    y is the gated SSD output u, not normalized (the scan gates it and sums its squares per row and head), and rstd
    (b, t, 1) its reciprocal RMS; the SSD output is then kept only with `save` (empty otherwise)."""
    d_inner, group = dims[0], dims[4]
    zxbcdt, add = (_channels_contiguous(v) for v in (zxbcdt, add))
    z, xbc_in, dt = _split(zxbcdt, dims)
    z_add, x_add, dt_add = _adds(add, dims)
    xbc, new_conv_state = conv1d_fwd(xbc_in, conv_weight, conv_bias, conv_state, cu_seqlens, True, x_add)
    x, dt, B, C, initial_state, pl = _ssd_inputs(xbc, dt, dt_add, dims, initial_state, cu_seqlens, chunk_size)
    b, t = zxbcdt.shape[:2]
    table = pl.table if pl.table is not None else absent(x, torch.int32)
    if fold:
        heads = (b, t, d_inner // dims[1], dims[1])
        y, final, dtcs, states, ys, ss = ssd_forward(
            x, dt, A, B, C, D, z.view(heads), dt_bias, initial_state, pl, True, (dt_lo, dt_hi), return_final_state,
            save, z_add=z_add.view(heads) if z_add is not None else None, want_ss=True)
        ys = ys.view(b, t, d_inner) if ys is not None else absent(x)
        rstd = rstd_from_sumsq(ss, d_inner, eps)
    else:
        ys, final, dtcs, states, _, _ = ssd_forward(x, dt, A, B, C, D, None, dt_bias, initial_state, pl, True,
                                                    (dt_lo, dt_hi), return_final_state, save)
        ys = ys.view(b, t, d_inner)
        y, _, rstd = norm_fwd_launch(ys, norm_weight, eps, group, z=z, z_add=z_add, write_rstd=True)
    return (y.view(b, t, d_inner), new_conv_state, final if final is not None else absent(x, torch.float32), xbc, ys,
            dtcs, states, table, rstd.view(b, t, d_inner // group))


@mamba2_inner_fwd.register_fake
def _(zxbcdt, add, conv_weight, conv_bias, conv_state, A, D, dt_bias, initial_state, norm_weight,
      cu_seqlens, dims, chunk_size, dt_lo, dt_hi, eps, return_final_state, save, fold):
    d_inner, p, g, n, group = dims
    b, t = zxbcdt.shape[:2]
    h, conv_dim, w = d_inner // p, d_inner + 2 * g * n, conv_weight.shape[-1]
    varlen = cu_seqlens is not None
    nseq = cu_seqlens.shape[0] - 1 if varlen else b
    ncb = ln.num_chunk_blocks(b, t, nseq, chunk_size, varlen)
    f32 = torch.float32
    return (zxbcdt.new_empty(b, t, d_inner), zxbcdt.new_empty(b, conv_dim, w - 1),
            zxbcdt.new_empty(nseq, h, p, n, dtype=f32) if return_final_state else absent(zxbcdt, f32),
            zxbcdt.new_empty(b, t, conv_dim),
            zxbcdt.new_empty(b, t, d_inner) if save or not fold else absent(zxbcdt),
            zxbcdt.new_empty(2, h, b * t, dtype=f32),
            zxbcdt.new_empty(ncb, h, p, n, dtype=state_dtype(zxbcdt.dtype)),
            zxbcdt.new_empty(ln.table_layout(nseq, ncb)[1], dtype=torch.int32) if varlen
            else absent(zxbcdt, torch.int32),
            zxbcdt.new_empty(b, t, d_inner // group, dtype=f32))


@torch.library.custom_op("lm::mamba2_inner_bwd", mutates_args=(), tags=_TAGS)
def mamba2_inner_bwd(dy: Optional[torch.Tensor], dnew_conv_state: Optional[torch.Tensor],
                     dfinal: Optional[torch.Tensor], zxbcdt: torch.Tensor, add: Optional[torch.Tensor],
                     conv_weight: torch.Tensor,
                     conv_bias: Optional[torch.Tensor], conv_state: Optional[torch.Tensor], A: torch.Tensor,
                     D: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
                     norm_weight: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], xbc: torch.Tensor,
                     ys: torch.Tensor, dtcs: torch.Tensor, states: torch.Tensor,
                     table: Optional[torch.Tensor], rstd: torch.Tensor, dims: list[int], chunk_size: int,
                     dt_lo: float, dt_hi: float, state_grad: bool, fold: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dzxbcdt (the projection's gradient, also the injection's), dconv_weight,
    dconv_bias, dconv_state (empty unless state_grad), dA, dD, ddt_bias, dinitial_state, dnorm_weight; empty where
    the input is None). dy / dnew_conv_state / dfinal None: no gradient reaches that output. fold: dy is the gated
    output's gradient as the folded norm's projection hands it back (rstd times the normalized output's)."""
    d_inner, p, group = dims[0], dims[1], dims[4]
    b, t = zxbcdt.shape[:2]
    zxbcdt, add = (_channels_contiguous(v) for v in (zxbcdt, add))
    z, xbc_in, dt = _split(zxbcdt, dims)
    z_add, x_add, dt_add = _adds(add, dims)
    dzxbcdt = torch.empty(zxbcdt.shape, dtype=zxbcdt.dtype, device=zxbcdt.device)
    dz, dxbc_in, ddt = _split(dzxbcdt, dims)
    if dy is None:
        dy = zxbcdt.new_zeros(b, t, d_inner)
    # Kernels independent of the current stream's next ones run on a second stream beside them: the gated norm's
    # weight sum, parts of the SSD backward, and its dt stage beside the conv backward (joined before returning)
    side = side_stream(zxbcdt.device)
    # gated norm: dz into its block, the SSD output's gradient into a tensor of its own
    dys, _, dnorm_weight = gated_rms_norm_bwd_launch(dy, ys, z, z_add, norm_weight, rstd.view(b * t, -1), group,
                                                     dz_out=dz, side=side, dy_scaled=fold)
    # SSD: the conv output's gradient as one x | B | C tensor, ddt into its block
    x, dt, B, C, initial_state, pl = _ssd_inputs(xbc, dt, dt_add, dims, initial_state, cu_seqlens, chunk_size,
                                                 table)
    dxbc = torch.empty(xbc.shape, dtype=xbc.dtype, device=xbc.device)
    _, _, dA, _, _, dD, _, ddt_bias, dinit = ssd_backward(
        dys.view(b, t, d_inner // p, p), dfinal, x, dt, A, B, C, D, None, dt_bias, initial_state, pl, True,
        (dt_lo, dt_hi), dtcs, states, None, dxbc=dxbc, ddt_out=ddt, side=side, defer=True)
    # conv: dx into the xBC block
    _, dweight, dbias, dstate = conv1d_bwd(dxbc, xbc_in, conv_weight, conv_bias, conv_state, cu_seqlens, True,
                                           state_grad, x_add, dx_out=dxbc_in)
    if dnew_conv_state is not None and conv_weight.shape[-1] > 1:
        _add_new_state_grad(dnew_conv_state, dxbc_in, dstate, t, conv_weight.shape[-1])
    join(side)
    return tuple(v if v is not None else absent(zxbcdt)
                 for v in (dzxbcdt, dweight, dbias, dstate, dA, dD, ddt_bias, dinit, dnorm_weight))


@mamba2_inner_bwd.register_fake
def _(dy, dnew_conv_state, dfinal, zxbcdt, add, conv_weight, conv_bias, conv_state, A, D, dt_bias,
      initial_state, norm_weight, cu_seqlens, xbc, ys, dtcs, states, table, rstd, dims, chunk_size, dt_lo, dt_hi,
      state_grad, fold):
    def like(v):
        return v.new_empty(v.shape) if v is not None else absent(zxbcdt)

    return (zxbcdt.new_empty(zxbcdt.shape), like(conv_weight), like(conv_bias),
            like(conv_state) if state_grad else absent(zxbcdt), like(A), like(D), like(dt_bias), like(initial_state),
            like(norm_weight))


_N_ARGS = 19  # mamba2_inner_fwd's inputs


def _setup_context(ctx, inputs, output):
    (zxbcdt, add, conv_weight, conv_bias, conv_state, A, D, dt_bias, initial_state, norm_weight,
     cu_seqlens, dims, chunk_size, dt_lo, dt_hi, _eps, return_final_state, _save, fold) = inputs
    _y, _ncs, _final, xbc, ys, dtcs, states, table, rstd = output
    ctx.mark_non_differentiable(xbc, ys, dtcs, states, table, rstd)
    ctx.set_materialize_grads(False)  # an unused output (the states) gets None, not a zero-filled gradient
    ctx.save_for_backward(zxbcdt, add, conv_weight, conv_bias, conv_state, A, D, dt_bias,
                          initial_state, norm_weight, cu_seqlens, xbc, ys, dtcs, states,
                          table if cu_seqlens is not None else None, rstd)
    ctx.args = (list(dims), chunk_size, dt_lo, dt_hi)
    ctx.fold = fold
    ctx.return_final_state = return_final_state


def _backward(ctx, dy, dncs, dfinal, *_aux):
    saved = ctx.saved_tensors
    zxbcdt, add, conv_weight, conv_bias, conv_state = saved[:5]
    A, D, dt_bias, initial_state, norm_weight = saved[5:10]
    need = ctx.needs_input_grad
    state_grad = conv_state is not None and need[4]
    g = torch.ops.lm.mamba2_inner_bwd(dy, dncs, dfinal if ctx.return_final_state else None, *saved,
                                      *ctx.args, state_grad, ctx.fold)
    dzxbcdt, dweight, dbias, dstate, dA, dD, ddt_bias, dinit, dnorm = g
    grads = [dzxbcdt, dzxbcdt if add is not None else None, dweight, dbias if conv_bias is not None else None,
             dstate if state_grad else None, dA, dD if D is not None else None,
             ddt_bias if dt_bias is not None else None, dinit if initial_state is not None else None,
             dnorm if norm_weight is not None else None]
    grads = [v if ok else None for v, ok in zip(grads, need)]
    return (*grads, *([None] * (_N_ARGS - len(grads))))


mamba2_inner_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check(zxbcdt, dims, conv_weight, conv_bias, A, D, dt_bias, dt_limit, norm_weight, add, conv_state,
           initial_state, cu_seqlens, chunk_size, max_seqlen=None):
    """The shapes of a call, by the checks of the three ops on views of the projection; a ValueError naming what is
    wrong. The offsets in cu_seqlens are read only outside torch.compile and without `max_seqlen` (given by a caller
    that has checked them: the model, once per forward)."""
    d_inner, p, g, n, group = dims
    if d_inner % p or (d_inner // p) % g:
        raise ValueError(f"mamba2_inner: headdim {p} must divide d_inner {d_inner} and ngroups {g} the heads")
    h, conv_dim = d_inner // p, d_inner + 2 * g * n
    if zxbcdt.dim() != 3 or zxbcdt.shape[-1] != d_inner + conv_dim + h:
        raise ValueError(f"mamba2_inner: zxbcdt must be (batch, seqlen, {d_inner + conv_dim + h}) = z | x B C | dt for "
                         f"d_inner {d_inner}, {g} groups of dstate {n}, {h} heads; got {tuple(zxbcdt.shape)}")
    if zxbcdt.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"mamba2_inner: zxbcdt must be float32/bfloat16/float16, got {zxbcdt.dtype}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"mamba2_inner: chunk_size must be a power of two >= 16, got {chunk_size}")
    if add is not None and (add.shape != zxbcdt.shape or add.dtype != zxbcdt.dtype):
        raise ValueError(f"mamba2_inner: add (the injection) must have zxbcdt's shape {tuple(zxbcdt.shape)} and dtype "
                         f"{zxbcdt.dtype}, got {tuple(add.shape)} {add.dtype}")
    z, xbc, dt = _split(zxbcdt, dims)
    z_add, x_add, _ = _adds(add, dims)
    check_conv_args(xbc, conv_weight, conv_bias, conv_state, cu_seqlens, "silu", MAX_WIDTH, x_add=x_add)
    x, B, C = split_xbc(xbc, h, p, g, n)
    b, t, *_, nseq = check_scan_args(x, dt, A, B, C, D, None, dt_bias, initial_state, cu_seqlens, chunk_size, dt_limit,
                                     values=not torch.compiler.is_compiling(), max_seqlen=max_seqlen)
    ln.check_chunk_grid(b, t, nseq, chunk_size, cu_seqlens is not None, "mamba2_inner")
    check_norm_args(z, norm_weight, group, z=z, z_add=z_add)


def mamba2_inner_triton(zxbcdt, conv_weight, conv_bias, A, *, d_inner, headdim, ngroups, dstate, chunk_size,
                        D=None, dt_bias=None, dt_limit=(0.0, float("inf")), norm_weight=None, norm_group=None,
                        eps=1e-5, add=None, conv_state=None, initial_state=None, cu_seqlens=None,
                        return_final_state=False, max_seqlen=None, fold_norm=False):
    """See lm_kernels.mamba2.mamba2_inner. Returns (y, new conv state, final SSD state or None), and with fold_norm
    (y, new conv state, final SSD state or None, rstd)."""
    dims = [int(d_inner), int(headdim), int(ngroups), int(dstate), int(norm_group or d_inner)]
    if fold_norm and (norm_weight is not None or dims[4] != dims[0]):
        raise ValueError("mamba2_inner: fold_norm takes one norm group (norm_group None or d_inner) and no "
                         "norm_weight (the caller's projection holds it)")
    _check(zxbcdt, dims, conv_weight, conv_bias, A, D, dt_bias, dt_limit, norm_weight, add, conv_state,
           initial_state, cu_seqlens, chunk_size, max_seqlen)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(zxbcdt.device)
    tensors = (zxbcdt, add, conv_weight, conv_bias, conv_state, A, D, dt_bias, initial_state,
               norm_weight)
    needs_grad = torch.is_grad_enabled() and any(v is not None and v.requires_grad for v in tensors)
    out = torch.ops.lm.mamba2_inner_fwd(zxbcdt, add, conv_weight, conv_bias, conv_state, A, D,
                                        dt_bias, initial_state, norm_weight, cu_seqlens, dims, int(chunk_size),
                                        float(dt_limit[0]), float(dt_limit[1]), float(eps), bool(return_final_state),
                                        needs_grad, bool(fold_norm))
    res = (out[0], out[1], (out[2] if return_final_state else None))
    return (*res, out[8]) if fold_norm else res
