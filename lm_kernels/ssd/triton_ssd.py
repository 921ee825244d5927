"""Triton SSD scan: the launches (forward 3 kernels, backward 5-6) and the custom operators lm::ssd_scan_fwd /
lm::ssd_scan_bwd with their autograd formula (one node each in a torch.compile graph).

Forward:  dtcb_fwd (dt bias / softplus / clamp with the in-chunk cumsum of dt*A, and C.B per chunk and group)
          -> state_fwd (every chunk's start state; the final state)
          -> chunk_scan_fwd4 (y, whole chunks of two or four row blocks: 16-bit inputs at chunk 2 or 4 * TILE_ROWS)
             or chunk_scan_fwd2 (one row block per program: float32 inputs, other chunk sizes).
Backward: [gate_bwd] -> dstate_bwd (reverse pass of dLoss/dstate) -> dcb_bwd (per group Q = sum_heads dy.x^T *
          decay * dt) -> dx_bwd (dx, and the intra-chunk d(dt*A) shares; its C.B tiles formed again from B and C)
          -> dbdc_bwd (dB, dC, the state part of d(dt*A)) -> dt_bwd (ddt, dA, ddt_bias).
The backward puts dcb_bwd beside dstate_bwd and dbdc_bwd beside dx_bwd on a second stream (each pair independent;
the reverse state pass is bound by its chunk chain and leaves the GPU room): -1.6 ms per Mamba2-350M step on an H100
(docs/performance.md).
When no gradient is needed (torch.is_grad_enabled() False or no input requires grad) the forward runs outside
autograd: nothing is saved and the pre-gate output is not stored. With grad, the backward reads the inputs and the
forward's dt / cumsum, chunk start states, pre-gate output (with z) and the chunk table (packed documents).
The chunk size must be a power of two >= 16.
Accumulation is float32; chunk start states are kept in bfloat16 for bfloat16 inputs (they enter the
tensor-core products in that dtype anyway), else in float32; so is the forward's C.B (per chunk and group, read by
every head of chunk_scan_fwd*; the backward's dx_bwd forms its tiles in float32 from B and C instead of reading it).
float32 inputs use tf32 products unless torch.get_float32_matmul_precision() == "highest".
"""
from __future__ import annotations

from typing import Optional

import torch

from ..backend import CUSTOM_OP_TAGS, absent, cdiv, join, on_side, side_stream
from . import launch as ln
from .backward import gate_bwd_kernel
from .backward_dx import dt_bwd_kernel, sum_rows_kernel
from .common import check_scan_args, split_xbc
from .launch import dot_dt, dot_prec, limits, tune_key


def state_dtype(dtype):
    """Chunk start states: bfloat16 for bfloat16 inputs, else float32 (see the module docstring)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def cb_dtype(dtype):
    """C.B per chunk and group: the 16-bit input dtype, else float32."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32


def contiguous_params(A, D, dt_bias):
    """A (H,), D (H,) or (H, P) and dt_bias (H,) as the kernels index them, contiguous (a copy only of a strided view:
    a parameter is contiguous already). None stays None."""
    return tuple(v.contiguous() if v is not None else None for v in (A, D, dt_bias))


