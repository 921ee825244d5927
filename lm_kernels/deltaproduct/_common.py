"""Shared checks and small pure helpers for the DeltaProduct op (no kernels here)."""
from __future__ import annotations

import torch

from ..varlen import check_cu_seqlens, offset_values

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in float32 (float64 stays float64)."""
    xf = x.float() if x.dtype != torch.float64 else x
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def compute_dtype(*tensors) -> torch.dtype:
    """float64 when any input is float64, else float32 (the accumulation dtype)."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def check_inputs(q, k, v, beta, g, num_householder, initial_state, cu_seqlens, cu_seqlens_cpu=None):
    """Validate the chunk/naive API's arguments; returns (B, T, H, K, V, N, offsets): N the number of states, offsets
    cu_seqlens's values as a list of ints (checked to run from 0 to T), read from `cu_seqlens_cpu` where given (no
    wait for the device; lm_kernels.varlen.cpu_offsets), or None without cu_seqlens."""
    if not isinstance(num_householder, int) or num_householder < 1:
        raise ValueError(f"num_householder must be an int >= 1, got {num_householder!r}")
    nh = num_householder
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, seq_len, heads, head_k_dim), got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.dim() != 4 or tuple(k.shape) != (B, T * nh, H, K):
        raise ValueError(f"k must be (batch, seq_len*num_householder, heads, head_k_dim) = {(B, T * nh, H, K)}, "
                         f"got {tuple(k.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T * nh, H):
        raise ValueError(f"v must be (batch, seq_len*num_householder, heads, head_v_dim) with leading dims "
                         f"{(B, T * nh, H)}, got {tuple(v.shape)}")
    V = v.shape[-1]
    if tuple(beta.shape) != (B, T * nh, H):
        raise ValueError(f"beta must be (batch, seq_len*num_householder, heads) = {(B, T * nh, H)}, "
                         f"got {tuple(beta.shape)}")
    if g is not None and tuple(g.shape) != (B, T, H):
        raise ValueError(f"g (log decay) must be (batch, seq_len, heads) = {(B, T, H)}, got {tuple(g.shape)}")
    N, offsets = B, None
    if cu_seqlens is not None:
        N = check_cu_seqlens(cu_seqlens, B, None, "deltaproduct")
        offsets = offset_values(cu_seqlens, cu_seqlens_cpu, T, "deltaproduct")
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(f"initial_state must be (num_states, heads, head_k_dim, head_v_dim) = {(N, H, K, V)} "
                         f"(num_states = batch, or number of sequences with cu_seqlens), "
                         f"got {tuple(initial_state.shape)}")
    return B, T, H, K, V, N, offsets


def state_dtype(*tensors) -> torch.dtype:
    """Final states are float32 (float64 when the inputs are float64)."""
    return compute_dtype(*tensors)


def check_step_inputs(state, q, k, v, beta, g):
    """Validate the shapes of one decode step; returns (b, h, K, V, nh)."""
    if state.dim() != 4:
        raise ValueError(f"state must be (batch, heads, head_k_dim, head_v_dim), got {tuple(state.shape)}")
    b, h, K, V = state.shape
    if q.dim() != 3 or tuple(q.shape) != (b, h, K):
        raise ValueError(f"q must be (batch, heads, head_k_dim) = {(b, h, K)}, got {tuple(q.shape)}")
    if k.dim() != 4 or k.shape[0] != b or tuple(k.shape[2:]) != (h, K):
        raise ValueError(f"k must be (batch, num_householder, heads, head_k_dim) with batch {b}, heads {h}, "
                         f"head_k_dim {K}, got {tuple(k.shape)}")
    nh = k.shape[1]
    if tuple(v.shape) != (b, nh, h, V):
        raise ValueError(f"v must be (batch, num_householder, heads, head_v_dim) = {(b, nh, h, V)}, "
                         f"got {tuple(v.shape)}")
    if tuple(beta.shape) != (b, nh, h):
        raise ValueError(f"beta must be (batch, num_householder, heads) = {(b, nh, h)}, got {tuple(beta.shape)}")
    if g is not None and tuple(g.shape) != (b, h):
        raise ValueError(f"g must be (batch, heads) = {(b, h)}, got {tuple(g.shape)}")
    return b, h, K, V, nh
