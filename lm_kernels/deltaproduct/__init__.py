"""(Gated) DeltaProduct chunkwise op: Triton kernels with a PyTorch chunkwise reference beside them.

    o, final_state = chunk_deltaproduct(q, k, v, beta, g=None, *, num_householder, scale=None,
                                        initial_state=None, output_final_state=False,
                                        use_qk_l2norm=False, cu_seqlens=None, chunk_size=64, backend=None)

q (b,t,h,dk); k (b,t*nh,h,dk), v (b,t*nh,h,dv), beta (b,t*nh,h) interleaved (sub-step j of token i at
index i*nh + j); g (b,t,h) optional log decay (<= 0) applied before each token's first sub-step:
    H_{i,0} = exp(g_i) H_{i-1};  H_{i,j} = (I - beta k k^T) H_{i,j-1} + beta k v^T;  o_i = scale H_{i,nh}^T q_i.
State (b,h,dk,dv), or (num_seqs,h,dk,dv) with cu_seqlens (b == 1; the state resets at each document).
final_state is float32 (float64 for float64 inputs) or None; o has v's dtype.

    o, new_state = deltaproduct_step(state, q, k, v, beta, g=None, *, scale=None, use_qk_l2norm=False, backend=None)

is one token of generation (k, v, beta: (b,nh,h,..)), on CUDA one Triton kernel (triton_step.py).

backend: None = auto (Triton on CUDA when triton imports, else the reference; the environment variable
LM_DELTAPRODUCT_BACKEND=reference|triton overrides auto), "reference", or "triton" (on CPU only under
TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os

import torch

from ._common import check_step_inputs
from .naive import deltaproduct_step as deltaproduct_step_reference
from .naive import naive_deltaproduct
from .reference import chunk_deltaproduct_reference

__all__ = ["chunk_deltaproduct", "naive_deltaproduct", "deltaproduct_step", "deltaproduct_step_reference",
           "chunk_deltaproduct_reference", "resolve_backend"]

_BACKENDS = ("reference", "triton")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(backend, device: torch.device) -> str:
    """The backend that a call with `backend` on `device` uses ("reference" or "triton")."""
    if backend is None:
        env = os.environ.get("LM_DELTAPRODUCT_BACKEND", "").strip().lower()
        if env:
            if env not in _BACKENDS:
                raise ValueError(f"LM_DELTAPRODUCT_BACKEND must be one of {_BACKENDS}, got {env!r}")
            backend = env
        else:
            backend = "triton" if device.type == "cuda" and _triton_available() else "reference"
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be None, 'reference' or 'triton', got {backend!r}")
    if backend == "triton":
        if not _triton_available():
            raise ValueError("backend='triton' needs the triton package (pip install triton), "
                             "or use backend='reference'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError("backend='triton' on a CPU tensor needs TRITON_INTERPRET=1 set before import; "
                             "use backend='reference' on CPU")
    return backend


@torch.compiler.disable  # torch.compile: one opaque call (its own Triton launches / autograd.Function)
def chunk_deltaproduct(q, k, v, beta, g=None, *, num_householder, scale=None, initial_state=None,
                       output_final_state=False, use_qk_l2norm=False, cu_seqlens=None, chunk_size=64,
                       backend=None):
    """(Gated) DeltaProduct over a whole sequence; returns (o, final_state). See the module docstring."""
    which = resolve_backend(backend, q.device)
    kwargs = dict(num_householder=num_householder, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
                  chunk_size=chunk_size)
    if which == "reference":
        return chunk_deltaproduct_reference(q, k, v, beta, g, **kwargs)
    from .triton_chunk import chunk_deltaproduct_triton
    return chunk_deltaproduct_triton(q, k, v, beta, g, **kwargs)


@torch.compiler.disable
def deltaproduct_step(state, q, k, v, beta, g=None, *, scale=None, use_qk_l2norm=False, backend=None):
    """One token of generation: state (b,h,K,V); q (b,h,K); k (b,nh,h,K); v (b,nh,h,V); beta (b,nh,h); g (b,h) log
    decay. Returns (o (b,h,V) in v's dtype, new_state float32, float64 for float64 inputs on the reference); the
    input state is not modified. backend as for `chunk_deltaproduct`: on CUDA one Triton kernel (triton_step.py),
    else the PyTorch reference (naive.deltaproduct_step)."""
    which = resolve_backend(backend, q.device)
    if which == "reference":
        return deltaproduct_step_reference(state, q, k, v, beta, g, scale=scale, use_qk_l2norm=use_qk_l2norm)
    check_step_inputs(state, q, k, v, beta, g)
    if torch.float64 in (state.dtype, q.dtype, k.dtype, v.dtype):
        raise ValueError("the triton backend does not take float64 inputs; use backend='reference'")
    from .triton_step import deltaproduct_step_triton
    return deltaproduct_step_triton(state, q, k, v, beta, g, scale=scale, use_qk_l2norm=use_qk_l2norm)