def _forward(x, dt, A, B, C, D, z, dt_bias, initial_state, pl, dt_softplus, dt_limit, want_final, save, z_add=None,
             want_ss=False):
    """(y, final state or None, dt / cumsum, chunk start states, pre-gate output or None, sums of squares or None).
    z_add (z's shape): added to z (the sum rounded to z's dtype). want_ss (with z): also each row's sum of
    squares of the gated output per head, (b * t, H) float32, from the pre-gate output rounded to y's dtype (the
    folded gated norm, lm_kernels.mamba2). The kernels read x, B, C, z, z_add and dt through their batch / time / head
    strides (last dim contiguous: _prep) and write y through its own."""
    A, D, dt_bias = contiguous_params(A, D, dt_bias)
    dev = x.device
    H, P, N, L = pl.H, pl.P, pl.N, pl.L
    has_limit, lo, hi = limits(dt_limit)
    dtcs = torch.empty(2, H, pl.BT, dtype=torch.float32, device=dev)  # processed dt | in-chunk cumsum of dt*A
    dtp, cs = dtcs.unbind(0)
    final = torch.empty(pl.nseq, H, P, N, dtype=torch.float32, device=dev) if want_final else None
    prec, ddt = dot_prec(x.dtype), dot_dt(x.dtype)
    CB = torch.empty(pl.NCB, pl.G, L, L, dtype=cb_dtype(x.dtype), device=dev)
    tk = tune_key(pl, x, dt, A, B, D, z, dt_bias, initial_state)
    tn = ln.tuners()
    ln.launch(tn.dtcb_fwd, ("dtcb", tk), (pl.NCB, pl.G * (L // pl.BM) * (L // pl.BK) + cdiv(H, pl.BH)), (
        dt, dt_bias if dt_bias is not None else dt, A, dtp, cs, B, C, CB, pl.chunk_t0, pl.chunk_len,
        pl.T, H, N, pl.NC, pl.BT, pl.G, dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), B.stride(2), lo, hi),
        dict(L=L, BH=pl.BH, BM=pl.BM, BK=pl.BK, BNF=pl.BNF, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
             HAS_LIMIT=has_limit, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt))
    states = torch.empty(pl.NCB, H, P, N, dtype=state_dtype(x.dtype), device=dev)  # (p, n) per (chunk, head)
    ln.launch(tn.state_fwd, ("state", tk), lambda META: (cdiv(P, META["BP"]) * cdiv(N, pl.BN), H, pl.nseq), (
        x, B, dtp, cs, initial_state if initial_state is not None else dtp, states,
        final if final is not None else dtp, pl.cu, pl.chunk_first,
        pl.T, H, P, N, pl.NC, pl.BT, pl.R,
        x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2)),
        dict(L=L, BN=pl.BN, BK=pl.BKS, HAS_INIT=initial_state is not None, HAS_FINAL=want_final,
             IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt))
    y = torch.empty(pl.b, pl.T, H, P, dtype=x.dtype, device=dev)
    store_pre = save and z is not None  # the pre-gate output, for dz
    ypre = torch.empty_like(y) if store_pre else None
    ss = torch.empty(pl.b * pl.T, H, dtype=torch.float32, device=dev) if want_ss else None
    zz = z if z is not None else x
    za = z_add if z_add is not None else zz
    if za.stride()[2:] != zz.stride()[2:]:  # the kernel reads z_add through z's head and channel strides
        raise ValueError("ssd (triton backend): z_add must have z's head and channel strides")
    scan_args = (x, CB, C, dtp, cs, states, D if D is not None else dtp, zz, za,
                 ss if ss is not None else dtp, y, ypre if ypre is not None else y,
                 pl.chunk_t0, pl.chunk_len, pl.T, H, P, N, pl.NC, pl.BT, pl.R, pl.G,
                 x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2),
                 zz.stride(0), zz.stride(1), zz.stride(2), za.stride(0), za.stride(1), y.stride(0), y.stride(1),
                 y.stride(2))
    flags = dict(L=L, BNF=pl.BNF, HAS_D=D is not None, D_HP=D is not None and D.dim() == 2, HAS_Z=z is not None,
                 STORE_PRE=store_pre, HAS_ZADD=z_add is not None, STORE_SS=want_ss, IS_VARLEN=pl.varlen,
                 DOT_PREC=prec, DOT_DT=ddt)
    # (float32 operands compile for sm_90 with spills and twice the shared memory: chunk_scan_fwd2 there)
    four = x.dtype != torch.float32 and L in (2 * pl.BM, 4 * pl.BM)
    tuner = ln.scan_fwd_ss(tn, four, P) if want_ss else tn.scan_fwd4 if four else tn.scan_fwd2
    if four:
        grid = lambda META: (cdiv(P, META["BP"]), H, pl.NCB)  # noqa: E731
        flags = dict(BM=pl.BM, **flags)
    else:
        grid = lambda META: (cdiv(L, META["BM"]) * cdiv(P, META["BP"]), H, pl.NCB)  # noqa: E731
    ln.launch(tuner, ("scan4" if four else "scan2", tk, want_ss), grid, scan_args, flags)
    return y, final, dtcs, states, ypre, ss


