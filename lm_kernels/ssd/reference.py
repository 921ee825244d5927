"""Chunked SSD (Mamba2 state-space duality) in PyTorch: the reference and the CPU training path.

Recurrence (per head, state (p, n)):   h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t.
The sequence is cut into chunks of L tokens. Inside a chunk the output is the quadratic (attention
like) form  y_l = sum_{s<=l} (C_l.B_s) exp(cs_l - cs_s) dt_s x_s  with cs the in-chunk cumsum of
dt*A; across chunks the state is passed on:  S_{c+1} = exp(cs_last) S_c + sum_s exp(cs_last - cs_s)
dt_s x_s B_s^T, and each chunk adds  exp(cs_l) S_c C_l. Everything is vectorised over chunks (the
chunk-to-chunk pass is a (c+1) x (c+1) decay matrix), accumulates in float32 (float64 for float64
inputs) and is differentiable by autograd.

Packed documents (cu_seqlens) are regrouped into a padded (num_seqs, max_len) batch with dt = 0 on
the padding (decay 1, no input), which leaves final states exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import apply_skip_and_gate, check_scan_args, compute_dtype, process_dt


def segsum(a: torch.Tensor) -> torch.Tensor:
    """a (..., T) -> (..., T, T) with out[i, j] = sum_{k=j+1..i} a[k] for i >= j, -inf above.

    Summed per entry (masked cumsum), not as a difference of cumsums, so no cancellation."""
    T = a.shape[-1]
    a_rep = a[..., None, :].expand(*a.shape[:-1], T, T)  # [i, k] = a[k]
    strict = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(-1)  # k < i ... used as [k, j]
    # out[i, j] = sum_{k <= i} [k > j] a[k]: build m[k, j] = a[k] * (k > j), cumsum over k.
    m = a_rep.transpose(-1, -2).masked_fill(~strict, 0.0)  # m[k, j] = a[k] if k > j
    out = torch.cumsum(m, dim=-2)
    lower = torch.ones(T, T, dtype=torch.bool, device=a.device).tril(0)
    return out.masked_fill(~lower, float("-inf"))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: the gradient of a permuted
    output reaches the batched matmuls with strides that send CPU bmm down a slow path (~100x)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def chunk_scan_core(x, dt, A, B, C, chunk_size, initial_state=None):
    """The chunked scan on processed inputs, all in one floating dtype.

    x (b,t,h,p), dt (b,t,h) already softplus'ed/clamped, A (h,), B/C (b,t,g,n), initial_state
    (b,h,p,n) or None. Returns y (b,t,h,p) (no D skip, no gate) and the final state (b,h,p,n).
    Internally laid out (batch, group, head-in-group, chunk, row, ...) so that every product is a
    batched matmul on contiguous operands."""
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r = h // g
    L = chunk_size
    nc = max(1, -(-t // L))
    pad = nc * L - t
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    x = x.reshape(b, nc, L, g, r, p).permute(0, 3, 4, 1, 2, 5)  # (b,g,r,c,L,p)
    dt = dt.reshape(b, nc, L, g, r).permute(0, 3, 4, 1, 2)  # (b,g,r,c,L)
    B = B.reshape(b, nc, L, g, n).permute(0, 3, 1, 2, 4).unsqueeze(2)  # (b,g,1,c,L,n)
    C = C.reshape(b, nc, L, g, n).permute(0, 3, 1, 2, 4).unsqueeze(2)
    cs = torch.cumsum(dt * A.reshape(1, g, r, 1, 1), dim=-1)  # (b,g,r,c,L)
    xdt = x * dt[..., None]

    # Intra-chunk (diagonal blocks): y_l = sum_{s<=l} (C_l.B_s) exp(cs_l - cs_s) dt_s x_s.
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(0)
    decay = torch.exp((cs[..., :, None] - cs[..., None, :]).masked_fill(~causal, float("-inf")))  # (...,L,S)
    CB = C @ B.transpose(-1, -2)  # (b,g,1,c,L,S)
    y = (CB * decay) @ xdt  # (b,g,r,c,L,p)

    # State contributed by each chunk alone: sum_s exp(cs_last - cs_s) dt_s x_s B_s^T.
    w_state = torch.exp(cs[..., -1:] - cs)  # (b,g,r,c,L)
    chunk_states = (xdt * w_state[..., None]).transpose(-1, -2) @ B  # (b,g,r,c,p,n)

    # Inter-chunk pass: state at the start of every chunk, plus the final state.
    if initial_state is None:
        s0 = torch.zeros(b, g, r, 1, p, n, dtype=x.dtype, device=x.device)
    else:
        s0 = initial_state.reshape(b, g, r, 1, p, n)
    states = torch.cat([s0, chunk_states], dim=3)  # (b,g,r,c+1,p,n)
    chunk_decay = torch.exp(segsum(F.pad(cs[..., -1], (1, 0))))  # (b,g,r,c+1,c+1)
    states = (chunk_decay @ states.reshape(b, g, r, nc + 1, p * n)).reshape(b, g, r, nc + 1, p, n)
    start_states, final_state = states[:, :, :, :-1], states[:, :, :, -1]

    # Off-diagonal: each token reads its chunk's starting state.
    y = y + (C @ start_states.transpose(-1, -2)) * torch.exp(cs)[..., None]
    if y.requires_grad:
        y = _ContiguousGrad.apply(y)
    y = y.permute(0, 3, 4, 1, 2, 5).reshape(b, nc * L, h, p)[:, :t].contiguous()
    return y, final_state.reshape(b, h, p, n)


def pack_index(cu_seqlens: torch.Tensor, device, max_seqlen: int | None = None):
    """Offsets -> (idx (S, maxlen) long into the packed axis, mask (S, maxlen) bool); maxlen the longest
    document's length, read from the offsets (a wait for the device where they are on one) unless `max_seqlen` (at
    least that length) is given."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    maxlen = max(1, int(lens.max()) if max_seqlen is None else max_seqlen)
    j = torch.arange(maxlen, device=device)
    mask = j[None, :] < lens[:, None]
    idx = torch.where(mask, cu[:-1, None] + j[None, :], torch.zeros_like(j)[None, :])
    return idx, mask


