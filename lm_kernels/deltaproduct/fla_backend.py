"""backend="fla": the DeltaProduct chunkwise op run by flash-linear-attention's kernel.

    chunk_deltaproduct_fla(q, k, v, beta, g=None, *, num_householder, ...)  ->  (o, final_state)

calls `fla.ops.gated_delta_product.chunk_gated_delta_product` with our contract (see the package
docstring). The two ops share their layout, so the mapping is one to one: q (b,t,h,dk); k, v, beta
interleaved over t * num_householder rows (row i*nh + j is sub-step j of token i); g (b,t,h) log decay
applied before each token's first sub-step; state (N,h,dk,dv). Our `use_qk_l2norm` is fla's
`use_qk_l2norm_in_kernel`. `chunk_size` is a tiling choice of our kernel: fla tiles with its own 64
(the result is the same up to rounding).

It is there to cross-check our Triton kernel against fla's on a GPU and to compare their speed
(lm bench deltaproduct, scripts/gpu_fla.sh). Where fla cannot run, `check_fla_can_run` raises a
ValueError that names the backend to use instead:
  - fla not installed (pip install 'lm[fla]');
  - a tensor not on CUDA (fla's kernels are Triton on GPU only): backend='reference' on CPU;
  - float32 / float64 q, k or v (fla's op asserts half precision): backend='triton' or 'reference';
  - the gated op with gradients on a Hopper GPU (sm_90) with triton >= 3.4.0 and < 3.7.1 and no tilelang:
    fla refuses that backward (its chunk_bwd_dqkwg miscompiles there, fla issue #640); we refuse it at
    the forward, before any work, with backend='triton' as the way on.
"""
from __future__ import annotations

import importlib.util

import torch

from ._common import check_inputs


def _fla_op():
    try:
        from fla.ops.gated_delta_product import chunk_gated_delta_product
    except ImportError as e:
        raise ValueError("backend='fla' needs flash-linear-attention (pip install 'lm[fla]', i.e. "
                         "flash-linear-attention>=0.6,<0.7); or use backend='triton' (CUDA) / 'reference'") from e
    return chunk_gated_delta_product


def _triton_version() -> tuple[int, ...]:
    import triton

    parts = []
    for p in triton.__version__.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def hopper_backward_blocked(device: torch.device) -> bool:
    """fla 0.6's gated backward raises on sm_90 with triton in [3.4.0, 3.7.1) unless tilelang is installed."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    if importlib.util.find_spec("tilelang") is not None:
        return False
    return (3, 4, 0) <= _triton_version() < (3, 7, 1)


def check_fla_can_run(q, k, v, g, needs_grad: bool) -> None:
    """Raise a ValueError saying which backend to use where fla's op cannot run these inputs."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"backend='fla': {name} is on {t.device.type}, and fla's DeltaProduct kernels run on "
                             "CUDA only; use backend='reference' on CPU")
        if t.dtype in (torch.float32, torch.float64):
            raise ValueError(f"backend='fla': {name} is {t.dtype}, and fla's chunk_gated_delta_product takes "
                             "bfloat16/float16 only; cast to bfloat16 or use backend='triton' (or 'reference')")
    if g is not None and needs_grad and hopper_backward_blocked(q.device):
        import triton

        raise ValueError(
            f"backend='fla': fla refuses the gated DeltaProduct backward on Hopper GPUs with triton "
            f"{triton.__version__} (>= 3.4.0 and < 3.7.1 miscompiles it, fla issue #640); use backend='triton', "
            "or upgrade triton to >= 3.7.1 / install tilelang")


def chunk_deltaproduct_fla(q, k, v, beta, g=None, *, num_householder, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm=False, cu_seqlens=None, chunk_size=64,
                           cu_seqlens_cpu=None):
    """`chunk_deltaproduct` on fla's kernel; same arguments and results (o in v's dtype, final state float32)."""
    *_, offsets = check_inputs(q, k, v, beta, g, num_householder, initial_state, cu_seqlens, cu_seqlens_cpu)
    op = _fla_op()
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, beta, g, initial_state))
    check_fla_can_run(q, k, v, g, needs_grad)
    o, final_state = op(
        q=q, k=k, v=v, g=g, beta=beta, num_householder=num_householder, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_seqlens.long() if cu_seqlens is not None else None,
        # the offsets' host copy: fla builds its chunk indices from it instead of reading cu_seqlens back
        cu_seqlens_cpu=torch.tensor(offsets, dtype=torch.long) if offsets is not None else None,
    )
    if final_state is not None and final_state.dtype != torch.float32:
        final_state = final_state.float()
    return o.to(v.dtype), final_state