def _backward(dout, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_state, pl, dt_softplus, dt_limit, dtcs, states,
              ypre, dxbc=None, ddt_out=None, side=None, defer=False):
    """The gradients; dxbc: a (b, t, H*P + 2*G*N) tensor that dx, dB and dC are written into (their views are
    returned), else they are separate tensors; ddt_out: dt's gradient is written there (dt's shape and dtype, heads
    contiguous, any batch / time strides), else into a new tensor.
    side: a second stream (lm_kernels.backend.side_stream) or None. dcb_bwd runs there beside dstate_bwd, and
    dbdc_bwd beside dx_bwd (each pair is independent; dstate_bwd is bound by its chunk chain, not by the GPU's
    throughput). defer: dt_bwd and the sums of the partials go to `side` too, and the caller joins it before it
    reads ddt, dA, dt_bias's or D's gradient (Mamba2's conv backward runs beside them); else they run on the current
    stream. Every (batch, time, head) tensor is read and written through its strides (dx, dB and dC too: the
    column views of dxbc have a time stride of their own at t = 1), with a contiguous last dim."""
    A, D, dt_bias = contiguous_params(A, D, dt_bias)
    dev = x.device
    H, P, N, L, G, R = pl.H, pl.P, pl.N, pl.L, pl.G, pl.R
    dtp, cs = dtcs.unbind(0)
    prec, ddt_ = dot_prec(x.dtype), dot_dt(x.dtype)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dz = None
    if z is not None:
        zc = z.contiguous()
        doc = dout.contiguous()
        dy = torch.empty_like(ypre)
        dz = torch.empty_like(zc)
        numel = dy.numel()
        gate_bwd_kernel[(cdiv(numel, 1024),)](doc, zc, ypre, dy, dz, numel, BLOCK=1024, num_warps=4)
    else:
        dy = dout
    # reverse state pass
    dstates = torch.empty_like(states)
    dinit = torch.empty(pl.nseq, H, P, N, dtype=torch.float32, device=dev) if initial_state is not None else None
    if dfinal is not None:
        dfinal = dfinal.float().contiguous()
    tk = tune_key(pl, x, dt, A, B, D, z, dt_bias, initial_state) + (dy.dtype,)
    tn = ln.tuners()
    # per-group dy.x^T (decayed), for dB and dC: on the side stream, beside the reverse state pass
    Q = torch.empty(pl.NCB, G, L, L, dtype=torch.float32, device=dev)
    with on_side(side):
        ln.launch(tn.dcb_bwd, ("dcb", tk), ((L // pl.BM) * (L // pl.BK), G, pl.NCB), (
            dy, x, dtp, cs, Q, pl.chunk_t0, pl.chunk_len,
            pl.T, P, pl.NC, pl.BT, R, G,
            dy.stride(0), dy.stride(1), dy.stride(2), x.stride(0), x.stride(1), x.stride(2)),
            dict(L=L, BM=pl.BM, BK=pl.BK, BPF=pl.BPF, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt_))
    ln.launch(tn.dstate_bwd, ("dstate", tk), (pl.npn, H, pl.nseq), (
        dy, C, cs, dfinal if dfinal is not None else cs, dstates, dinit if dinit is not None else cs,
        pl.cu, pl.chunk_first,
        pl.T, H, P, N, pl.NC, pl.BT, R,
        dy.stride(0), dy.stride(1), dy.stride(2), B.stride(0), B.stride(1), B.stride(2)),
        dict(L=L, BP=pl.BP, BN=pl.BN, BK=pl.BKS, HAS_DFINAL=dfinal is not None, HAS_INIT=initial_state is not None,
             IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt_))
    # dx, direct ddt, the state terms q and the row / column sums of the intra-chunk d(dt*A) terms: every slot
    # dt_bwd reads is written (it skips the rows a slot lacks), so no zeroing
    nm = cdiv(L, pl.BM)
    dda = torch.empty(nm + 1, H, pl.BT, dtype=torch.float32, device=dev)
    if dxbc is not None:
        dx, dB, dC = split_xbc(dxbc, H, P, G, N)
    else:
        dx = torch.empty(pl.b, pl.T, H, P, dtype=x.dtype, device=dev)
        dB = torch.empty(pl.b, pl.T, G, N, dtype=B.dtype, device=dev)
        dC = torch.empty(pl.b, pl.T, G, N, dtype=C.dtype, device=dev)
    assert dB.stride() == dC.stride()  # dbdc_bwd writes both through dB's strides
    ddt_dir = torch.empty(H, pl.BT, dtype=torch.float32, device=dev)
    # e^a <G_{c+1}, S_c> per (chunk, head): dx_bwd's program with a chunk's last rows writes it, so no zeroing
    passing = torch.empty(pl.NCB, H, dtype=torch.float32, device=dev)
    qrow = torch.empty_like(ddt_dir)
    # the partial sums of dA, dt_bias's and D's gradients (per chunk; D's per chunk and row block) in one buffer,
    # zeroed for the programs that return early (rows past a chunk's end, packed chunks cut short), summed by one
    # launch of sum_rows_kernel
    nbias = H if dt_bias is not None else 0
    nD = (D.numel() if D is not None else 0)
    part = torch.zeros(pl.NCB * nm, H + nbias + nD, dtype=torch.float32, device=dev)
    dD_part = part[:, H + nbias:]
    # dB, dC and each row's dcs = dy . y_off (a partial sum per n block): on the side stream, beside dx_bwd
    n_dcs = cdiv(N, pl.BN_DBDC)
    dcs = torch.empty(n_dcs, H, pl.BT, dtype=torch.float32, device=dev)
    with on_side(side):
        ln.launch(tn.dbdc_bwd, ("dbdc", tk), (nm * n_dcs, G, pl.NCB), (
            dy, x, B, C, dtp, cs, states, dstates, Q, dB, dC, dcs, pl.chunk_t0, pl.chunk_len,
            pl.T, H, P, N, pl.NC, pl.BT, R, G,
            dy.stride(0), dy.stride(1), dy.stride(2), x.stride(0), x.stride(1), x.stride(2),
            B.stride(0), B.stride(1), B.stride(2), dB.stride(0), dB.stride(1), dB.stride(2)),
            dict(L=L, BM=pl.BM, BK=pl.BK, BPF=pl.BPF, BN=pl.BN_DBDC, IS_VARLEN=pl.varlen, DOT_PREC=prec,
                 DOT_DT=ddt_))
    ln.launch(tn.dx_bwd, ("dx", tk), (nm, H, pl.NCB), (
        dy, x, B, C, dtp, cs, states, dstates, D if D is not None else cs,
        dx, ddt_dir, qrow, dD_part, dda, passing, pl.chunk_t0, pl.chunk_len,
        pl.T, H, P, N, pl.NC, pl.BT, R,
        dy.stride(0), dy.stride(1), dy.stride(2), x.stride(0), x.stride(1), x.stride(2),
        B.stride(0), B.stride(1), B.stride(2), dx.stride(0), dx.stride(1), dx.stride(2), part.stride(0)),
        dict(L=L, BM=pl.BM, BK=pl.BK, BPF=pl.BPF, BNF=pl.BNF, HAS_D=D is not None,
             D_HP=D is not None and D.dim() == 2, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt_))
    join(side)
    # dt, dA, dt_bias
    ddt = torch.empty(dt.shape, dtype=dt.dtype, device=dev) if ddt_out is None else ddt_out
    dA = torch.empty(H, dtype=A.dtype, device=dev)
    ddt_bias = torch.empty(H, dtype=dt_bias.dtype, device=dev) if dt_bias is not None else None
    dD = torch.empty(D.shape, dtype=D.dtype, device=dev) if D is not None else None  # (H, P) or (H,)
    late = side if defer else None
    with on_side(late):
        _dt_stage(dt, dt_bias, A, dtp, ddt_dir, dcs, dda, qrow, passing, ddt, part, dA, ddt_bias, dD, pl, dt_softplus,
                  dt_limit)
    if late is not None:  # the buffers only the side stream reads now: not reused before it is done with them
        for v in (ddt_dir, dcs, dda, qrow, passing, part):
            v.record_stream(late)
    dinit = dinit.to(initial_state.dtype) if dinit is not None else None
    return dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit


def _dt_stage(dt, dt_bias, A, dtp, ddt_dir, dcs, dda, qrow, passing, ddt, part, dA, ddt_bias, dD, pl, dt_softplus,
              dt_limit):
    """dt_bwd (ddt, and the per-chunk partials of dA and dt_bias's gradients into part) and sum_rows_kernel (part's
    column sums into dA, ddt_bias, dD)."""
    H, L = pl.H, pl.L
    nbias, nD, n_dcs = (H if dt_bias is not None else 0), (dD.numel() if dD is not None else 0), dcs.shape[0]
    has_limit, lo, hi = limits(dt_limit)
    dA_part, dbias_part = part[:, :H], part[:, H:H + nbias]
    dt_bwd_kernel[(pl.NCB, cdiv(H, pl.BH))](
        dt, dt_bias if dt_bias is not None else dt, A, dtp, ddt_dir, dcs, dda, qrow, passing,
        ddt, dA_part, dbias_part, pl.chunk_t0, pl.chunk_len,
        pl.T, H, pl.NC, pl.BT, dt.stride(0), dt.stride(1), ddt.stride(0), ddt.stride(1), part.stride(0),
        lo, hi,
        L=L, BH=pl.BH, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        HAS_LIMIT=has_limit, IS_VARLEN=pl.varlen, BMB=pl.BM, NDCS=n_dcs, num_warps=4)
    sum_rows_kernel[(cdiv(part.shape[1], 32),)](part, dA, dA if ddt_bias is None else ddt_bias,
                                                dA if dD is None else dD, part.shape[0], H, nbias, nD,
                                                part.stride(0), BR=128, BC=32, num_warps=4)


# --- the custom operators -------------------------------------------------------------------------------------------
# lm::ssd_scan_fwd / lm::ssd_scan_bwd are the one way the Triton scan is called, eager and under torch.compile:
# dynamo records them as single nodes of the graph (their fakes give the output shapes), so a compiled Mamba2 block
# stays one graph around the scan. Absent optional outputs are 0-element tensors (a custom op returns no None).
# Inputs are read through their strides (x, B, C, z: last dim contiguous, B and C with equal strides; _prep): the
# exact-stride tag makes inductor pass them with the strides they had when traced, and _prep inside the ops is then
# a no-op (it only copies a layout the kernels cannot read, as ssd_scan_triton would have before the call).
# xbc_dims = [P, G, N]: `x` is Mamba2's conv output x | B | C, (b, t, H*P + 2*G*N), and B, C are None; its gradient
# is one tensor of that shape that the backward kernels write into (three separate gradients would be
# concatenated by autograd, a pass over the conv's whole gradient per layer). [] : x, B, C given separately.
@torch.library.custom_op("lm::ssd_scan_fwd", mutates_args=(), tags=CUSTOM_OP_TAGS)
def ssd_scan_fwd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: Optional[torch.Tensor],
                 C: Optional[torch.Tensor], D: Optional[torch.Tensor], z: Optional[torch.Tensor],
                 dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
                 cu_seqlens: Optional[torch.Tensor], chunk_size: int, dt_softplus: bool, dt_lo: float, dt_hi: float,
                 return_final_state: bool, save: bool, xbc_dims: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, final state (empty unless return_final_state), and what the backward reads: dt and cumsum (2, H, b*t)
    float32, the chunk start states, the pre-gate output (empty unless `save` and z), the chunk table of
    packed documents (int32, empty without cu_seqlens)). Arguments as ssd_scan_triton's, checked there."""
    x, dt, B, C, z = _prep(x, dt, B, C, z, xbc_dims)
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    pl = ln.plan(x, B, cu_seqlens, chunk_size)
    y, final, dtcs, states, ypre, _ = _forward(x, dt, A, B, C, D, z, dt_bias, initial_state, pl, dt_softplus,
                                            (dt_lo, dt_hi), return_final_state, save)
    return (y, final if final is not None else absent(x, torch.float32), dtcs, states,
            ypre if ypre is not None else absent(x), pl.table if pl.table is not None else absent(x, torch.int32))


