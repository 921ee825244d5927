"""Chunked block-diagonal scan in PyTorch: the reference beside the Triton kernel.

Within a chunk of L tokens, a Hillis-Steele associative scan (log2 L levels, all chunks at once) on
pairs (C, y) with combine (C1, y1), (C2, y2) -> (C2 C1, C2 y1 + y2) gives the cumulative transition
C_t = A_t ... A_start and the zero-start state y_t. Between chunks a loop passes the state:
h_t = y_t + C_t s_chunk. Differentiable by autograd; accumulates in float32 (float64 for float64).

Document starts (cu_seqlens, or position 0 with an initial state) are folded in before the scan:
x_s <- x_s + A_s h0_doc and A_s <- 0, so the scan itself never sees a reset.

Memory: C is materialised as (b, t, nb, m, m) in the accumulation dtype, also for a stride-0 A.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import check_args, compute_dtype, seq_index, start_mask


def _fold_starts(A, x, initial_state, cu_seqlens):
    """Zero A at document starts and add A_s h0 to x_s there (A, x already in the compute dtype)."""
    b, t = x.shape[:2]
    start = start_mask(cu_seqlens, t, x.device)  # (t,)
    keep = (~start).to(A.dtype).view(1, t, 1, 1, 1)
    if initial_state is not None:
        h0 = initial_state.to(A.dtype)
        if cu_seqlens is None:
            add = torch.einsum("bnij,bnj->bni", A[:, 0], h0).unsqueeze(1)  # applied at t = 0 only
            x = torch.cat([x[:, :1] + add, x[:, 1:]], dim=1)
        else:
            idx = seq_index(cu_seqlens, t)
            h0_tok = h0[idx].unsqueeze(0)  # (1, t, nb, m)
            add = torch.einsum("btnij,btnj->btni", A, h0_tok)
            x = x + add * start.to(A.dtype).view(1, t, 1, 1)
    return A * keep, x


def block_scan_reference(A, x, *, initial_state=None, cu_seqlens=None, chunk_size=64,
                         return_final_state=False):
    check_args(A, x, initial_state, cu_seqlens)
    with torch.autocast(x.device.type, enabled=False):  # keep the float32/float64 accumulation under autocast
        return _scan(A, x, initial_state, cu_seqlens, chunk_size, return_final_state)


def _scan(A, x, initial_state, cu_seqlens, chunk_size, return_final_state):
    b, t, nb, m, num_seqs = check_args(A, x, initial_state, cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    cd = compute_dtype(A, x, initial_state)
    if t == 0:
        final = None
        if return_final_state:
            final = (initial_state.to(cd) if initial_state is not None
                     else torch.zeros(num_seqs, nb, m, dtype=cd, device=x.device))
        return x.new_zeros(x.shape), final
    Ac, xc = _fold_starts(A.to(cd), x.to(cd), initial_state, cu_seqlens)
    L = min(chunk_size, t)
    nc = -(-t // L)
    pad = nc * L - t
    if pad:
        Ac = F.pad(Ac, (0, 0, 0, 0, 0, 0, 0, pad))
        xc = F.pad(xc, (0, 0, 0, 0, 0, pad))
    C = Ac.reshape(b, nc, L, nb, m, m)
    y = xc.reshape(b, nc, L, nb, m)
    d = 1
    while d < L:  # log-depth scan inside every chunk at once
        C_prev, y_prev = C[:, :, :-d], y[:, :, :-d]
        C_cur, y_cur = C[:, :, d:], y[:, :, d:]
        y = torch.cat([y[:, :, :d], y_cur + torch.einsum("bclnij,bclnj->bclni", C_cur, y_prev)], dim=2)
        C = torch.cat([C[:, :, :d], C_cur @ C_prev], dim=2)
        d *= 2
    s = torch.zeros(b, nb, m, dtype=cd, device=x.device)
    outs = []
    for c in range(nc):  # state passing between chunks
        h_c = y[:, c] + torch.einsum("blnij,bnj->blni", C[:, c], s)
        outs.append(h_c)
        s = h_c[:, -1]
    h = torch.stack(outs, dim=1).reshape(b, nc * L, nb, m)[:, :t]
    final = None
    if return_final_state:
        if cu_seqlens is None:
            final = h[:, -1]
        else:
            cu = cu_seqlens.to(torch.int64)
            ends = (cu[1:] - 1).clamp(min=0)
            final = h[0, ends]  # (num_seqs, nb, m)
            empty = (cu[1:] == cu[:-1]).view(-1, 1, 1)
            h0 = (initial_state.to(cd) if initial_state is not None else torch.zeros_like(final))
            final = torch.where(empty, h0, final)
    return h.to(x.dtype), final
