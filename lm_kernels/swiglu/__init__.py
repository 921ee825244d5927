"""SwiGLU's gate, silu(g) * u, as one Triton kernel, for calls that need no autograd (generation, eval).

    y = silu_mul_triton(g, u)

g, u (..., n) float16/bfloat16/float32 of one shape (any strides); math in float32, y in g's dtype, contiguous. The
PyTorch form `F.silu(g) * u` is two kernels; `lm.models.layers.silu_mul` chooses (op "swiglu" of
lm_kernels.backend.resolve_backend: this kernel on CUDA without autograd or float64, LM_SWIGLU_BACKEND overrides).
On CPU the kernel runs under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

__all__ = ["silu_mul_triton"]


def silu_mul_triton(g, u):
    from .triton_swiglu import silu_mul_fwd  # noqa: PLC0415 (lazy: triton is optional)
    return silu_mul_fwd(g, u)
