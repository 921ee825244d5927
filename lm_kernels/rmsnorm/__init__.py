"""(Gated, grouped) RMSNorm forward as one Triton kernel, for calls that need no autograd (generation, eval).

    y = rms_norm_triton(x, weight, eps, z=None, group_size=None)
    y, x_sum = rms_norm_triton(x, weight, eps, residual=h)   # x_sum = x + h (in x's dtype), y = its norm

u = x * silu(z) (or x); per group of `group_size` channels (default: all) y = u * rsqrt(mean(u^2) + eps) * weight;
math in float32, y in x's dtype. The autograd form, and the PyTorch formula every other call runs, is
`lm.models.layers.rms_norm` (which calls this one on CUDA when nothing needs a gradient; see there). The PyTorch
formula of a norm is ~8 kernels (casts, pow, mean, rsqrt, products), this is one: what a one-token decode step,
which is launch bound, needs; with `residual` it also does a pre-norm block's residual add before its second norm
(`lm.models.layers.RMSNorm.add_forward`). On CPU the kernel runs under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

__all__ = ["rms_norm_triton"]


def rms_norm_triton(x, weight, eps, z=None, group_size=None, residual=None):
    from .triton_rmsnorm import rms_norm_fwd  # noqa: PLC0415 (lazy: triton is optional)
    return rms_norm_fwd(x, weight, eps, z=z, group_size=group_size, residual=residual)
