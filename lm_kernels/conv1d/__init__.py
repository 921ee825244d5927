"""Depthwise causal conv1d (Mamba2 / FP-Mamba / DeltaProduct short conv): public API and backend dispatch.

    y, new_state = causal_conv1d(x, weight, bias=None, *, x_add=None, cu_seqlens=None, conv_state=None,
                                 activation="silu", backend=None)
    y, new_state = causal_conv1d_reference(...same, no backend...)   # PyTorch (F.conv1d), the CPU path
    y, new_state = causal_conv1d_naive(...same, no backend...)       # float64 loop (tests)

x (b, t, c) in any float dtype, read through its strides (a split view of a projection is fine as long as
channels are contiguous); x_add (b, t, c) in x's dtype, optional: the conv runs on x + x_add (the sum
in x's dtype, as PyTorch adds; the Triton path adds on load without writing the sum, and hands x's gradient
to x_add too); weight (c, w); bias (c,); conv_state (b, c, w-1): the last w-1 inputs before x
(zeros if None); cu_seqlens (num_seqs+1,) offsets of packed documents (b == 1): tap j is masked where the
position inside the document is < j; activation "silu" or None. Returns y (b, t, c) contiguous in x's
dtype and the new conv state (b, c, w-1) in x's dtype (the last w-1 inputs). Weight, bias and state are
rounded to x's dtype, as the reference does; the Triton path accumulates in float32.

Backends (lm_kernels.backend.resolve_backend): "reference" (PyTorch, autograd), "triton" (Triton kernels
with their own backward, the custom operators lm::causal_conv1d_fwd / _bwd: gradients of x, x_add, weight, bias
and conv_state; the one-pass backward recomputes the pre-activation), None = auto: Triton when x is on CUDA, triton
imports, the width is at most 8 and t > 0, else the reference. LM_CONV1D_BACKEND=reference|triton overrides auto.
"""
from __future__ import annotations

from ..backend import resolve_backend
from .naive import causal_conv1d_naive
from .reference import causal_conv1d_reference

__all__ = ["causal_conv1d", "causal_conv1d_reference", "causal_conv1d_naive"]

MAX_TRITON_WIDTH = 8


def _run_triton(x, weight, bias, x_add, cu_seqlens, conv_state, activation):
    from .triton_conv1d import causal_conv1d_triton  # noqa: PLC0415 (lazy: triton is optional)
    return causal_conv1d_triton(x, weight, bias, x_add=x_add, cu_seqlens=cu_seqlens, conv_state=conv_state,
                                activation=activation)


def causal_conv1d(x, weight, bias=None, *, x_add=None, cu_seqlens=None, conv_state=None, activation="silu",
                  backend=None):
    """Depthwise causal conv1d; returns (y (b, t, c), new conv state (b, c, w-1)). See module docstring.

    torch.compile traces through it: the Triton path is the custom operators lm::causal_conv1d_fwd / _bwd (one node
    each in the graph, triton_conv1d.py), the reference path PyTorch ops."""
    which = resolve_backend("conv1d", backend, x.device, fits=weight.shape[-1] <= MAX_TRITON_WIDTH and x.shape[1] > 0)
    if which == "triton" and x.shape[1] > 0:
        return _run_triton(x, weight, bias, x_add, cu_seqlens, conv_state, activation)
    return causal_conv1d_reference(x, weight, bias, x_add=x_add, cu_seqlens=cu_seqlens, conv_state=conv_state,
                                   activation=activation)
