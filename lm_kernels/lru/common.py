"""Argument checks and document bookkeeping shared by every backend of `block_scan`."""
from __future__ import annotations

import torch

from ..varlen import check_cu_seqlens

MAX_BLOCK = 8


def compute_dtype(*tensors) -> torch.dtype:
    """float64 if any input is float64, else float32 (the accumulation dtype)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def check_args(A, x, initial_state, cu_seqlens):
    """Validate shapes; returns (b, t, nb, m, num_seqs)."""
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, time, num_blocks, m), got shape {tuple(x.shape)}")
    b, t, nb, m = x.shape
    if A.dim() != 5 or tuple(A.shape) != (b, t, nb, m, m):
        raise ValueError(f"A must be (batch, time, num_blocks, m, m) = {(b, t, nb, m, m)} to match x, got "
                         f"{tuple(A.shape)} (use .expand() for a time-invariant A; it is not copied)")
    if not 1 <= m <= MAX_BLOCK:
        raise ValueError(f"block size m = {m} is not supported: 1 <= m <= {MAX_BLOCK}")
    if A.device != x.device:
        raise ValueError(f"A is on {A.device} but x is on {x.device}; put both on one device")
    for name, v in (("A", A), ("x", x)):
        if not v.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {v.dtype}")
    num_seqs = b
    if cu_seqlens is not None:  # offsets not read on the host here (no sync in the fixed-point loop)
        num_seqs = check_cu_seqlens(cu_seqlens, b, None, "block_scan")
    if initial_state is not None:
        if tuple(initial_state.shape) != (num_seqs, nb, m):
            what = "num_seqs" if cu_seqlens is not None else "batch"
            raise ValueError(f"initial_state must be ({what}, num_blocks, m) = {(num_seqs, nb, m)}, got "
                             f"{tuple(initial_state.shape)}")
        if initial_state.device != x.device:
            raise ValueError(f"initial_state is on {initial_state.device} but x is on {x.device}")
    return b, t, nb, m, num_seqs


def seq_index(cu_seqlens: torch.Tensor, t: int) -> torch.Tensor:
    """Document index of every packed token, (t,) int64, without a host sync."""
    pos = torch.arange(t, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), pos, right=True)


def start_mask(cu_seqlens: torch.Tensor | None, t: int, device) -> torch.Tensor:
    """(t,) bool: True where a document starts (position 0 always)."""
    if cu_seqlens is None:
        m = torch.zeros(t, dtype=torch.bool, device=device)
        if t:
            m[0] = True
        return m
    idx = seq_index(cu_seqlens, t)
    m = torch.ones(t, dtype=torch.bool, device=device)
    m[1:] = idx[1:] != idx[:-1]
    return m
