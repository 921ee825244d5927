"""Small pure helpers that turn LRU-family parameters into scan transition blocks.

These are the pieces the mixers need to feed `block_scan`; they hold no state and are differentiable.
"""
from __future__ import annotations

import torch


def lru_lambda_blocks(nu_log: torch.Tensor, theta_log: torch.Tensor) -> torch.Tensor:
    """2x2 real blocks of the complex-diagonal LRU transition (paper 004, minimal-LRU parameterisation).

    lambda = exp(-exp(nu_log) + i * exp(theta_log)) = r (cos th + i sin th), r = exp(-exp(nu_log)),
    th = exp(theta_log). Multiplying a complex state h = (Re, Im) by lambda is the real rotation-scaling
    block [[r cos th, -r sin th], [r sin th, r cos th]] acting on the pair (Re, Im).

    nu_log, theta_log: (nb,) -> (nb, 2, 2). Pass the result through `.expand(b, t, nb, 2, 2)` to get a
    stride-0 time-invariant A for `block_scan`.
    """
    if nu_log.shape != theta_log.shape:
        raise ValueError(f"nu_log {tuple(nu_log.shape)} and theta_log {tuple(theta_log.shape)} must have "
                         "the same shape (one entry per complex state)")
    r = torch.exp(-torch.exp(nu_log))
    th = torch.exp(theta_log)
    c, s = r * torch.cos(th), r * torch.sin(th)
    row0 = torch.stack([c, -s], dim=-1)
    row1 = torch.stack([s, c], dim=-1)
    return torch.stack([row0, row1], dim=-2)


def companion(a: torch.Tensor) -> torch.Tensor:
    """H-LRU companion matrices (paper 002, Eq. 3) from first-row coefficients.

    a: (..., m) holding (a_1, ..., a_m) -> (..., m, m) with first row a, ones on the sub-diagonal and
    zeros elsewhere, so that with the state H_t = [h_t, h_{t-1}, ..., h_{t-m+1}] and input
    [a_0 v_t, 0, ..., 0] the scan computes h_t = sum_i a_i h_{t-i} + a_0 v_t. (Not the transposed
    "observer" form of the paper's appendix snippet, which computes a different recurrence.)
    """
    if a.dim() < 1 or a.shape[-1] < 1:
        raise ValueError(f"companion expects coefficients of shape (..., m) with m >= 1, got {tuple(a.shape)}")
    m = a.shape[-1]
    shift = torch.diag(torch.ones(m - 1, dtype=a.dtype, device=a.device), -1)
    # (m, 1), one in row 0, made on the device (an indexed write of a Python number is a host copy, which a CUDA graph
    # capture of the implicit solve refuses)
    first = torch.eye(m, 1, dtype=a.dtype, device=a.device)
    # first row from a (differentiable), sub-diagonal ones as a constant
    return shift + a.unsqueeze(-2) * first  # (..., 1, m) * (m, 1): only row 0 nonzero


__all__ = ["lru_lambda_blocks", "companion"]
