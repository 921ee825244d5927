"""Llama's one-token decode step on a static cache: rotary embedding of q and k, and the write of k and v into the
cache, as one Triton kernel.

    q = rope_kv_step(qkv, cos, sin, k_cache, v_cache, position, n_heads, n_kv, backend=None)

qkv (b, 1, (n_heads + 2 n_kv) * d): the fused projection's output (q | k | v, heads of d channels), read through
its strides; cos, sin (1, d) float32: the rotary tables of this step's position (half-rotation layout, as
`lm.models.layers.rotary_cos_sin`); k_cache, v_cache (b, n_kv, capacity, d): the static cache's buffers (written
through their strides, any layout); position (1,) long: the slot of the new token (a device tensor, so that the
step can be captured in a CUDA graph). Returns q rotated, (b, n_heads, 1, d) in qkv's dtype; k rotated and v are
written at slot `position` of the buffers.

Backends (lm_kernels.backend.resolve_backend, op "rope"; LM_ROPE_BACKEND=reference|triton overrides):
"reference" (`rope_kv_step_reference`: the PyTorch form the attention runs everywhere else, ~14 kernels: table
casts, the rotation's mul/neg/cat/add, two index_copy_), "triton" (one kernel, triton_rope.py; automatic on CUDA
without float64 or autograd; rotation in float32 from the float32 tables, rounded once). On CPU the kernel runs
under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch

from ..backend import resolve_backend

__all__ = ["rope_kv_step", "rope_kv_step_reference"]


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rope_kv_step_reference(qkv, cos, sin, k_cache, v_cache, position, n_heads: int, n_kv: int) -> torch.Tensor:
    """The PyTorch form (autograd, any dtype): the tables cast to qkv's dtype, the rotation in that dtype."""
    b, t, _ = qkv.shape
    d = k_cache.shape[-1]
    q, k, v = qkv.split([n_heads * d, n_kv * d, n_kv * d], dim=-1)
    q = q.view(b, t, n_heads, d).transpose(1, 2)
    k = k.view(b, t, n_kv, d).transpose(1, 2)
    v = v.view(b, t, n_kv, d).transpose(1, 2)
    cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)
    k_cache.index_copy_(2, position, _rotate(k, cos, sin))
    v_cache.index_copy_(2, position, v)
    return _rotate(q, cos, sin)


def _check(qkv, cos, sin, k_cache, v_cache, position, n_heads, n_kv):
    b, t, c = qkv.shape
    d = k_cache.shape[-1]
    if t != 1:
        raise ValueError(f"rope_kv_step: one new token per row (qkv of shape (b, 1, c)), got t={t}")
    if c != (n_heads + 2 * n_kv) * d or d % 2:
        raise ValueError(f"rope_kv_step: qkv has {c} channels, expected (n_heads + 2 n_kv) * head_dim = "
                         f"({n_heads} + 2 * {n_kv}) * {d} with an even head_dim")
    for name, buf in (("k_cache", k_cache), ("v_cache", v_cache)):
        if buf.dim() != 4 or buf.shape[0] != b or buf.shape[1] != n_kv or buf.shape[3] != d:
            raise ValueError(f"rope_kv_step: {name} has shape {tuple(buf.shape)}, expected "
                             f"({b}, {n_kv}, capacity, {d})")
    if cos.shape[-1] != d or sin.shape != cos.shape or cos.numel() != d:
        raise ValueError(f"rope_kv_step: cos and sin must hold one position's table of {d} values, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if position.numel() != 1:
        raise ValueError(f"rope_kv_step: position must be one slot index, got shape {tuple(position.shape)}")


def _triton(qkv, cos, sin, k_cache, v_cache, position, n_heads, n_kv):
    from .triton_rope import rope_kv_step_triton  # noqa: PLC0415 (lazy: triton is optional)
    return rope_kv_step_triton(qkv, cos, sin, k_cache, v_cache, position, n_heads, n_kv)


def rope_kv_step(qkv, cos, sin, k_cache, v_cache, position, n_heads: int, n_kv: int, backend=None) -> torch.Tensor:
    """See the module docstring."""
    _check(qkv, cos, sin, k_cache, v_cache, position, n_heads, n_kv)
    f64 = torch.float64 in (qkv.dtype, k_cache.dtype)
    grad = torch.is_grad_enabled() and qkv.requires_grad
    if resolve_backend("rope", backend, qkv.device, fits=not (f64 or grad)) == "triton":
        if f64 or grad:
            raise ValueError("rope_kv_step: the triton backend takes no float64 inputs and has no backward; use "
                             "backend='reference'")
        return _triton(qkv, cos, sin, k_cache, v_cache, position, n_heads, n_kv)
    return rope_kv_step_reference(qkv, cos, sin, k_cache, v_cache, position, n_heads, n_kv)