def _fake_dims(x, dt, B, xbc_dims):
    """(b, t, h, p, g, n) of a call from its shapes."""
    if xbc_dims:
        p, g, n = xbc_dims
        return x.shape[0], x.shape[1], dt.shape[2], p, g, n
    return (*x.shape, B.shape[2], B.shape[3])


@ssd_scan_fwd.register_fake
def _(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_softplus, dt_lo, dt_hi,
      return_final_state, save, xbc_dims):
    b, t, h, p, g, n = _fake_dims(x, dt, B, xbc_dims)
    varlen = cu_seqlens is not None
    nseq = cu_seqlens.shape[0] - 1 if varlen else b
    ncb = ln.num_chunk_blocks(b, t, nseq, chunk_size, varlen)
    f32 = torch.float32
    return (x.new_empty(b, t, h, p),
            x.new_empty(nseq, h, p, n, dtype=f32) if return_final_state else absent(x, f32),
            x.new_empty(2, h, b * t, dtype=f32),
            x.new_empty(ncb, h, p, n, dtype=state_dtype(x.dtype)),
            x.new_empty(b, t, h, p) if save and z is not None else absent(x),
            x.new_empty(ln.table_layout(nseq, ncb)[1], dtype=torch.int32) if varlen else absent(x, torch.int32))


