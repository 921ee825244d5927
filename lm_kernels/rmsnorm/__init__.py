"""(Gated, grouped) RMSNorm in Triton: a one-kernel forward for calls that need no autograd (generation, eval), and
the gated norm as custom operators with a one-pass backward (training, eager and under torch.compile).

    y = rms_norm_triton(x, weight, eps, z=None, group_size=None)
    y, x_sum = rms_norm_triton(x, weight, eps, residual=h)   # x_sum = x + h, y = its norm (no autograd)
    y = gated_rms_norm_triton(x, z, weight, eps, group_size=None, z_add=None)   # differentiable
    y, x_sum = rms_norm_autograd_triton(x, weight, eps, residual=h, residual_scale=None, out_dtype=None)

u = x * silu(z) (or x); per group of `group_size` channels (default: all) y = u * rsqrt(mean(u^2) + eps) * weight;
math in float32, y in x's dtype. The PyTorch formula of a norm is ~8 kernels (casts, pow, mean, rsqrt, products),
the forward here is one: what a one-token decode step, which is launch bound, needs; with `residual` it also does a
pre-norm block's residual add before its second norm (`lm.models.layers.RMSNorm.add_forward`).

`rms_norm_autograd_triton` is the plain norm as the custom operators lm::rms_norm_fwd / lm::rms_norm_bwd (training,
eager and under torch.compile): y = norm(x + residual * residual_scale) * weight in `out_dtype` (the residual scaled
per row and rounded to its dtype first, both optional), returned with the sum where there is a residual; the
backward is one pass that adds the gradient reaching the sum from elsewhere and writes the residual's (and its row
scale's) gradient.

`gated_rms_norm_triton` is lm::gated_rms_norm_fwd / lm::gated_rms_norm_bwd (triton_rmsnorm.py) with their autograd
formula: the gate's input is z + z_add (z_add optional, z's shape and dtype; the sum rounded to z's dtype as the
PyTorch add rounds it, never written out), the forward saves x, z, z_add, weight and the float32 per-group rstd, and
the backward is one pass (dx, dz, which is also z_add's gradient, and dweight from per-program partial sums).

`lm.models.layers.rms_norm` chooses between these and the PyTorch formula (op "rmsnorm" of
lm_kernels.backend.resolve_backend: Triton on CUDA, LM_RMSNORM_BACKEND=reference|triton overrides). On CPU the
kernels run under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

__all__ = ["rms_norm_triton", "rms_norm_autograd_triton", "gated_rms_norm_triton"]


def rms_norm_triton(x, weight, eps, z=None, group_size=None, residual=None, residual_scale=None, out_dtype=None):
    from .triton_rmsnorm import rms_norm_fwd  # noqa: PLC0415 (lazy: triton is optional)
    return rms_norm_fwd(x, weight, eps, z=z, group_size=group_size, residual=residual, residual_scale=residual_scale,
                        out_dtype=out_dtype)


def rms_norm_autograd_triton(x, weight, eps, residual=None, residual_scale=None, out_dtype=None):
    from .triton_rmsnorm import rms_norm_autograd  # noqa: PLC0415 (lazy: triton is optional; registers the ops)
    return rms_norm_autograd(x, weight, eps, residual=residual, residual_scale=residual_scale, out_dtype=out_dtype)


def gated_rms_norm_triton(x, z, weight, eps, group_size=None, z_add=None):
    from .triton_rmsnorm import gated_rms_norm  # noqa: PLC0415 (lazy: triton is optional; registers the ops)
    return gated_rms_norm(x, z, weight, eps, group_size=group_size, z_add=z_add)
