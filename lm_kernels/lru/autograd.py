"""torch.autograd.Function around the Triton kernels of triton_scan.py, and the launchers.

No-grad calls (torch.no_grad, or no input requiring grad) run the forward launches only and save
nothing. Saved for backward: A (as given, a stride-0 A stays a view), h (the output), the initial
state, the chunk transitions C_c (b, nc, nb, m, m) in the accumulation dtype (1/L of A's size).
dA is returned in A's full (expanded) shape and dtype; for a stride-0 A autograd then sums it, so the
backward of an expanded A costs one (b, t, nb, m, m) buffer.
"""
from __future__ import annotations

import torch

from ..backend import cdiv
from .common import check_args, compute_dtype, seq_index
from .triton_scan import (_bwd_chunk_kernel, _bwd_out_kernel, _bwd_pass_kernel, _fwd_chunk_kernel,
                          _fwd_out_kernel, _fwd_pass_kernel, launch_config)


def _tl_dtype(cd):
    import triton.language as tl
    return tl.float64 if cd == torch.float64 else tl.float32


def _forward(A, x, h0, seq, num_seqs, L, store_final, cd):
    """Returns (h, final or None, CT)."""
    b, t, nb, m = x.shape
    nc = -(-t // L)
    mp, bn, bn_chunk, warps = launch_config(m, nb)
    acc = _tl_dtype(cd)
    dev = x.device
    CT = torch.empty(b, nc, nb, m, m, dtype=cd, device=dev)
    YT = torch.empty(b, nc, nb, m, dtype=cd, device=dev)
    S = torch.empty(b, nc, nb, m, dtype=cd, device=dev)
    h = torch.empty(b, t, nb, m, dtype=x.dtype, device=dev)
    fin = None
    if store_final:
        fin = h0.clone() if h0 is not None else torch.zeros(num_seqs, nb, m, dtype=cd, device=dev)
    seq_arg = seq if seq is not None else x  # any pointer; unused when not varlen
    h0_arg = h0 if h0 is not None else x
    grid = (cdiv(nb, bn), nc, b)
    rows = A.stride(-2) == m and A.stride(-1) == 1 and x.stride(-1) == 1
    common = dict(M=m, MP=mp, L=L, IS_VARLEN=seq is not None, A_ROWS=rows, HAS_H0=h0 is not None,
                  ACC=acc, num_warps=warps)
    _fwd_chunk_kernel[(cdiv(nb, bn_chunk), nc, b)](A, x, seq_arg, h0_arg, CT, YT, *A.stride(), *x.stride(),
                                                   t, nb, nc, BN=bn_chunk, **common)
    _fwd_pass_kernel[(cdiv(nb, bn), b)](CT, YT, S, nb, nc, M=m, MP=mp, BN=bn, ACC=acc, num_warps=warps)
    _fwd_out_kernel[grid](A, x, seq_arg, h0_arg, S, h, fin if fin is not None else S,
                          *A.stride(), *x.stride(), t, nb, nc, BN=bn, STORE_FINAL=store_final, **common)
    return h, fin, CT


def _backward(A, h, h0, seq, CT, dh, dfin, L, need_dA, need_dh0, x_dtype, cd):
    b, t, nb, m = h.shape
    nc = CT.shape[1]
    mp, bn, _, warps = launch_config(m, nb)
    acc = _tl_dtype(cd)
    dev = h.device
    dh = dh.contiguous() if dh is not None else torch.zeros_like(h)
    RT = torch.empty(b, nc, nb, m, dtype=cd, device=dev)
    U = torch.empty(b, nc, nb, m, dtype=cd, device=dev)
    dx = torch.empty(b, t, nb, m, dtype=x_dtype, device=dev)
    dA = torch.empty(b, t, nb, m, m, dtype=A.dtype, device=dev) if need_dA else None
    dh0 = None
    if need_dh0:  # documents without tokens pass dfinal straight to their initial state
        dh0 = dfin.to(cd).clone() if dfin is not None else torch.zeros(h0.shape, dtype=cd, device=dev)
    seq_arg = seq if seq is not None else dh
    h0_arg = h0 if h0 is not None else dh
    dfin_arg = dfin.contiguous() if dfin is not None else dh
    grid = (cdiv(nb, bn), nc, b)
    rows = A.stride(-2) == m and A.stride(-1) == 1
    flags = dict(M=m, MP=mp, L=L, BN=bn, IS_VARLEN=seq is not None, A_ROWS=rows, ACC=acc, num_warps=warps)
    _bwd_chunk_kernel[grid](A, dh, seq_arg, dfin_arg, RT, *A.stride(), t, nb, nc,
                            HAS_DFIN=dfin is not None, **flags)
    _bwd_pass_kernel[(cdiv(nb, bn), b)](CT, RT, U, nb, nc, M=m, MP=mp, BN=bn, ACC=acc, num_warps=warps)
    _bwd_out_kernel[grid](A, dh, h, seq_arg, h0_arg, dfin_arg, U, dA if dA is not None else dh, dx,
                          dh0 if dh0 is not None else dh, *A.stride(), t, nb, nc,
                          HAS_H0=h0 is not None, HAS_DFIN=dfin is not None, NEED_DA=need_dA,
                          NEED_DH0=need_dh0, **flags)
    return dA, dx, dh0


class _BlockScanFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, x, h0, seq, num_seqs, L, store_final, cd):
        h0c = h0.to(cd).contiguous() if h0 is not None else None
        h, fin, CT = _forward(A, x, h0c, seq, num_seqs, L, store_final, cd)
        ctx.save_for_backward(A, h, h0c, seq, CT)
        ctx.L, ctx.cd, ctx.x_dtype = L, cd, x.dtype
        ctx.h0_dtype = h0.dtype if h0 is not None else None
        if fin is None:
            fin = torch.empty(0, dtype=cd, device=x.device)
            ctx.mark_non_differentiable(fin)
        return h, fin

    @staticmethod
    def backward(ctx, dh, dfin):
        A, h, h0, seq, CT = ctx.saved_tensors
        need_dA, _, need_dh0 = ctx.needs_input_grad[:3]
        if dfin is not None and dfin.numel() == 0:
            dfin = None
        dA, dx, dh0 = _backward(A, h, h0, seq, CT, dh, dfin, ctx.L, need_dA, need_dh0 and h0 is not None,
                                ctx.x_dtype, ctx.cd)
        if dh0 is not None:
            dh0 = dh0.to(ctx.h0_dtype)
        return dA, dx, dh0, None, None, None, None, None


def block_scan_triton(A, x, *, initial_state=None, cu_seqlens=None, chunk_size=64, return_final_state=False):
    """Triton backend of `block_scan` (same contract)."""
    b, t, nb, m, num_seqs = check_args(A, x, initial_state, cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    cd = compute_dtype(A, x, initial_state)
    if t == 0:
        from .reference import block_scan_reference
        return block_scan_reference(A, x, initial_state=initial_state, cu_seqlens=cu_seqlens,
                                    return_final_state=return_final_state)
    seq = seq_index(cu_seqlens, t).to(torch.int32) if cu_seqlens is not None else None
    L = int(chunk_size)  # a compile-time constant: short sequences run a partial chunk
    needs_grad = torch.is_grad_enabled() and any(
        v is not None and v.requires_grad for v in (A, x, initial_state))
    if not needs_grad:
        h0c = initial_state.to(cd).contiguous() if initial_state is not None else None
        h, fin, _ = _forward(A, x, h0c, seq, num_seqs, L, return_final_state, cd)
        return h, fin
    h, fin = _BlockScanFn.apply(A, x, initial_state, seq, num_seqs, L, return_final_state, cd)
    return h, (fin if return_final_state else None)
