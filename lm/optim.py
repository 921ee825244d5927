"""Optimizer pieces shared by the pretraining trainer (lm.train) and the synthetic-task runner."""
from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices, none on norms, biases and parameters marked
    `_no_weight_decay` (A_log, dt_bias, D, LRU eigenvalue parameters, ...)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or getattr(p, "_no_weight_decay", False):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
