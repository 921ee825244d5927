"""Out-of-bounds checks for the Triton kernels under TRITON_INTERPRET=1: inside `bounds_checked()`,
every address a load or store touches (mask applied) must lie inside the storage of one of the tensors
passed to that kernel launch, else `OutOfBounds` names the kernel, the program id and the offsets. An
access that a GPU reports as an illegal address (or silently reads from a neighbour) fails here on CPU.

    from bounds_check import bounds_checked
    with bounds_checked():
        o, _ = chunk_deltaproduct(q, k, v, beta, num_householder=4, backend="triton")

Only the interpreter is checked (compiled GPU kernels are not instrumented). Not thread-safe.
"""
from __future__ import annotations

import contextlib

import numpy as np


class OutOfBounds(RuntimeError):
    """A load or store of an interpreted kernel left every tensor argument it was given."""


_STATE: dict = {"ranges": [], "kernel": None}


def _check(builder, ptrs, mask, nbytes: int, what: str) -> None:
    p = np.asarray(ptrs.data).astype(np.uint64)
    live = p[np.broadcast_to(np.asarray(mask.data).astype(bool), p.shape)]
    if live.size == 0:
        return
    ok = np.zeros(live.shape, dtype=bool)
    for lo, hi in _STATE["ranges"]:
        ok |= (live >= lo) & (live + np.uint64(nbytes) <= hi)
    if not ok.all():
        bad = [int(b) for b in live[~ok][:4]]
        near = [(b - lo, hi - lo) for b in bad for lo, hi in _STATE["ranges"] if abs(b - lo) < 1 << 30][:4]
        raise OutOfBounds(f"{what} out of bounds in {_STATE['kernel']} at program {tuple(builder.grid_idx)}: "
                          f"{int((~ok).sum())} addresses; (byte offset, storage bytes) of nearby arguments: {near}")


@contextlib.contextmanager
def bounds_checked():
    """Check every interpreted Triton load/store in this block (needs TRITON_INTERPRET=1 at import)."""
    import triton.runtime.interpreter as itp

    gx, b = itp.GridExecutor, itp.InterpreterBuilder
    saved = (gx._init_args_hst, gx.__call__, b.create_masked_load, b.create_masked_store)
    orig_init, orig_call, orig_load, orig_store = saved

    def _init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = orig_init(self, args_dev, kwargs)
        _STATE["ranges"] = [(a.untyped_storage().data_ptr(), a.untyped_storage().data_ptr() + a.untyped_storage().nbytes())
                            for a in list(args_hst) + list(kwargs_hst.values()) if hasattr(a, "untyped_storage")]
        return args_hst, kwargs_hst

    def __call__(self, *args, **kwargs):
        _STATE["kernel"] = getattr(self.fn, "__name__", str(self.fn))
        return orig_call(self, *args, **kwargs)

    # (the cache / eviction arguments after the mask differ between triton releases: passed on as they come)
    def create_masked_load(self, ptrs, mask, other, *cache_args):
        _check(self, ptrs, mask, np.dtype(itp._get_np_dtype(ptrs.get_element_ty())).itemsize, "load")
        return orig_load(self, ptrs, mask, other, *cache_args)

    def create_masked_store(self, ptrs, value, mask, *cache_args):
        _check(self, ptrs, mask, np.asarray(value.data).dtype.itemsize, "store")
        return orig_store(self, ptrs, value, mask, *cache_args)

    gx._init_args_hst, gx.__call__ = _init_args_hst, __call__
    b.create_masked_load, b.create_masked_store = create_masked_load, create_masked_store
    try:
        yield
    finally:
        gx._init_args_hst, gx.__call__, b.create_masked_load, b.create_masked_store = saved
        _STATE["ranges"], _STATE["kernel"] = [], None
