"""Context parallelism for the recurrent ops: each rank of a context group holds a contiguous slice of every sequence.

    sl = ContextSlice(group, lead=..., offsets=...)         # what this rank holds (one per forward)
    y = causal_conv1d_cp(x, weight, bias, sl, x_add=None, cu_seqlens=None, activation="silu")
    y, final = ssd_scan_xbc_cp(xbc, dt, A, sl, headdim=.., ngroups=.., dstate=.., ...)   # also ssd_scan_cp
    o, final = chunk_deltaproduct_cp(q, k, v, beta, g, sl, num_householder=.., ...)
    h, final = block_scan_cp(A, x, sl, cu_seqlens=None, chunk_size=64)
    first = shift_halo(y_last, sl)                          # the previous rank's last token (a one-token shift)
    h_in = pass_states(S, M, sl, apply)                     # the state that enters this rank's slice
    parts = all_gather(x, group)                            # (size, *x.shape), backward a reduce-scatter

Every op here is linear in its state: over a slice, the state that leaves it is h_out = M h_in + S, where S is the
slice's own final state (scanned from zero) and M its total transition, and every output inside the slice is its
zero-start output plus a term linear in h_in. So each rank scans its slice from a zero state with the op's own
kernel, the ranks exchange (S, M) in one all-gather, each folds the ranks before it into the state h_in that enters
its slice, h_{r+1} = M_r h_r + S_r from h_0 = 0, and corrects its outputs with h_in. The backward passes the state
gradients the other way: one all-gather of every rank's dL/dh_in, then each rank folds the ranks after it
(`pass_states`). Per op:

    SSD           M = exp(sum dt A) per head (a scalar); y_t += exp(cs_t) C_t h_in with cs the in-slice cumsum of
                  dt A (the state (p, n) per head): a product in PyTorch on top of the kernel's zero-start output.
    DeltaProduct  M = the product of the slice's (I - beta k k^T) factors and decays, (K, K) per head; one run of the
                  kernel with v widened by K zero columns and the initial state [0 | I] gives both the zero-start
                  output (the first V columns) and q~_t = scale P_t^T q_t (the last K: P_t the transition from the
                  slice start to token t), and its final state is [S | M]; then o_t += h_in^T q~_t.
    LRU family    M = A_t ... A_1 per block (m, m) and S by a log-depth reduction in PyTorch over (A_t, x_t) pairs;
                  then the kernel rescans the slice from h_in (its output is the state itself).
    conv1d        a halo: the last w - 1 inputs of the previous rank (one all-gather of w - 1 tokens); the first
                  w - 1 outputs are recomputed from [halo, first inputs] and written over the zero-history ones.

Packed documents (b == 1, `cu_seqlens` local to the slice): the state restarts at each document start, so only the
slice's first document takes h_in, and only if it continues a document of the previous rank (`lead` > 0); the state
handed on is the last document's, and M is 0 unless the slice is one continuing document. Every rank takes part in
each exchange whether or not it uses the result (a rank whose slice starts a sequence multiplies it by 0): the
collectives, and their backward, then run in the same order on every rank.

Communication per op call: (S, M) of every rank (SSD: b h p n + b h; DeltaProduct: b H K (V + K); LRU: b N m (m + 1);
conv: b (w - 1) c), whatever the slice's length. Correctness first: the exchange is an all-gather and a fold of
`size` small steps on every rank (not a log-depth scan over ranks), and the DeltaProduct correction costs a second
kernel pass over K extra value columns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .conv1d import causal_conv1d
from .deltaproduct import chunk_deltaproduct
from .lru import block_scan
from .ssd import ssd_scan, ssd_scan_xbc
from .ssd.common import process_dt, split_xbc


@dataclass(frozen=True)
class ContextSlice:
    """This rank's slice of the sequences of one forward.

    group:   the context group (a torch.distributed process group; None = the default group).
    lead:    how many tokens of the slice's first sequence are held by earlier ranks: 0 where the slice's first token
             starts a sequence (rank 0, or a packed document that starts exactly there); the start of the slice in
             the sequence otherwise (b > 1 rows: every row's).
    offsets: the packed documents' offsets local to the slice, (0, ..., t) host ints, as the ops' cu_seqlens (b == 1);
             None without packed documents.
    """

    group: object
    lead: int
    offsets: tuple | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def continues(self) -> bool:
        """Whether the slice's first token continues a sequence of the previous rank."""
        return self.lead > 0

    def first_length(self, t: int) -> int:
        """Tokens of the slice's first document (t without packed documents)."""
        return t if self.offsets is None else self.offsets[1]

    @property
    def segments(self) -> int:
        """Local documents (1 without packed documents)."""
        return 1 if self.offsets is None else len(self.offsets) - 1


def slice_offsets(offsets, start: int, length: int) -> tuple[int, tuple]:
    """(lead, local offsets) of the slice [start, start + length) of a packed row whose documents have the global
    `offsets` (0, ..., total): how many tokens of the slice's first document come before it, and the offsets of the
    documents inside the slice, (0, ..., length) without empty documents."""
    offsets = [int(o) for o in offsets]
    if not offsets or offsets[0] != 0 or offsets[-1] < start + length:
        raise ValueError(f"slice_offsets: offsets must run from 0 to at least the slice's end {start + length}, got "
                         f"{offsets[:4]}...{offsets[-2:]}")
    lead = start - max(o for o in offsets if o <= start)
    inner = sorted({o - start for o in offsets if start < o < start + length})
    return lead, (0, *inner, length)


# --- collectives with autograd ---------------------------------------------------------------------------------------
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (deprecated there); the GPU lock has torch 2.11
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """(size, *x.shape): every rank's x; the backward reduce-scatters (sums) the gradient back to each rank."""

    @staticmethod
    def forward(ctx, x, group):
        size = dist.get_world_size(group)
        out = x.new_empty(size * x.numel())
        _gather_into(out, x.contiguous().view(-1), group=group)
        ctx.group, ctx.shape = group, x.shape
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty(ctx.shape)
        _reduce_scatter(out.view(-1), g.contiguous().view(-1), group=ctx.group)
        return out, None


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `x` stacked, (size, *x.shape), on every rank (same shape and dtype on all); differentiable: the
    gradient of each rank's entry is summed over the ranks and returned to its owner."""
    return _AllGather.apply(x, group)


def _fold(Sg: torch.Tensor, Mg: torch.Tensor, apply, upto: int) -> list[torch.Tensor]:
    """[h_0, ..., h_upto]: h_0 = 0, h_{j+1} = apply(M_j, h_j) + S_j."""
    hs = [torch.zeros_like(Sg[0])]
    for j in range(upto):
        hs.append(apply(Mg[j], hs[-1]) + Sg[j])
    return hs


class _PassStates(torch.autograd.Function):
    """h_in of this rank from every rank's (S, M); see `pass_states`."""

    @staticmethod
    def forward(ctx, S, M, group, apply):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        gathered = all_gather(torch.cat([S.reshape(-1), M.reshape(-1)]), group)  # one collective for both
        Sg = gathered[:, :S.numel()].reshape(size, *S.shape)
        Mg = gathered[:, S.numel():].reshape(size, *M.shape)
        ctx.save_for_backward(Sg, Mg)
        ctx.group, ctx.transition = group, apply  # (ctx.apply is autograd's)
        return _fold(Sg, Mg, apply, rank)[rank]

    @staticmethod
    def backward(ctx, dh):
        Sg, Mg = ctx.saved_tensors
        group, apply = ctx.group, ctx.transition
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        dhg = all_gather(dh.contiguous(), group)  # every rank's dL/dh_in
        with torch.enable_grad():
            S_, M_ = Sg.detach().requires_grad_(), Mg.detach().requires_grad_()
            hs = _fold(S_, M_, apply, size - 1)
            if size > 1:
                dS, dM = torch.autograd.grad(hs[1:], (S_, M_), grad_outputs=list(dhg[1:]), allow_unused=True)
            else:
                dS = dM = None
        dS = dS[rank] if dS is not None else torch.zeros_like(Sg[0])
        dM = dM[rank] if dM is not None else torch.zeros_like(Mg[0])
        return dS, dM, None, None


def pass_states(S: torch.Tensor, M: torch.Tensor, sl: ContextSlice,
                apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The state entering this rank's slice, h_r, from every rank's zero-start final state S and total transition M
    (same shapes and dtype on every rank): h_0 = 0, h_{j+1} = apply(M_j, h_j) + S_j, with `apply` linear in h (a
    differentiable PyTorch function). Forward: one all-gather of (S, M) and a fold over the ranks before this one.
    Backward: one all-gather of every rank's dL/dh_in; each rank folds the ranks after it back into dL/dS, dL/dM of its
    own (the gradient that its (S, M) received from every later rank's h_in)."""
    if S.dtype != M.dtype:
        raise ValueError(f"pass_states: S and M must share a dtype, got {S.dtype} and {M.dtype}")
    return _PassStates.apply(S, M, sl.group, apply)


def shift_halo(last: torch.Tensor, sl: ContextSlice) -> torch.Tensor:
    """The previous rank's `last` (this rank's own last token, (b, ...)), zero where the slice starts a sequence: the
    value a one-token shift puts at the slice's first position."""
    gathered = all_gather(last, sl.group)
    prev = gathered[max(sl.rank - 1, 0)]
    return prev * (1.0 if sl.continues else 0.0)


# --- conv1d ----------------------------------------------------------------------------------------------------------
def causal_conv1d_cp(x, weight, bias, sl: ContextSlice, *, x_add=None, cu_seqlens=None, activation="silu",
                     backend=None):
    """`lm_kernels.conv1d.causal_conv1d` over this rank's slice (no conv state: training): the zero-history conv of the
    slice with its first w - 1 outputs recomputed from the previous rank's last w - 1 inputs (the halo, masked to the
    tokens of the slice's first document). Returns y (b, t, c)."""
    y, _ = causal_conv1d(x, weight, bias, x_add=x_add, cu_seqlens=cu_seqlens, activation=activation, backend=backend)
    h = weight.shape[-1] - 1
    if h == 0:
        return y
    b, t, c = x.shape
    if t < h:
        raise ValueError(f"causal_conv1d_cp: each rank's slice must hold at least w - 1 = {h} tokens, got {t}: use "
                         "fewer context ranks or longer sequences")

    def inputs(part):
        return x[:, part] if x_add is None else x[:, part] + x_add[:, part]

    halos = all_gather(inputs(slice(t - h, t)), sl.group)  # (size, b, h, c): every rank's last h inputs
    # halo token i stands h - i tokens before the slice: it belongs to the slice's first document if h - i <= lead
    keep = (torch.arange(h, device=x.device) >= h - min(sl.lead, h)).to(x.dtype).view(1, h, 1)
    window = torch.cat([halos[max(sl.rank - 1, 0)] * keep, inputs(slice(0, h))], dim=1)  # (b, 2h, c)
    wcu = None
    if sl.offsets is not None:  # documents that start among the first h tokens keep their own start
        wcu = torch.tensor([0, *[h + o for o in sl.offsets[1:] if o < h], 2 * h], dtype=torch.int32, device=x.device)
    fix, _ = causal_conv1d(window, weight, bias, cu_seqlens=wcu, activation=activation, backend=backend)
    y[:, :h] = fix[:, h:]  # in place: neither conv's backward reads its output
    return y


# --- SSD ---------------------------------------------------------------------------------------------------------------
def _ssd_correct(y, final, C, dt, A, sl: ContextSlice, dt_bias, dt_softplus, dt_limit):
    """y (b, t, h, p) and the zero-start final states (num_seqs | b, h, p, n) -> (y + exp(cs_t) C_t h_in over the
    slice's first document, this rank's outgoing state M h_in + S)."""
    b, t, nh, p = y.shape
    g, n = C.shape[2], C.shape[3]
    cd = final.dtype
    L1 = sl.first_length(t)
    S = final[-1:] if sl.offsets is not None else final  # the last document's state is handed on
    cs = torch.cumsum(process_dt(dt[:, :L1], dt_bias, dt_softplus, dt_limit, cd) * A.to(cd), dim=1)  # (b, L1, h)
    whole = sl.continues and sl.segments == 1  # M: the decay of the whole slice, else the state restarts inside it
    M = torch.exp(cs[:, -1]) * (1.0 if whole else 0.0)  # (b, h)
    h_in = pass_states(S, M, sl, lambda m, s: m[..., None, None] * s)  # (b, h, p, n)
    decay = torch.exp(cs) * (1.0 if sl.continues else 0.0)
    r = nh // g
    corr = torch.einsum("bgrpn,btgn->btgrp", h_in.reshape(b, g, r, p, n), C[:, :L1].to(cd))
    corr = corr.reshape(b, L1, nh, p) * decay[..., None]
    if L1 < t:
        corr = F.pad(corr, (0, 0, 0, 0, 0, t - L1))
    y = (y.to(cd) + corr).to(y.dtype)
    return y, M[..., None, None] * h_in + S


def _check_ssd(z, initial_state):
    if z is not None or initial_state is not None:
        raise ValueError("ssd_scan_cp: no z gate or initial state with context parallelism (apply the gate after the "
                         "scan; the slice's initial state comes from the earlier ranks)")


def ssd_scan_cp(x, dt, A, B, C, sl: ContextSlice, *, chunk_size=256, D=None, z=None, dt_bias=None, dt_softplus=True,
                dt_limit=(0.0, float("inf")), initial_state=None, cu_seqlens=None, max_seqlen=None, backend=None):
    """`lm_kernels.ssd.ssd_scan` over this rank's slice; returns (y, this rank's final state: the sequence's final
    state on the last rank; with packed documents its last document's)."""
    _check_ssd(z, initial_state)
    y, final = ssd_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                        dt_limit=dt_limit, cu_seqlens=cu_seqlens, return_final_state=True, backend=backend,
                        max_seqlen=max_seqlen)
    return _ssd_correct(y, final, C, dt, A, sl, dt_bias, dt_softplus, dt_limit)


def ssd_scan_xbc_cp(xbc, dt, A, sl: ContextSlice, *, headdim, ngroups, dstate, chunk_size=256, D=None, z=None,
                    dt_bias=None, dt_softplus=True, dt_limit=(0.0, float("inf")), initial_state=None, cu_seqlens=None,
                    max_seqlen=None, backend=None):
    """`lm_kernels.ssd.ssd_scan_xbc` over this rank's slice; returns (y, this rank's final state) as ssd_scan_cp."""
    _check_ssd(z, initial_state)
    y, final = ssd_scan_xbc(xbc, dt, A, headdim=headdim, ngroups=ngroups, dstate=dstate, chunk_size=chunk_size, D=D,
                            dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, cu_seqlens=cu_seqlens,
                            return_final_state=True, backend=backend, max_seqlen=max_seqlen)
    _, _, C = split_xbc(xbc, dt.shape[-1], headdim, ngroups, dstate)
    return _ssd_correct(y, final, C, dt, A, sl, dt_bias, dt_softplus, dt_limit)


# --- DeltaProduct ------------------------------------------------------------------------------------------------------
def chunk_deltaproduct_cp(q, k, v, beta, g, sl: ContextSlice, *, num_householder, scale=None, use_qk_l2norm=False,
                          cu_seqlens=None, chunk_size=64, backend=None, cu_seqlens_cpu=None):
    """`lm_kernels.deltaproduct.chunk_deltaproduct` over this rank's slice (no initial state); returns (o, this
    rank's final state). One kernel run on [v | 0] from [0 | I] (module docstring), an exchange, o += h_in^T q~."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    v_ext = torch.cat([v, v.new_zeros(*v.shape[:-1], K)], dim=-1)
    cd = torch.float64 if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.float32
    n = B if sl.offsets is None else sl.segments
    init = torch.zeros(n, H, K, V + K, dtype=cd, device=q.device)
    if sl.continues:  # the transition of the slice's first document (or of every row) from the identity
        rows = slice(None) if sl.offsets is None else slice(0, 1)
        init[rows, :, :, V:] = torch.eye(K, dtype=cd, device=q.device)
    o, final = chunk_deltaproduct(q, k, v_ext, beta, g, num_householder=num_householder, scale=scale,
                                  initial_state=init, output_final_state=True, use_qk_l2norm=use_qk_l2norm,
                                  cu_seqlens=cu_seqlens, chunk_size=chunk_size, backend=backend,
                                  cu_seqlens_cpu=cu_seqlens_cpu)
    o_loc, qt = o[..., :V], o[..., V:]
    last = final[-1:] if sl.offsets is not None else final
    S, M = last[..., :V].contiguous(), last[..., V:].contiguous()  # (b, H, K, V), (b, H, K, K)
    h_in = pass_states(S, M, sl, torch.matmul)
    o = (o_loc.to(cd) + torch.einsum("bthk,bhkv->bthv", qt.to(cd), h_in)).to(o.dtype)
    return o, M @ h_in + S


# --- LRU block scan ----------------------------------------------------------------------------------------------------
def _total(A: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_t ... A_1, the zero-start final state) over t (dim 1) by a log-depth pairwise reduction of (A_t, x_t) with
    (C1, y1), (C2, y2) -> (C2 C1, C2 y1 + y2). A (b, t, nb, m, m), x (b, t, nb, m) -> (b, nb, m, m), (b, nb, m)."""
    while A.shape[1] > 1:
        if A.shape[1] % 2:  # an identity step at the end
            eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand(A.shape[0], 1, *A.shape[2:])
            A = torch.cat([A, eye], dim=1)
            x = F.pad(x, (0, 0, 0, 0, 0, 1))
        A1, A2, x1, x2 = A[:, 0::2], A[:, 1::2], x[:, 0::2], x[:, 1::2]
        x = x2 + torch.einsum("btnij,btnj->btni", A2, x1)
        A = A2 @ A1
    return A[:, 0], x[:, 0]


def block_scan_cp(A, x, sl: ContextSlice, *, cu_seqlens=None, chunk_size=64, backend=None):
    """`lm_kernels.lru.block_scan` over this rank's slice (no initial state); returns (h, this rank's final state).
    The slice's total transition and zero-start state come from `_total` over (A, x) with A zeroed at every document
    start (so that both are the last document's), then the kernel scans the slice from h_in."""
    b, t = x.shape[:2]
    cd = torch.float64 if torch.float64 in (A.dtype, x.dtype) else torch.float32
    with torch.autocast(x.device.type, enabled=False):
        Ac, xc = A.to(cd), x.to(cd)
        starts = [0] if not sl.continues else []
        if sl.offsets is not None:
            starts += [o for o in sl.offsets[1:-1] if 0 < o < t]
        if starts:
            keep = torch.ones(t, dtype=cd, device=x.device)
            keep[starts] = 0.0
            Ac = Ac * keep.view(1, t, 1, 1, 1)
        M, S = _total(Ac, xc)
        h_in = pass_states(S, M, sl, lambda m, h: torch.einsum("bnij,bnj->bni", m, h))
        h0 = h_in * (1.0 if sl.continues else 0.0)
        if sl.offsets is not None and sl.segments > 1:  # only the first document takes it
            h0 = torch.cat([h0, h0.new_zeros(sl.segments - 1, *h0.shape[1:])])
    h, final = block_scan(A, x, initial_state=h0, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                          return_final_state=True, backend=backend)
    return h, final[-1:] if sl.offsets is not None else final
