"""PyTorch depthwise causal conv1d: the reference every fast path is compared with, and the CPU path.

This is the function `lm.models.layers.causal_conv1d` ran before the Triton kernel existed, moved here
unchanged (lm_kernels/ imports nothing from lm): transpose to (b, c, t), cat the conv state in front,
F.conv1d with groups = c (or, with cu_seqlens, one shifted product per tap with the taps that cross a
document start masked), bias, SiLU, all in x's dtype. An x_add is added to x first (in x's dtype).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import position_in_document


def check_x_add(x: torch.Tensor, x_add: torch.Tensor | None) -> None:
    """x_add (the optional second input) has x's shape and dtype: ValueError otherwise (no broadcasting, no
    promotion: the sum is the conv input, in x's dtype)."""
    if x_add is not None and (x_add.shape != x.shape or x_add.dtype != x.dtype):
        raise ValueError(f"causal_conv1d: x_add must have x's shape {tuple(x.shape)} and dtype {x.dtype}, "
                         f"got {tuple(x_add.shape)} {x_add.dtype}")


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    x_add: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (b, t, c); weight (c, w); conv_state (b, c, w-1); the conv runs on x + x_add. Returns (y (b, t, c),
    new state (b, c, w-1))."""
    if x_add is not None:
        check_x_add(x, x_add)
        x = x + x_add
    b, t, c = x.shape
    w = weight.shape[-1]
    xt = x.transpose(1, 2)  # (b, c, t)
    if conv_state is None:
        conv_state = xt.new_zeros(b, c, w - 1)
    full = torch.cat([conv_state.to(xt.dtype), xt], dim=-1)  # (b, c, w-1+t)
    if cu_seqlens is None:
        y = F.conv1d(full, weight.unsqueeze(1).to(xt.dtype), groups=c)
    else:
        # tap j looks j steps back; mask taps that cross the document start
        pos = position_in_document(t, cu_seqlens, x.device)
        y = 0
        for j in range(w):
            shifted = full[..., w - 1 - j: w - 1 - j + t]
            y = y + shifted * weight[:, w - 1 - j].to(xt.dtype).unsqueeze(-1) * (pos >= j).to(xt.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype).unsqueeze(-1)
    if activation == "silu":
        y = F.silu(y)
    new_state = full[..., -(w - 1):] if w > 1 else full[..., :0]
    return y.transpose(1, 2), new_state