def ssd_scan_reference(x, dt, A, B, C, *, chunk_size=256, D=None, z=None, dt_bias=None, dt_softplus=True,
                       dt_limit=(0.0, float("inf")), initial_state=None, cu_seqlens=None,
                       return_final_state=False, max_seqlen=None):
    """PyTorch chunked SSD; see lm_kernels.ssd.ssd_scan for the arguments. Returns (y, final_state)."""
    check_scan_args(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_limit,
                    max_seqlen=max_seqlen)
    dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit, dtype)
    xc, Bc, Cc, Ac = x.to(dtype), B.to(dtype), C.to(dtype), A.to(dtype)
    s0 = None if initial_state is None else initial_state.to(dtype)
    if cu_seqlens is None:
        y, final = chunk_scan_core(xc, dtp, Ac, Bc, Cc, chunk_size, s0)
    else:
        idx, mask = pack_index(cu_seqlens, x.device, max_seqlen)
        m = mask.to(dtype)
        xs = xc[0][idx] * m[..., None, None]
        dts = dtp[0][idx] * m[..., None]
        Bs = Bc[0][idx] * m[..., None, None]
        Cs = Cc[0][idx] * m[..., None, None]
        ys, final = chunk_scan_core(xs, dts, Ac, Bs, Cs, chunk_size, s0)
        y = ys[mask].unsqueeze(0)  # documents back to back, in order
    y = apply_skip_and_gate(y, x, D, z, dtype).to(x.dtype)
    if not return_final_state:
        return y, None
    return y, final.float() if dtype != torch.float64 else final
