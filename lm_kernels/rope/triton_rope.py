"""The decode step's rotary embedding + K/V cache write: one program per (batch row, head) of q | k.

A q head's program rotates it into q_out; a k head's program rotates it into the K buffer and copies the matching v
head into the V buffer, both at slot `position` (loaded from the device). Half-rotation layout: with x = (x1, x2)
the halves of a head, out = (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2). Math in float32, each output rounded once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import next_pow2


@triton.jit
def _rope_kv_step_kernel(qkv, cos, sin, pos, q_out, kc, vc, H, HKV, HALF,
                         s_b, s_c, sq_b, sq_h, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
                         BH: tl.constexpr):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o = tl.arange(0, BH)
    m = o < HALF
    c1 = tl.load(cos + o, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos + HALF + o, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin + o, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin + HALF + o, mask=m, other=0.0).to(tl.float32)
    base = qkv + i_b * s_b + (i_h * 2 * HALF) * s_c  # q heads, then k heads, in the projection's channel order
    x1 = tl.load(base + o * s_c, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + (HALF + o) * s_c, mask=m, other=0.0).to(tl.float32)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    if i_h < H:
        p = q_out + i_b * sq_b + i_h * sq_h
        tl.store(p + o * sq_d, y1.to(q_out.dtype.element_ty), mask=m)
        tl.store(p + (HALF + o) * sq_d, y2.to(q_out.dtype.element_ty), mask=m)
    else:
        j = i_h - H
        slot = tl.load(pos)
        p = kc + i_b * sk_b + j * sk_h + slot * sk_s
        tl.store(p + o * sk_d, y1.to(kc.dtype.element_ty), mask=m)
        tl.store(p + (HALF + o) * sk_d, y2.to(kc.dtype.element_ty), mask=m)
        v_in = qkv + i_b * s_b + ((H + HKV + j) * 2 * HALF) * s_c
        pv = vc + i_b * sv_b + j * sv_h + slot * sv_s
        tl.store(pv + o * sv_d, tl.load(v_in + o * s_c, mask=m, other=0.0).to(vc.dtype.element_ty), mask=m)
        tl.store(pv + (HALF + o) * sv_d, tl.load(v_in + (HALF + o) * s_c, mask=m, other=0.0).to(vc.dtype.element_ty),
                 mask=m)


@torch.compiler.disable  # torch.compile: one opaque call
def rope_kv_step_triton(qkv, cos, sin, k_cache, v_cache, position, n_heads, n_kv):
    """See lm_kernels.rope (arguments checked there). qkv and the cache buffers are read / written through their
    strides; the tables are made contiguous (d values)."""
    b = qkv.shape[0]
    d = k_cache.shape[-1]
    cos, sin = cos.reshape(d).contiguous(), sin.reshape(d).contiguous()
    q = torch.empty(b, n_heads, 1, d, dtype=qkv.dtype, device=qkv.device)
    if b:
        half = d // 2
        _rope_kv_step_kernel[(b, n_heads + n_kv)](
            qkv, cos, sin, position, q, k_cache, v_cache, n_heads, n_kv, half,
            qkv.stride(0), qkv.stride(2), q.stride(0), q.stride(1), q.stride(3),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
            BH=next_pow2(half), num_warps=1)
    return q
