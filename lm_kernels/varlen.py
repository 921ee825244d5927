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
        _check_values(cu_seqlens.detach().cpu().tolist(), seq_len, op)
    return cu_seqlens.numel() - 1


def _check_values(cs: list[int], seq_len: int, op: str) -> None:
    """The offsets `cs` run non-decreasing from 0 to seq_len; the error names the first offset that does not (and
    shows the ends of a long list, not all of it)."""
    if cs[0] != 0:
        bad = f"cu_seqlens[0] = {cs[0]}"
    elif cs[-1] != seq_len:
        bad = f"cu_seqlens[-1] = {cs[-1]}"
    else:
        i = next((i for i in range(1, len(cs)) if cs[i] < cs[i - 1]), None)
        if i is None:
            return
        bad = f"cu_seqlens[{i}] = {cs[i]} < cu_seqlens[{i - 1}] = {cs[i - 1]}"
    shown = str(cs) if len(cs) <= 12 else f"[{', '.join(map(str, cs[:6]))}, ..., {', '.join(map(str, cs[-6:]))}]"
    raise ValueError(f"{op}: cu_seqlens must be non-decreasing from 0 to seq_len ({seq_len}), got {shown} "
                     f"({len(cs)} offsets): {bad}")


def check_max_seqlen(max_seqlen, op: str) -> None:
    """`max_seqlen` (given with packed offsets) is a non-negative int (torch.compile traces a symbolic one as an int:
    the check guards on its sign, which does not specialise it)."""
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"{op}: max_seqlen must be a non-negative int (the longest document's length), "
                         f"got {max_seqlen!r}")


def cpu_offsets(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None, op: str) -> torch.Tensor:
    """The packed offsets on the CPU, for ops that need their values on the host: `cu_seqlens_cpu`, a CPU copy of
    cu_seqlens the caller holds (the data loader's, from before the copy to the device: reading it does not wait for
    the device), else cu_seqlens copied back (a wait for the device where it is on one). The caller vouches that the
    copy holds cu_seqlens's values; its device, dtype and shape are checked."""
    if cu_seqlens_cpu is None:
        return cu_seqlens.detach().cpu()
    if (not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu"
            or cu_seqlens_cpu.dtype not in (torch.int32, torch.int64) or cu_seqlens_cpu.shape != cu_seqlens.shape):
        what = (f"{cu_seqlens_cpu.device.type} {cu_seqlens_cpu.dtype} {tuple(cu_seqlens_cpu.shape)}"
                if isinstance(cu_seqlens_cpu, torch.Tensor) else type(cu_seqlens_cpu).__name__)
        raise ValueError(f"{op}: cu_seqlens_cpu must be a CPU int32/int64 tensor of cu_seqlens's shape "
                         f"{tuple(cu_seqlens.shape)} (the same offsets on the host), got {what}")
    return cu_seqlens_cpu


def offset_values(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None, seq_len: int, op: str) -> list[int]:
    """The offsets as a list of ints, read from `cu_seqlens_cpu` where given (see cpu_offsets) and checked to run
    non-decreasing from 0 to seq_len."""
    values = cpu_offsets(cu_seqlens, cu_seqlens_cpu, op).tolist()
    _check_values(values, seq_len, op)
    return values


def packed_offsets(cu_seqlens: torch.Tensor, batch: int, seq_len: int, op: str, max_seqlen: int | None = None,
                   cu_seqlens_cpu: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None]:
    """Check packed offsets as `check_cu_seqlens(..., seq_len, op)` does; returns the longest document's length
    (the model's varlen attention pads the documents to it) and the offsets on the CPU where they are at hand (ops
    that need their values on the host, DeltaProduct's chunk tables, read them there), else None.

    `max_seqlen` given (an int >= the longest document) says that the caller has checked the offsets' values on the
    host (`lm.train.data.to_model_inputs` does, before copying them to the device): they are not read again, so this
    never waits for the device; their shape and dtype are still checked. Without it they are read and checked here:
    from `cu_seqlens_cpu` where given (see cpu_offsets) and free for CPU offsets, else a copy to the host that waits
    for the device."""
    check_cu_seqlens(cu_seqlens, batch, None, op)
    if cu_seqlens_cpu is not None:
        cpu_offsets(cu_seqlens, cu_seqlens_cpu, op)  # (its device, dtype and shape)
    elif cu_seqlens.device.type == "cpu":
        cu_seqlens_cpu = cu_seqlens.detach()
    if max_seqlen is not None:
        check_max_seqlen(max_seqlen, op)
        return max_seqlen, cu_seqlens_cpu
    cu_seqlens_cpu = cpu_offsets(cu_seqlens, cu_seqlens_cpu, op)
    values = offset_values(cu_seqlens, cu_seqlens_cpu, seq_len, op)
    return max(b - a for a, b in zip(values, values[1:])), cu_seqlens_cpu


def document_and_position(total: int, cu_seqlens: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the document holding every token, index of every token inside its document), each (total,) int64."""
    pos = torch.arange(total, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    doc = torch.searchsorted(cu[1:], pos, right=True)
    return doc, pos - cu[doc]


def position_in_document(total: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Index of every token inside its document, (total,) int64; plain arange without cu_seqlens."""
    if cu_seqlens is None:
        return torch.arange(total, device=device)
    return document_and_position(total, cu_seqlens, device)[1]
