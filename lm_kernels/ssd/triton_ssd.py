"""Triton SSD scan: the launches (forward 3 kernels, backward 5-6) and the torch.autograd.Function.

Forward:  dtcb_fwd (dt bias / softplus / clamp with the in-chunk cumsum of dt*A, and C.B per chunk and group)
          -> state_fwd (every chunk's start state; the final state)
          -> chunk_scan_fwd4 (y, whole chunks of four row blocks: 16-bit inputs at chunk 4 * TILE_ROWS) or
             chunk_scan_fwd2 (one row block per program: float32 inputs, other chunk sizes).
Backward: [gate_bwd] -> dstate_bwd (reverse pass of dLoss/dstate) -> dcb_bwd (per group Q = sum_heads dy.x^T *
          decay * dt) -> dx_bwd (dx, and the intra-chunk d(dt*A) shares) -> dbdc_bwd (dB, dC, the state part of
          d(dt*A)) -> dt_bwd (ddt, dA, ddt_bias).
When no gradient is needed (torch.is_grad_enabled() False or no input requires grad) the forward runs outside
autograd: nothing is saved and the pre-gate output is not stored. The chunk size must be a power of two >= 16.
Accumulation is float32; chunk start states are kept in bfloat16 for bfloat16 inputs (they enter the
tensor-core products in that dtype anyway), else in float32; so is C.B (per chunk and group, read by every head).
float32 inputs use tf32 products unless torch.get_float32_matmul_precision() == "highest".
"""
from __future__ import annotations

import torch

from . import launch as ln
from .backward import gate_bwd_kernel
from .backward_dx import dt_bwd_kernel
from .common import check_scan_args
from .launch import cdiv, dot_dt, dot_prec, limits, p2, tune_key


def _forward(x, dt, A, B, C, D, z, dt_bias, initial_state, pl, dt_softplus, dt_limit, want_final, save):
    dev = x.device
    H, P, N, L = pl.H, pl.P, pl.N, pl.L
    has_limit, lo, hi = limits(dt_limit)
    dtp, cs = torch.empty(2, H, pl.BT, dtype=torch.float32, device=dev).unbind(0)
    final = torch.empty(pl.nseq, H, P, N, dtype=torch.float32, device=dev) if want_final else None
    prec, ddt = dot_prec(x.dtype), dot_dt(x.dtype)
    cb_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    CB = torch.empty(pl.NCB, pl.G, L, L, dtype=cb_dtype, device=dev)
    tk = tune_key(pl, x, dt, A, B, D, z, dt_bias, initial_state)
    ln.launch(ln._dtcb_fwd, ("dtcb", tk), (pl.NCB, pl.G * (L // pl.BM) * (L // pl.BK) + cdiv(H, pl.BH)), (
        dt, dt_bias if dt_bias is not None else dt, A, dtp, cs, B, C, CB, pl.chunk_t0, pl.chunk_len,
        pl.T, H, N, pl.NC, pl.BT, pl.G, dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), B.stride(2), lo, hi),
        dict(L=L, BH=pl.BH, BM=pl.BM, BK=pl.BK, BNF=pl.BNF, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
             HAS_LIMIT=has_limit, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt))
    state_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    states = torch.empty(pl.NCB, H, P, N, dtype=state_dtype, device=dev)  # (p, n) per (chunk, head)
    ln.launch(ln._state_fwd, ("state", tk), lambda META: (cdiv(P, META["BP"]) * cdiv(N, pl.BN), H, pl.nseq), (
        x, B, dtp, cs, initial_state if initial_state is not None else dtp, states,
        final if final is not None else dtp, pl.cu, pl.chunk_first,
        pl.T, H, P, N, pl.NC, pl.BT, pl.R,
        x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2)),
        dict(L=L, BN=pl.BN, BK=pl.BKS, HAS_INIT=initial_state is not None, HAS_FINAL=want_final,
             IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt))
    y = torch.empty(pl.b, pl.T, H, P, dtype=x.dtype, device=dev)
    store_pre = save and z is not None  # the pre-gate output, for dz
    ypre = torch.empty_like(y) if store_pre else None
    zz = z if z is not None else x
    scan_args = (x, CB, C, dtp, cs, states, D if D is not None else dtp, zz, y, ypre if ypre is not None else y,
                 pl.chunk_t0, pl.chunk_len, pl.T, H, P, N, pl.NC, pl.BT, pl.R, pl.G,
                 x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2),
                 zz.stride(0), zz.stride(1), zz.stride(2))
    flags = dict(L=L, BNF=pl.BNF, HAS_D=D is not None, D_HP=D is not None and D.dim() == 2, HAS_Z=z is not None,
                 STORE_PRE=store_pre, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt)
    if x.dtype != torch.float32 and L == 4 * pl.BM:
        # (float32 operands compile for sm_90 with spills and twice the shared memory: chunk_scan_fwd2 there)
        ln.launch(ln._scan_fwd4, ("scan4", tk), lambda META: (cdiv(P, META["BP"]), H, pl.NCB), scan_args,
                  dict(BM=pl.BM, **flags))
    else:
        ln.launch(ln._scan_fwd2, ("scan2", tk), lambda META: (cdiv(L, META["BM"]) * cdiv(P, META["BP"]), H, pl.NCB),
                  scan_args, flags)
    return y, final, (dtp, cs, states, CB, ypre if store_pre else y)


