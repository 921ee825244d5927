"""Depthwise causal conv1d one token and one tap at a time (slow; tests only): the reference of the reference.

Every output is summed in float64 (or in the inputs' dtype if wider) straight from the definition:
    y[b, s, c] = act(bias[c] + sum_{j < w, pos_in_doc(s) >= j} weight[c, w-1-j] * in[b, s-j, c])
with weight and bias rounded to x's dtype first (as the reference does), and
where in[b, s] = x[b, s] (+ x_add[b, s], added in x's dtype) for s >= 0 and conv_state[b, :, w-1+s] for s < 0
(zeros without a state).
"""
from __future__ import annotations

import torch

from .reference import check_x_add


def causal_conv1d_naive(x, weight, bias=None, *, x_add=None, cu_seqlens=None, conv_state=None, activation="silu"):
    """Same signature and returns as causal_conv1d_reference; differentiable (autograd through the loop)."""
    if x_add is not None:
        check_x_add(x, x_add)
        x = x + x_add
    b, t, c = x.shape
    w = weight.shape[-1]
    dt = torch.promote_types(x.dtype, torch.float64)
    xs = x.to(dt)
    st = (conv_state.to(x.dtype).to(dt) if conv_state is not None else xs.new_zeros(b, c, w - 1))
    starts = [0] if cu_seqlens is None else [int(v) for v in cu_seqlens.tolist()[:-1]]
    ys = []
    for s in range(t):
        doc_start = max(v for v in starts if v <= s) if cu_seqlens is not None else None
        acc = xs.new_zeros(b, c)
        for j in range(w):
            if doc_start is not None and s - doc_start < j:
                continue
            src = xs[:, s - j] if s - j >= 0 else st[:, :, w - 1 + (s - j)]
            acc = acc + weight[:, w - 1 - j].to(x.dtype).to(dt) * src
        if bias is not None:
            acc = acc + bias.to(x.dtype).to(dt)
        ys.append(acc)
    y = torch.stack(ys, dim=1) if ys else xs.new_zeros(b, 0, c)
    if activation == "silu":
        y = torch.nn.functional.silu(y)
    full = torch.cat([st, xs.transpose(1, 2)], dim=-1)
    new_state = full[..., full.shape[-1] - (w - 1):]
    return y.to(x.dtype), new_state.to(x.dtype)
