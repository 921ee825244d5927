"""Cross-entropy over rows of logits, with the gradient written in place (for the chunked LM-head loss).

    lse, loss = ce_rows_(logits, targets, scale, ignore_index=-100, write_grad=True)
    lse, loss = ce_rows_reference_(...same...)

logits (n, V) bf16/fp16/fp32, rows contiguous (any row stride); targets (n,) int64, any stride. Per row:
lse = logsumexp(logits) and loss = lse - logits[target] (0 where target == ignore_index), both fp32 (n,). With
write_grad the logits are overwritten by scale * (softmax(logits) - onehot(target)) in their own dtype (0 on
ignored rows): the gradient of scale * sum(loss) with respect to the logits. The softmax math is fp32.

`ce_rows_` is the Triton kernel (one program per row, two passes over it: an online max / sum, then the
gradient), used on CUDA; on CPU it runs under TRITON_INTERPRET=1 (tests). `ce_rows_reference_` is the
PyTorch version, used on CPU.
"""
from __future__ import annotations

import torch

__all__ = ["ce_rows_", "ce_rows_reference_"]


def ce_rows_reference_(logits: torch.Tensor, targets: torch.Tensor, scale, ignore_index: int = -100,
                       write_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    acc = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(acc)
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, 0)
    lse = torch.logsumexp(x, dim=-1)
    loss = torch.where(valid, lse - x.gather(1, safe_t[:, None])[:, 0], 0.0)
    if write_grad:
        p = torch.exp(x - lse[:, None])
        p.scatter_add_(1, safe_t[:, None], torch.full_like(p[:, :1], -1.0))
        s = torch.as_tensor(scale, dtype=acc, device=logits.device)
        logits.copy_(p * torch.where(valid, s, torch.zeros_like(s))[:, None])
    return lse, loss


def ce_rows_(logits: torch.Tensor, targets: torch.Tensor, scale, ignore_index: int = -100,
             write_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_ce import ce_rows_triton_  # noqa: PLC0415 (lazy: triton is optional)

    return ce_rows_triton_(logits, targets, scale, ignore_index, write_grad)
