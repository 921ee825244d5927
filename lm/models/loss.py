"""Cross-entropy of the LM head without the (tokens x vocab) logits in memory.

    loss = linear_cross_entropy(h, weight, targets)      # == F.cross_entropy((h @ weight.T).float(), targets)

The tokens go through the head in chunks: the forward keeps only each token's log-sum-exp (fp32), and
the backward recomputes one chunk's logits at a time to form softmax - onehot. For a 350M model with a
50k vocabulary at micro-batch 8 x 2048 the unfused path holds bf16 logits, their fp32 copy and the fp32
gradient (~8 GB); this holds one chunk of them (~0.4 GB at 8192 tokens) and recomputes the head's matmul
once more in the backward (+1/3 of the head's FLOPs). The logits are rounded to the head's dtype before
the softmax, as the unfused path's `lm_head(h).float()` does, so both give the same numbers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _chunks(n: int, size: int):
    for s in range(0, n, size):
        yield s, min(n, s + size)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_tokens: int, ignore_index: int):
        acc = torch.promote_types(h.dtype, torch.float32)  # fp32 softmax math (fp64 for fp64 inputs)
        valid = targets != ignore_index
        n_valid = valid.sum()
        lse = torch.empty(h.shape[0], dtype=acc, device=h.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        safe_t = torch.where(valid, targets, 0)
        for s, e in _chunks(h.shape[0], chunk_tokens):
            logits = (h[s:e] @ weight.t()).to(acc)
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            tgt = logits.gather(1, safe_t[s:e, None])[:, 0]
            total += torch.where(valid[s:e], lse[s:e] - tgt, 0.0).sum()
        ctx.save_for_backward(h, weight, safe_t, valid, lse, n_valid)
        ctx.chunk_tokens = chunk_tokens
        return total / n_valid.clamp_min(1)  # an all-ignored batch gives 0 (F.cross_entropy gives nan)

    @staticmethod
    def backward(ctx, grad):
        h, weight, safe_t, valid, lse, n_valid = ctx.saved_tensors
        acc = lse.dtype
        scale = grad.to(acc) / n_valid.clamp_min(1)
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        for s, e in _chunks(h.shape[0], ctx.chunk_tokens):
            logits = (h[s:e] @ weight.t()).to(acc)
            p = torch.exp(logits - lse[s:e, None])
            p.scatter_add_(1, safe_t[s:e, None], torch.full((e - s, 1), -1.0, dtype=acc, device=p.device))
            p = (p * torch.where(valid[s:e], scale, 0.0)[:, None]).to(h.dtype)
            if dh is not None:
                dh[s:e] = p @ weight
            if dw is not None:
                dw += (p.t() @ h[s:e]).to(acc)
        return dh, (dw.to(weight.dtype) if dw is not None else None), None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_tokens: int = 8192, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of `h @ weight.T` (h (..., d), weight (V, d)) against `targets` (...), ignoring
    `ignore_index`, computed chunk by chunk (see the module docstring)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    d = h.shape[-1]
    if weight.shape[-1] != d:
        raise ValueError(f"weight has {weight.shape[-1]} input features, h has {d}")
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        # the head runs in the autocast dtype, as nn.Linear would; the function itself runs with autocast
        # off so that its backward recomputes the logits in the same dtype as its forward
        dt = torch.get_autocast_dtype(dev)
        h, weight = h.to(dt), weight.to(dt)
    elif h.dtype != weight.dtype:
        raise ValueError(f"h is {h.dtype} and weight {weight.dtype}: cast one, or run under torch.autocast")
    with torch.autocast(dev, enabled=False):
        return _LinearCrossEntropy.apply(h.reshape(-1, d), weight, targets.reshape(-1), chunk_tokens, ignore_index)


def logits_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of logits (..., V) against targets (...): fp32 softmax math for bf16/fp16
    logits, fp64 stays fp64."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)


def reference_cross_entropy(h, weight, targets, ignore_index: int = -100):
    """The unfused path: what `linear_cross_entropy` must equal."""
    return logits_cross_entropy(F.linear(h, weight), targets, ignore_index)
