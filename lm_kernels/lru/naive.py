"""The sequential definition of the block-diagonal scan: one python step per token (tests only)."""
from __future__ import annotations

import torch

from .common import check_args, compute_dtype


def block_scan_step(state: torch.Tensor, A: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One token of h_t = A_t h_{t-1} + x_t per block.

    state (b, nb, m), A (b, nb, m, m), x (b, nb, m) -> new state (b, nb, m) in float32 (float64 when an
    input is float64); cast it to x.dtype for the token's output.
    """
    if state.dim() != 3 or tuple(A.shape) != (*state.shape, state.shape[-1]) or x.shape != state.shape:
        raise ValueError(f"block_scan_step expects state (b, nb, m), A (b, nb, m, m), x (b, nb, m); got "
                         f"{tuple(state.shape)}, {tuple(A.shape)}, {tuple(x.shape)}")
    cd = compute_dtype(state, A, x)
    with torch.autocast(state.device.type, enabled=False):  # float32/float64 also under autocast
        return torch.einsum("bnij,bnj->bni", A.to(cd), state.to(cd)) + x.to(cd)


def block_scan_naive(A, x, *, initial_state=None, cu_seqlens=None, chunk_size=None,
                     return_final_state=False):
    """Sequential loop over tokens (and documents); same contract as `block_scan`."""
    b, t, nb, m, num_seqs = check_args(A, x, initial_state, cu_seqlens)
    cd = compute_dtype(A, x, initial_state)
    if cu_seqlens is None:
        bounds = [(0, t)]
        batch_rows = [slice(None)]
    else:
        cu = [int(v) for v in cu_seqlens.tolist()]
        bounds = list(zip(cu[:-1], cu[1:]))
        batch_rows = [slice(0, 1)] * num_seqs
    hs = []
    finals = []
    for k, ((s, e), rows) in enumerate(zip(bounds, batch_rows)):
        if initial_state is None:
            h = torch.zeros(b if cu_seqlens is None else 1, nb, m, dtype=cd, device=x.device)
        elif cu_seqlens is None:
            h = initial_state.to(cd)
        else:
            h = initial_state[k:k + 1].to(cd)
        for i in range(s, e):
            h = block_scan_step(h, A[rows, i], x[rows, i])
            hs.append(h)
        finals.append(h)
    out = torch.stack(hs, dim=1).to(x.dtype) if hs else x.new_zeros(x.shape)
    final = torch.cat(finals, 0) if return_final_state else None
    return out, final