@torch.library.custom_op("lm::ssd_scan_bwd", mutates_args=(), tags=CUSTOM_OP_TAGS)
def ssd_scan_bwd(dy: Optional[torch.Tensor], dfinal: Optional[torch.Tensor], x: torch.Tensor, dt: torch.Tensor,
                 A: torch.Tensor, B: Optional[torch.Tensor], C: Optional[torch.Tensor], D: Optional[torch.Tensor],
                 z: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
                 cu_seqlens: Optional[torch.Tensor], dtcs: torch.Tensor, states: torch.Tensor,
                 ypre: Optional[torch.Tensor], table: Optional[torch.Tensor], chunk_size: int, dt_softplus: bool,
                 dt_lo: float, dt_hi: float, xbc_dims: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_state), absent (empty) where that input is None; with
    xbc_dims dx is the gradient of the whole x | B | C input. dy / dfinal None: no gradient reaches y / the final
    state. dtcs .. table: ssd_scan_fwd's outputs."""
    xbc = x if xbc_dims else None
    x, dt, B, C, z = _prep(x, dt, B, C, z, xbc_dims)
    if z is not None and (ypre is None or ypre.shape != x.shape):
        raise ValueError("ssd_scan_bwd: with z the forward must have run with save=True (it stores the pre-gate y)")
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    pl = ln.plan(x, B, cu_seqlens, chunk_size, table)
    if dy is None:
        dy = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    dxbc = torch.empty(xbc.shape, dtype=xbc.dtype, device=xbc.device) if xbc is not None else None
    grads = _backward(dy, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_state, pl, dt_softplus, (dt_lo, dt_hi),
                      dtcs, states, ypre, dxbc, side=side_stream(x.device))
    if dxbc is not None:  # the gradient of x | B | C in the first slot, dB and dC absent
        grads = (dxbc, *grads[1:3], None, None, *grads[5:])
    return tuple(v if v is not None else absent(x) for v in grads)


