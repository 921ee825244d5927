"""(Gated) DeltaProduct chunkwise op: Triton kernels with a PyTorch chunkwise reference beside them.

    o, final_state = chunk_deltaproduct(q, k, v, beta, g=None, *, num_householder, scale=None,
                                        initial_state=None, output_final_state=False,
                                        use_qk_l2norm=False, cu_seqlens=None, chunk_size=64, backend=None,
                                        cu_seqlens_cpu=None)

q (b,t,h,dk); k (b,t*nh,h,dk), v (b,t*nh,h,dv), beta (b,t*nh,h) interleaved (sub-step j of token i at
index i*nh + j); g (b,t,h) optional log decay (<= 0) applied before each token's first sub-step:
    H_{i,0} = exp(g_i) H_{i-1};  H_{i,j} = (I - beta k k^T) H_{i,j-1} + beta k v^T;  o_i = scale H_{i,nh}^T q_i.
State (b,h,dk,dv), or (num_seqs,h,dk,dv) with cu_seqlens (b == 1; the state resets at each document).
Every backend needs the offsets' values on the host (the Triton path builds its chunk tables from them; the checks):
`cu_seqlens_cpu`, the same offsets as a CPU tensor (a data loader's, from before their copy to the device), is read
instead of cu_seqlens, so that a call does not wait for the device; without it cu_seqlens is copied back, once.
final_state is float32 (float64 for float64 inputs) or None; o has v's dtype.

    o, new_state = deltaproduct_step(state, q, k, v, beta, g=None, *, scale=None, use_qk_l2norm=False, backend=None)

is one token of generation (k, v, beta: (b,nh,h,..)), on CUDA one Triton kernel (step.py).

backend: None = auto (Triton on CUDA when triton imports, else the reference; the environment variable
LM_DELTAPRODUCT_BACKEND=reference|triton|fla overrides auto), "reference", "triton" (on CPU only under
TRITON_INTERPRET=1), or "fla" (flash-linear-attention's kernel, fla_backend.py; fla has no one-token op, so the
decode step runs ours); `lm_kernels.backend.resolve_backend` decides. The Triton chunk path is chunk.py (its docstring
names the phases and their modules), the decode step step.py; reference.py and naive.py are the PyTorch forms.
"""
from __future__ import annotations

import torch

from ..backend import resolve_backend
from ._common import check_step_inputs
from .naive import deltaproduct_step as deltaproduct_step_reference
from .naive import naive_deltaproduct
from .reference import chunk_deltaproduct_reference

__all__ = ["chunk_deltaproduct", "naive_deltaproduct", "deltaproduct_step", "deltaproduct_step_reference",
           "chunk_deltaproduct_reference", "BACKENDS"]

BACKENDS = ("reference", "triton", "fla")  # what `backend=` takes besides None (lm_kernels.backend.resolve_backend)


def _chunk_triton(*args, **kwargs):
    from .chunk import chunk_deltaproduct_triton
    return chunk_deltaproduct_triton(*args, **kwargs)


def _step_triton(state, q, k, v, beta, g, *, scale, use_qk_l2norm):
    check_step_inputs(state, q, k, v, beta, g)
    if torch.float64 in (state.dtype, q.dtype, k.dtype, v.dtype):
        raise ValueError("the triton backend does not take float64 inputs; use backend='reference'")
    from .step import deltaproduct_step_triton
    return deltaproduct_step_triton(state, q, k, v, beta, g, scale=scale, use_qk_l2norm=use_qk_l2norm)


def _chunk_fla(*args, **kwargs):
    from .fla_backend import chunk_deltaproduct_fla
    return chunk_deltaproduct_fla(*args, **kwargs)


# backend -> (chunk function, decode step function), each with the signature of the reference
_IMPLS = {"reference": (chunk_deltaproduct_reference, deltaproduct_step_reference),
          "triton": (_chunk_triton, _step_triton),
          "fla": (_chunk_fla, _step_triton)}


@torch.compiler.disable  # torch.compile: one opaque call (its own Triton launches / autograd.Function)
def chunk_deltaproduct(q, k, v, beta, g=None, *, num_householder, scale=None, initial_state=None,
                       output_final_state=False, use_qk_l2norm=False, cu_seqlens=None, chunk_size=64,
                       backend=None, cu_seqlens_cpu=None):
    """(Gated) DeltaProduct over a whole sequence; returns (o, final_state). See the module docstring."""
    chunk, _ = _IMPLS[resolve_backend("deltaproduct", backend, q.device, backends=BACKENDS)]
    return chunk(q, k, v, beta, g, num_householder=num_householder, scale=scale, initial_state=initial_state,
                 output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
                 chunk_size=chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)


@torch.compiler.disable
def deltaproduct_step(state, q, k, v, beta, g=None, *, scale=None, use_qk_l2norm=False, backend=None):
    """One token of generation: state (b,h,K,V); q (b,h,K); k (b,nh,h,K); v (b,nh,h,V); beta (b,nh,h); g (b,h) log
    decay. Returns (o (b,h,V) in v's dtype, new_state float32, float64 for float64 inputs on the reference); the
    input state is not modified. backend as for `chunk_deltaproduct`: on CUDA one Triton kernel (step.py), else the
    PyTorch reference (naive.deltaproduct_step)."""
    _, step = _IMPLS[resolve_backend("deltaproduct", backend, q.device, backends=BACKENDS)]
    return step(state, q, k, v, beta, g, scale=scale, use_qk_l2norm=use_qk_l2norm)
