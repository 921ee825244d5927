"""SSD (Mamba2 state-space duality) chunked scan: public API and backend dispatch.

    y, final_state = ssd_scan(x, dt, A, B, C, *, chunk_size=256, D=None, z=None, dt_bias=None,
                              dt_softplus=True, dt_limit=(0.0, inf), initial_state=None,
                              cu_seqlens=None, return_final_state=False, backend=None)
    y, final_state = ssd_scan_naive(...same...)      # per-timestep recurrence (tests)
    y, new_state   = ssd_step(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None,
                              dt_softplus=True, dt_limit=(0.0, inf))   # one decode token

Recurrence: dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit); h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T;
y_t = h_t C_t + D x_t; then y_t *= silu(z_t). Shapes: x (b,t,h,p), dt (b,t,h), A (h,), B/C (b,t,g,n),
D (h,) or (h,p), z like x, dt_bias (h,), initial_state (b|num_seqs, h, p, n); cu_seqlens (num_seqs+1,)
with b == 1 for packed documents (the state restarts at each document).

Backends (lm_kernels.backend.resolve_backend): "reference" (PyTorch chunked, autograd), "triton" (Triton
kernels with their own backward, triton_ssd.py; on CPU they run under TRITON_INTERPRET=1), None = auto: Triton
when x is on CUDA and triton imports, else the reference. LM_SSD_BACKEND=reference|triton overrides auto.
"""
from __future__ import annotations

import torch

from ..backend import resolve_backend
from .naive import ssd_scan_naive, ssd_step
from .reference import ssd_scan_reference

__all__ = ["ssd_scan", "ssd_scan_naive", "ssd_step", "ssd_scan_reference"]


@torch.compiler.disable  # torch.compile: one opaque call (its own Triton launches / autograd.Function)
def ssd_scan(x, dt, A, B, C, *, chunk_size=256, D=None, z=None, dt_bias=None, dt_softplus=True,
             dt_limit=(0.0, float("inf")), initial_state=None, cu_seqlens=None, return_final_state=False,
             backend=None):
    """Chunked SSD scan; returns (y in x's dtype, final_state float32 or None). See module docstring."""
    kwargs = dict(chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                  initial_state=initial_state, cu_seqlens=cu_seqlens, return_final_state=return_final_state)
    if resolve_backend("ssd", backend, x.device) == "triton":
        from .triton_ssd import ssd_scan_triton  # noqa: PLC0415 (lazy: triton is optional)
        return ssd_scan_triton(x, dt, A, B, C, **kwargs)
    return ssd_scan_reference(x, dt, A, B, C, **kwargs)