def _backward(dout, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_state, pl, dt_softplus, dt_limit, aux):
    dev = x.device
    H, P, N, L, G, R = pl.H, pl.P, pl.N, pl.L, pl.G, pl.R
    dtp, cs, states, CB, ypre = aux
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
    passing = torch.zeros(pl.NCB, H, pl.npn, dtype=torch.float32, device=dev)
    dinit = torch.empty(pl.nseq, H, P, N, dtype=torch.float32, device=dev) if initial_state is not None else None
    if dfinal is not None:
        dfinal = dfinal.float().contiguous()
    tk = tune_key(pl, x, dt, A, B, D, z, dt_bias, initial_state) + (dy.dtype,)
    ln.launch(ln._dstate_bwd, ("dstate", tk), (pl.nseq, H, pl.npn), (
        dy, C, cs, states, dfinal if dfinal is not None else cs, dstates, dinit if dinit is not None else cs,
        passing, pl.cu, pl.chunk_first,
        pl.T, H, P, N, pl.NC, pl.BT, R,
        dy.stride(0), dy.stride(1), dy.stride(2), B.stride(0), B.stride(1), B.stride(2)),
        dict(L=L, BP=pl.BP, BN=pl.BN, BK=pl.BKS, HAS_DFINAL=dfinal is not None, HAS_INIT=initial_state is not None,
             IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt_))
    # per-group dy.x^T (decayed), for dB and dC
    Q = torch.empty(pl.NCB, G, L, L, dtype=torch.float32, device=dev)
    ln.launch(ln._dcb_bwd, ("dcb", tk), ((L // pl.BM) * (L // pl.BK), G, pl.NCB), (
        dy, x, dtp, cs, Q, pl.chunk_t0, pl.chunk_len,
        pl.T, P, pl.NC, pl.BT, R, G,
        dy.stride(0), dy.stride(1), dy.stride(2), x.stride(0), x.stride(1), x.stride(2)),
        dict(L=L, BM=pl.BM, BK=pl.BK, BPF=pl.BPF, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt_))
    # dx, direct ddt, the state terms q and the intra-chunk d(dt*A) shares: every slot / total dt_bwd reads is
    # written (it skips the slots of row blocks a chunk lacks), so no zeroing
    nm = cdiv(L, pl.BM)
    dda = torch.empty(nm, H, pl.BT, dtype=torch.float32, device=dev)
    tot = torch.empty(pl.NCB, H, nm, nm, dtype=torch.float32, device=dev)
    dx = torch.empty(pl.b, pl.T, H, P, dtype=x.dtype, device=dev)
    ddt_dir = torch.empty(H, pl.BT, dtype=torch.float32, device=dev)
    qrow = torch.empty_like(ddt_dir)
    dD_part = (torch.zeros((pl.NCB * nm, H, P) if D.dim() == 2 else (pl.NCB * nm, H), dtype=torch.float32, device=dev)
               if D is not None else None)
    ln.launch(ln._dx_bwd, ("dx", tk), (nm, H, pl.NCB), (
        dy, x, B, CB, dtp, cs, dstates, D if D is not None else cs,
        dx, ddt_dir, qrow, dD_part if dD_part is not None else cs, dda, tot, pl.chunk_t0, pl.chunk_len,
        pl.T, H, P, N, pl.NC, pl.BT, R, G,
        dy.stride(0), dy.stride(1), dy.stride(2), x.stride(0), x.stride(1), x.stride(2),
        B.stride(0), B.stride(1), B.stride(2)),
        dict(L=L, BM=pl.BM, BK=pl.BK, BPF=pl.BPF, BNF=pl.BNF, HAS_D=D is not None,
             D_HP=D is not None and D.dim() == 2, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt_))
    # dB, dC and each row's dcs = dy . y_off (a partial sum per n block)
    n_dcs = cdiv(N, pl.BN_DBDC)
    dcs = torch.empty(n_dcs, H, pl.BT, dtype=torch.float32, device=dev)
    dB = torch.empty(pl.b, pl.T, G, N, dtype=B.dtype, device=dev)
    dC = torch.empty(pl.b, pl.T, G, N, dtype=C.dtype, device=dev)
    ln.launch(ln._dbdc_bwd, ("dbdc", tk), (pl.NCB, G, nm * n_dcs), (
        dy, x, B, C, dtp, cs, states, dstates, Q, dB, dC, dcs, pl.chunk_t0, pl.chunk_len,
        pl.T, H, P, N, pl.NC, pl.BT, R, G,
        dy.stride(0), dy.stride(1), dy.stride(2), x.stride(0), x.stride(1), x.stride(2),
        B.stride(0), B.stride(1), B.stride(2)),
        dict(L=L, BM=pl.BM, BK=pl.BK, BPF=pl.BPF, BN=pl.BN_DBDC, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=ddt_))
    # dt, dA, dt_bias
    has_limit, lo, hi = limits(dt_limit)
    ddt = torch.empty(dt.shape, dtype=dt.dtype, device=dev)
    dA_part = torch.zeros(pl.NCB, H, dtype=torch.float32, device=dev)
    dbias_part = torch.zeros(pl.NCB, H, dtype=torch.float32, device=dev) if dt_bias is not None else None
    dt_bwd_kernel[(pl.NCB, cdiv(H, pl.BH))](
        dt, dt_bias if dt_bias is not None else dt, A, dtp, ddt_dir, dcs, dda, tot, qrow, passing,
        ddt, dA_part, dbias_part if dbias_part is not None else dA_part, pl.chunk_t0, pl.chunk_len,
        pl.T, H, pl.NC, pl.BT, pl.npn, dt.stride(0), dt.stride(1), lo, hi,
        L=L, BH=pl.BH, NPN_B=p2(pl.npn, 1), HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        HAS_LIMIT=has_limit, IS_VARLEN=pl.varlen, BMB=pl.BM, NDCS=n_dcs, num_warps=4)
    dA = dA_part.sum(0).to(A.dtype)
    ddt_bias = dbias_part.sum(0).to(dt_bias.dtype) if dt_bias is not None else None
    dD = dD_part.sum(0).to(D.dtype) if D is not None else None  # (H, P) or (H,)
    dinit = dinit.to(initial_state.dtype) if dinit is not None else None
    return dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit


class SSDScanFn(torch.autograd.Function):
    """Autograd wrapper; inputs arrive already checked and laid out by ssd_scan_triton."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_softplus, dt_limit,
                return_final_state):
        pl = ln.plan(x, B, cu_seqlens, chunk_size)
        y, final, aux = _forward(x, dt, A, B, C, D, z, dt_bias, initial_state, pl, dt_softplus, dt_limit,
                                 return_final_state, save=True)
        dtp, cs, states, CB, ypre = aux
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_state, dtp, cs, states, CB,
                              ypre if z is not None else None)
        ctx.plan, ctx.dt_softplus, ctx.dt_limit = pl, dt_softplus, dt_limit
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, z, dt_bias, initial_state, dtp, cs, states, CB, ypre = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        grads = _backward(dy, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_state, ctx.plan, ctx.dt_softplus,
                          ctx.dt_limit, (dtp, cs, states, CB, ypre))
        return (*grads, None, None, None, None, None)


def _prep(x, dt, B, C, z):
    if x.stride(-1) != 1:
        x = x.contiguous()
    dt = dt.contiguous()
    if B.stride(-1) != 1 or C.stride(-1) != 1 or B.stride() != C.stride():
        B, C = B.contiguous(), C.contiguous()
    if z is not None and z.stride(-1) != 1:
        z = z.contiguous()
    return x, dt, B, C, z


def ssd_scan_triton(x, dt, A, B, C, *, chunk_size=256, D=None, z=None, dt_bias=None, dt_softplus=True,
                    dt_limit=(0.0, float("inf")), initial_state=None, cu_seqlens=None, return_final_state=False):
    """Triton SSD scan; same contract as lm_kernels.ssd.ssd_scan. Returns (y, final_state or None)."""
    check_scan_args(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_limit)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"ssd (triton backend): chunk_size must be a power of two >= 16, got {chunk_size}")
    for name, v in (("x", x), ("B", B), ("C", C)):
        if v.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"ssd (triton backend): `{name}` must be float32/bfloat16/float16, got {v.dtype}; "
                             "use backend='reference' for float64")
    if x.shape[1] == 0:
        from .reference import ssd_scan_reference  # noqa: PLC0415
        return ssd_scan_reference(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                                  dt_softplus=dt_softplus, dt_limit=dt_limit, initial_state=initial_state,
                                  cu_seqlens=cu_seqlens, return_final_state=return_final_state)
    x, dt, B, C, z = _prep(x, dt, B, C, z)
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    tensors = (x, dt, A, B, C, D, z, dt_bias, initial_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if needs_grad:
        return SSDScanFn.apply(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_softplus,
                               tuple(dt_limit), return_final_state)
    pl = ln.plan(x, B, cu_seqlens, chunk_size)
    y, final, _ = _forward(x, dt, A, B, C, D, z, dt_bias, initial_state, pl, dt_softplus, dt_limit,
                           return_final_state, save=False)
    return y, final
