"""AdamW for every trainer: weight decay on matrices only; none on norms, biases and parameters marked
`p._no_weight_decay = True` (A_log, dt_bias, D, LRU eigenvalue parameters, ...)."""
from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices, none on norms, biases and parameters marked `_no_weight_decay`."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or getattr(p, "_no_weight_decay", False):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model, *, lr, betas, eps, weight_decay, device) -> torch.optim.Optimizer:
    """AdamW over param_groups (the fused CUDA kernel on GPU)."""
    kw = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps, **kw)
