"""One backend choice for every op: `resolve_backend(op, backend, device)`.

backend=None is automatic: the environment variable LM_<OP>_BACKEND if set, else "triton" on CUDA when triton
imports (and the op's own `fits` check passes), else "reference". An explicit "triton" on a CPU tensor needs
TRITON_INTERPRET=1 set before triton is first imported (how the CPU tests run the kernels). Ops may accept
more backends than the two (DeltaProduct: "fla").
"""
from __future__ import annotations

import functools
import os

import torch

DEFAULT_BACKENDS = ("reference", "triton")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (an H100's 132 elsewhere: the interpreter, grid heuristics)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def resolve_backend(op: str, backend: str | None, device: torch.device, *, fits: bool = True,
                    backends: tuple[str, ...] = DEFAULT_BACKENDS) -> str:
    """The backend `op` runs for this `backend` argument on `device`; a ValueError that says what to use instead
    for a name it does not know or a Triton call that cannot run here. `fits`: whether the Triton kernel handles
    these inputs (automatic choice only)."""
    var = f"LM_{op.upper()}_BACKEND"
    if backend is None:
        env = os.environ.get(var, "").strip().lower()
        if env:
            if env not in backends:
                raise ValueError(f"{var}={env!r} is not one of {backends}; unset it for the automatic choice")
            backend = env
        else:
            return "triton" if device.type == "cuda" and fits and triton_available() else "reference"
    if backend not in backends:
        raise ValueError(f"{op}: backend={backend!r} is not one of {backends} or None (automatic)")
    if backend == "triton":
        if not triton_available():
            raise ValueError(f"{op}: backend='triton' needs the triton package (pip install triton); "
                             "or use backend='reference'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(f"{op}: backend='triton' on a {device.type} tensor needs TRITON_INTERPRET=1 set before "
                             "triton is imported; use backend='reference' on CPU")
    return backend


# The Triton ops' custom operators (lm::ssd_scan_*, lm::causal_conv1d_*) read their inputs through their strides:
# the exact-stride tag (torch >= 2.8; older: fixed stride order) makes inductor pass each input with the strides it
# had when traced, so a split view of a projection stays a view.
CUSTOM_OP_TAGS = (getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order),)


def absent(like: torch.Tensor, dtype=None) -> torch.Tensor:
    """A custom operator's absent optional output (it cannot return None): 0 elements, on `like`'s device."""
    return like.new_empty(0, dtype=dtype)