@ssd_scan_bwd.register_fake
def _(dy, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, dtcs, states, ypre, table, chunk_size,
      dt_softplus, dt_lo, dt_hi, xbc_dims):
    def like(v):
        return v.new_empty(v.shape) if v is not None else absent(x)

    return (x.new_empty(x.shape), like(dt), like(A), like(B), like(C), like(D), like(z), like(dt_bias),
            like(initial_state))


def _ssd_setup_context(ctx, inputs, output):
    (x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_softplus, dt_lo, dt_hi,
     return_final_state, _save, xbc_dims) = inputs
    _y, _final, dtcs, states, ypre, table = output
    ctx.mark_non_differentiable(dtcs, states, ypre, table)
    ctx.set_materialize_grads(False)  # an unused output gets None, not a zero-filled gradient
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, dtcs, states,
                          ypre if z is not None else None, table if cu_seqlens is not None else None)
    ctx.args = (chunk_size, dt_softplus, dt_lo, dt_hi, list(xbc_dims))
    ctx.return_final_state = return_final_state


def _ssd_backward(ctx, dy, dfinal, *_aux):
    x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, dtcs, states, ypre, table = ctx.saved_tensors
    grads = torch.ops.lm.ssd_scan_bwd(dy, dfinal if ctx.return_final_state else None, x, dt, A, B, C, D, z, dt_bias,
                                      initial_state, cu_seqlens, dtcs, states, ypre, table, *ctx.args)
    dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = grads
    return (dx, ddt, dA, dB if B is not None else None, dC if C is not None else None, dD if D is not None else None,
            dz if z is not None else None, ddt_bias if dt_bias is not None else None,
            dinit if initial_state is not None else None, None, None, None, None, None, None, None, None)


