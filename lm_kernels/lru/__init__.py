"""Block-diagonal linear recurrence scan for the LRU family (LRU, H-LRU, BD-LRU).

    h_t = A_t h_{t-1} + x_t     per block: A (b, t, nb, m, m), x (b, t, nb, m), h (b, t, nb, m), m <= 8

Row i of A_t mixes into h_i. One op covers the complex-diagonal LRU (2x2 rotation-scaling blocks from
`lru_lambda_blocks`, usually a stride-0 expanded A), H-LRU (`companion` matrices) and BD-LRU (dense
blocks). Files: naive.py (sequential definition), reference.py (chunked PyTorch scan, autograd),
triton_scan.py (Triton kernels), autograd.py (the torch.autograd.Function around them).

Backends (lm_kernels.backend.resolve_backend): None = auto (Triton on CUDA when triton imports, else the
reference; LM_LRU_BACKEND overrides), "reference", "triton" (on CPU only under TRITON_INTERPRET=1), "naive"
(tests).
"""
from __future__ import annotations

import torch

from ..backend import resolve_backend
from .naive import block_scan_naive, block_scan_step
from .params import companion, lru_lambda_blocks
from .reference import block_scan_reference

BACKENDS = ("reference", "triton", "naive")


@torch.compiler.disable  # torch.compile: one opaque call (its own Triton launches / autograd.Function)
def block_scan(A: torch.Tensor, x: torch.Tensor, *, initial_state: torch.Tensor | None = None,
               cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
               return_final_state: bool = False, backend: str | None = None):
    """Scan h_t = A_t h_{t-1} + x_t over time for every block; returns (h, final_state).

    A (b, t, nb, m, m) may be expanded (stride 0 over b and/or t); it is read through its strides and
    not copied on the Triton path (its gradient, if needed, is returned in A's full expanded shape and
    summed by autograd). x (b, t, nb, m). initial_state (b, nb, m), or (num_seqs, nb, m) with
    cu_seqlens (int tensor [0, ..., t] of packed document boundaries, batch must be 1; the state resets
    to the document's initial state, or zero, at each document start). h has x's dtype; the scan
    accumulates in float32 (float64 for float64 inputs). final_state (b or num_seqs, nb, m) is float32
    (float64 for float64 inputs), or None unless return_final_state.
    """
    backend = resolve_backend("lru", backend, x.device, backends=BACKENDS)
    kw = dict(initial_state=initial_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
              return_final_state=return_final_state)
    if backend == "reference":
        return block_scan_reference(A, x, **kw)
    if backend == "naive":
        return block_scan_naive(A, x, **kw)
    from .autograd import block_scan_triton
    return block_scan_triton(A, x, **kw)


__all__ = ["block_scan", "block_scan_naive", "block_scan_reference", "block_scan_step",
           "companion", "lru_lambda_blocks"]
