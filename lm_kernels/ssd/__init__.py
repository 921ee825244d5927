"""SSD (Mamba2 state-space duality) chunked scan: public API and backend dispatch.

    y, final_state = ssd_scan(x, dt, A, B, C, *, chunk_size=256, D=None, z=None, dt_bias=None,
                              dt_softplus=True, dt_limit=(0.0, inf), initial_state=None,
                              cu_seqlens=None, return_final_state=False, backend=None, max_seqlen=None)
    y, final_state = ssd_scan_xbc(xbc, dt, A, *, headdim, ngroups, dstate, ...same keywords...)
                                                     # x, B, C as one (b, t, h*headdim + 2*ngroups*dstate) tensor
    y, final_state = ssd_scan_naive(...same...)      # per-timestep recurrence (tests)
    y, new_state   = ssd_step(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None,
                              dt_softplus=True, dt_limit=(0.0, inf), out_state=None,
                              backend=None)                           # one decode token
    y, new_state   = ssd_step_reference(...same, no backend...)       # its PyTorch form (naive.py)

Recurrence: dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit); h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T;
y_t = h_t C_t + D x_t; then y_t *= silu(z_t). Shapes: x (b,t,h,p), dt (b,t,h), A (h,), B/C (b,t,g,n),
D (h,) or (h,p), z like x, dt_bias (h,), initial_state (b|num_seqs, h, p, n); cu_seqlens (num_seqs+1,)
with b == 1 for packed documents (the state restarts at each document). The offsets are checked on the host (a
wait for the device where they are on one) unless `max_seqlen` is given: the longest document's length (or more) as
a host int, from a caller that has checked them (lm_kernels.varlen.packed_offsets; the models, once per forward);
the reference then pads the documents to it. ssd_step: state (b,h,p,n), x (b,h,p),
dt (b,h), B/C (b,g,n); new_state is float32 (float64 on the reference for float64 inputs); `state` is not modified
unless it is passed as `out_state`, the float32 tensor the new state is written into (a static decode cache's
buffer: the update in place saves the copy that would follow).

Backends (lm_kernels.backend.resolve_backend): "reference" (PyTorch chunked, autograd), "triton" (Triton
kernels with their own backward, the custom operators lm::ssd_scan_fwd / _bwd, triton_ssd.py; the decode step
is one kernel, step.py; on CPU they run under TRITON_INTERPRET=1), None = auto: Triton when x is on CUDA and
triton imports (the step: no float64 input, no grad), else the reference. LM_SSD_BACKEND=reference|triton
overrides auto.
"""
from __future__ import annotations

import torch

from ..backend import resolve_backend
from .common import check_step_args, split_xbc
from .naive import ssd_scan_naive, ssd_step_reference
from .reference import ssd_scan_reference

__all__ = ["ssd_scan", "ssd_scan_xbc", "ssd_scan_naive", "ssd_step", "ssd_step_reference", "ssd_scan_reference"]


# The PyTorch reference stays one opaque call under torch.compile (the CPU path, tests): traced, inductor compiles its
# chunked products into every block (the CPU compile tests took 2-10x longer) and its packed path reads the document
# lengths on the host without max_seqlen, a graph break anyway.
_reference_opaque = torch.compiler.disable(ssd_scan_reference)


def ssd_scan(x, dt, A, B, C, *, chunk_size=256, D=None, z=None, dt_bias=None, dt_softplus=True,
             dt_limit=(0.0, float("inf")), initial_state=None, cu_seqlens=None, return_final_state=False,
             backend=None, max_seqlen=None):
    """Chunked SSD scan; returns (y in x's dtype, final_state float32 or None). See module docstring.

    torch.compile traces through it: the Triton path is the custom operators lm::ssd_scan_fwd / _bwd (one node
    each in the graph, triton_ssd.py); the reference path is one opaque call (_reference_opaque)."""
    kwargs = dict(chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                  initial_state=initial_state, cu_seqlens=cu_seqlens, return_final_state=return_final_state,
                  max_seqlen=max_seqlen)
    if resolve_backend("ssd", backend, x.device) == "triton":
        from .triton_ssd import ssd_scan_triton  # noqa: PLC0415 (lazy: triton is optional)
        return ssd_scan_triton(x, dt, A, B, C, **kwargs)
    return _reference_opaque(x, dt, A, B, C, **kwargs)


def ssd_scan_xbc(xbc, dt, A, *, headdim, ngroups, dstate, chunk_size=256, D=None, z=None, dt_bias=None,
                 dt_softplus=True, dt_limit=(0.0, float("inf")), initial_state=None, cu_seqlens=None,
                 return_final_state=False, backend=None, max_seqlen=None):
    """ssd_scan with x, B and C as the columns of one (b, t, h*headdim + 2*ngroups*dstate) tensor, x | B | C (Mamba2's
    conv output); h is dt's last dim. On the Triton backend the backward writes the three gradients into one tensor
    of xbc's shape: separate ones would be concatenated by autograd (a pass over the conv's gradient per layer)."""
    kwargs = dict(chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                  initial_state=initial_state, cu_seqlens=cu_seqlens, return_final_state=return_final_state,
                  max_seqlen=max_seqlen)
    if resolve_backend("ssd", backend, xbc.device) == "triton":
        from .triton_ssd import ssd_scan_triton  # noqa: PLC0415 (lazy: triton is optional)
        return ssd_scan_triton(xbc, dt, A, None, None, xbc_dims=(headdim, ngroups, dstate), **kwargs)
    x, B, C = split_xbc(xbc, dt.shape[-1], headdim, ngroups, dstate)
    return _reference_opaque(x, dt, A, B, C, **kwargs)


@torch.compiler.disable  # torch.compile: one opaque call (one Triton launch)
def _step_triton(state, x, dt, A, B, C, **kwargs):
    from .step import ssd_step_triton  # noqa: PLC0415 (lazy: triton is optional)
    return ssd_step_triton(state, x, dt, A, B, C, **kwargs)


def ssd_step(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=True,
             dt_limit=(0.0, float("inf")), out_state=None, backend=None, a_log=False):
    """One token of the recurrence (generation); returns (y (b,h,p) in x's dtype, new_state). See module
    docstring. On CUDA one Triton kernel (step.py), else (and for autograd) the PyTorch reference
    (naive.ssd_step_reference). a_log=True: `A` is the log parameter A_log and A = -exp(A_log) (inside the
    kernel: a decode step launches no kernels of its own for it)."""
    kwargs = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit, out_state=out_state)
    ts = [t for t in (state, x, dt, A, B, C, D, z, dt_bias) if t is not None]
    f64 = any(t.dtype == torch.float64 for t in ts)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in ts)  # the kernel has no backward
    if resolve_backend("ssd", backend, x.device, fits=not (f64 or grad)) == "triton":
        if f64 or grad:
            raise ValueError("ssd_step: the triton backend takes no float64 inputs and has no backward; use "
                             "backend='reference'")
        check_step_args(state, x, dt, A, B, C, D, z, dt_bias)
        if out_state is not None and (out_state.shape != state.shape or out_state.dtype != torch.float32):
            raise ValueError(f"ssd_step: out_state must be float32 of the state's shape {tuple(state.shape)}, got "
                             f"{out_state.dtype} {tuple(out_state.shape)}")
        return _step_triton(state, x, dt, A, B, C, a_log=a_log, **kwargs)
    if a_log:
        A = -torch.exp(A.float())
    return ssd_step_reference(state, x, dt, A, B, C, **kwargs)
