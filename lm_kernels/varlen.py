"""Packed-sequence offsets, shared by every op (SSD, DeltaProduct, LRU scans, conv1d) and the models:
validation, and each token's position inside its document."""
from __future__ import annotations

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int | None, op: str) -> int:
    """Check `cu_seqlens` (packed documents, batch 1) and return the number of sequences.

    With `seq_len` the offsets are also checked to run non-decreasing from 0 to seq_len (this reads
    them on the host); `seq_len=None` skips that check.
    """
    if batch != 1:
        raise ValueError(f"{op}: cu_seqlens needs packed inputs with batch size 1, got batch {batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: cu_seqlens must be a 1-D int32/int64 tensor (num_seqs + 1,) of offsets "
                         f"[0, ..., seq_len], got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    if seq_len is not None:
        _check_values(cu_seqlens.detach().cpu(), seq_len, op)
    return cu_seqlens.numel() - 1


def _check_values(cs: torch.Tensor, seq_len: int, op: str) -> None:
    """The offsets `cs` (a CPU tensor) run non-decreasing from 0 to seq_len."""
    if int(cs[0]) != 0 or int(cs[-1]) != seq_len or bool((cs[1:] < cs[:-1]).any()):
        raise ValueError(f"{op}: cu_seqlens must be non-decreasing from 0 to seq_len ({seq_len}), "
                         f"got {cs.tolist()}")


def packed_max_seqlen(cu_seqlens: torch.Tensor, batch: int, seq_len: int, op: str,
                      max_seqlen: int | None = None) -> int:
    """Check packed offsets as `check_cu_seqlens(..., seq_len, op)` does and return the longest document's length
    (the model's varlen attention pads the documents to it).

    `max_seqlen` given (an int >= the longest document) says that the caller has checked the offsets' values on the
    host (`lm.train.data.to_model_inputs` does, before copying them to the device): they are not read again, so the
    forward never waits for the device here; their shape and dtype are still checked. Without it they are read and
    checked here: free for a CPU tensor, a copy to the host that waits for the device otherwise."""
    check_cu_seqlens(cu_seqlens, batch, None, op)
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
            raise ValueError(f"{op}: max_seqlen must be a non-negative int (the longest document's length), "
                             f"got {max_seqlen!r}")
        return max_seqlen
    cs = cu_seqlens.detach().cpu()
    _check_values(cs, seq_len, op)
    return int((cs[1:] - cs[:-1]).max())


def position_in_document(total: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Index of every token inside its document, (total,) int64; plain arange without cu_seqlens."""
    pos = torch.arange(total, device=device)
    if cu_seqlens is None:
        return pos
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    doc = torch.searchsorted(cu[1:], pos, right=True)
    return pos - cu[doc]
