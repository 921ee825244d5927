"""Mamba2's inner path, in_proj's output -> conv1d -> SSD -> gated RMSNorm, as one Triton operator.

    y, new_conv_state, final_state = mamba2_inner(zxbcdt, conv_weight, conv_bias, A, *, d_inner, headdim, ngroups,
        dstate, chunk_size, D=None, dt_bias=None, dt_limit=(0, inf), norm_weight=None, norm_group=None, eps=1e-5,
        add=None, conv_state=None, initial_state=None, cu_seqlens=None, return_final_state=False, max_seqlen=None)
    u, new_conv_state, final_state, rstd = mamba2_inner(..., norm_weight=None, fold_norm=True)

zxbcdt (b, t, 2*d_inner + 2*ngroups*dstate + H), H = d_inner / headdim: in_proj's output, columns z | x B C | dt.
`add` (an implicit model's injection) has zxbcdt's shape and is added to it where each part is read. The conv
(width <= 8, SiLU) runs on x B C (+ add's x B C), the SSD (dt softplus with dt_bias, clamped to dt_limit) on its
output and dt (+ add's dt), and y = RMSNorm(ssd_out * silu(z (+ add's z))) * norm_weight per group of norm_group
channels; the gradient of `add` is that of zxbcdt. It is the composition of lm_kernels.conv1d.causal_conv1d, lm_kernels.ssd.ssd_scan_xbc and
lm_kernels.rmsnorm.gated_rms_norm, equal to it up to rounding of the gradient sums (tests/test_mamba2_inner.py);
what it adds is the backward writing the gradients of z, x B C and dt into one tensor of zxbcdt's shape, so that
in_proj is one GEMM forward and backward (triton_inner.py). Triton only (CUDA, or TRITON_INTERPRET=1 on CPU):
`fits` says whether it takes a call; the caller composes the three ops otherwise.
Packed offsets (cu_seqlens, b == 1) are checked on the host (a wait for the device where they are on one) unless
`max_seqlen`, the longest document's length as a host int, says that the caller has checked them
(lm_kernels.varlen.packed_offsets; the model does, once per forward).

fold_norm (one norm group, no norm_weight) leaves the normalization to the caller's next projection: the scan
gates its output, u = ssd_out * silu(z), and sums u's squares per row and head in the same pass, so no pass of the
norm reads the SSD output back; rstd (b, t, 1) float32 is u's reciprocal RMS and RMSNorm(u) = u * rstd. The caller
must use u only as out = (u @ W^T) * rstd (W: its projection's weight times the norm weight per input column),
with rstd outside autograd (it is returned non-differentiable): the gradient that reaches u is then rstd times the
normalized output's, and the backward applies the norm's full gradient, rstd's dependence on u included
(Mamba2Mixer does this under torch.compile, where inductor fuses the row scale into the residual add after it).
"""
from __future__ import annotations

import torch

from ..backend import resolve_backend
from ..conv1d import MAX_TRITON_WIDTH

__all__ = ["mamba2_inner", "fits"]


def fits(zxbcdt: torch.Tensor, conv_width: int) -> bool:
    """Whether mamba2_inner takes this call: the conv, SSD and gated-norm backends all resolve to Triton for it
    (LM_CONV1D_BACKEND / LM_SSD_BACKEND / LM_RMSNORM_BACKEND=reference turn it off), a 16-bit or float32 input,
    a conv width of at most 8 and at least one token."""
    dev = zxbcdt.device
    return (zxbcdt.dtype in (torch.float32, torch.bfloat16, torch.float16) and zxbcdt.shape[1] > 0
            and resolve_backend("conv1d", None, dev, fits=conv_width <= MAX_TRITON_WIDTH) == "triton"
            and conv_width <= MAX_TRITON_WIDTH
            and resolve_backend("ssd", None, dev) == "triton" and resolve_backend("rmsnorm", None, dev) == "triton")


def mamba2_inner(zxbcdt, conv_weight, conv_bias, A, **kwargs):
    """See the module docstring; call only where `fits` holds."""
    from .triton_inner import mamba2_inner_triton  # noqa: PLC0415 (lazy: triton is optional)
    return mamba2_inner_triton(zxbcdt, conv_weight, conv_bias, A, **kwargs)