ssd_scan_fwd.register_autograd(_ssd_backward, setup_context=_ssd_setup_context)


def _prep(x, dt, B, C, z, xbc_dims=()):
    """The layout the kernels read: x, B, C, z, dt with a contiguous last dim (dt through its batch / time strides:
    a column block of a projection), B and C with the same strides (copies only what is not laid out so).
    xbc_dims = (P, G, N): x is x | B | C (split here)."""
    if xbc_dims:
        if x.stride(-1) != 1:
            x = x.contiguous()
        x, B, C = split_xbc(x, dt.shape[-1], *xbc_dims)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if dt.stride(-1) != 1:
        dt = dt.contiguous()
    if B.stride(-1) != 1 or C.stride(-1) != 1 or B.stride() != C.stride():
        B, C = B.contiguous(), C.contiguous()
    if z is not None and z.stride(-1) != 1:
        z = z.contiguous()
    return x, dt, B, C, z


def ssd_scan_triton(x, dt, A, B, C, *, chunk_size=256, D=None, z=None, dt_bias=None, dt_softplus=True,
                    dt_limit=(0.0, float("inf")), initial_state=None, cu_seqlens=None, return_final_state=False,
                    xbc_dims=None, max_seqlen=None):
    """Triton SSD scan; same contract as lm_kernels.ssd.ssd_scan. Returns (y, final_state or None).
    xbc_dims = (P, G, N): `x` is x | B | C in one (b, t, H*P + 2*G*N) tensor and B, C are None (ssd_scan_xbc).
    Under torch.compile, and where `max_seqlen` is given, the values of cu_seqlens are not read on the host (that
    would break the graph, or wait for the device): check them before (lm_kernels.varlen.packed_offsets)."""
    xbc = None
    if xbc_dims is not None:
        if B is not None or C is not None:
            raise ValueError("ssd (triton backend): with xbc_dims, x is x | B | C and B, C must be None")
        p, g, n = (int(v) for v in xbc_dims)
        xbc = x if x.stride(-1) == 1 else x.contiguous()
        x, B, C = split_xbc(xbc, dt.shape[-1], p, g, n)
    b, t, *_, nseq = check_scan_args(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_limit,
                                     values=not torch.compiler.is_compiling(), max_seqlen=max_seqlen)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"ssd (triton backend): chunk_size must be a power of two >= 16, got {chunk_size}")
    ln.check_chunk_grid(b, t, nseq, chunk_size, cu_seqlens is not None, "ssd (triton backend)")
    for name, v in (("x", x), ("B", B), ("C", C)):
        if v.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"ssd (triton backend): `{name}` must be float32/bfloat16/float16, got {v.dtype}; "
                             "use backend='reference' for float64")
    if x.shape[1] == 0:
        from .reference import ssd_scan_reference  # noqa: PLC0415
        return ssd_scan_reference(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                                  dt_softplus=dt_softplus, dt_limit=dt_limit, initial_state=initial_state,
                                  cu_seqlens=cu_seqlens, return_final_state=return_final_state,
                                  max_seqlen=max_seqlen)
    if xbc is not None:  # the op splits it again (views)
        x, dt, _, _, z = _prep(x, dt, B, C, z)
        x, B, C, dims = xbc, None, None, [p, g, n]
    else:
        x, dt, B, C, z = _prep(x, dt, B, C, z)
        dims = []
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(x.device)
    tensors = (x, dt, A, B, C, D, z, dt_bias, initial_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    out = torch.ops.lm.ssd_scan_fwd(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_softplus,
                                    float(dt_limit[0]), float(dt_limit[1]), return_final_state, needs_grad, dims)
    return out[0], (out[1] if return_final_state else None)
