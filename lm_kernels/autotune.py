"""triton.autotune with its choices kept on disk.

Triton's autotuner times every config on the first call per key in each process: for the SSD kernels at a new
shape that is 10-20 s per process, repeated by every training restart, evaluation and benchmark. With
`cache_results=True` (triton >= 3.4; triton 3.6 on the GPU image, 3.9 on PyPI) the autotuner stores the timings in
triton's cache directory, keyed by triton's version, the GPU target, the kernel's source, the tuning key and the
config list, and later processes read the choice instead of timing again. A change to a kernel or to its
configs therefore re-tunes; two GPUs of one architecture (an H100 and an H200) share the entries.
LM_TRITON_AUTOTUNE_CACHE=0 turns it off: every process times again, e.g. to re-tune after a driver change.

Nothing is read from the environment at import: a kernel module builds its autotuners on first use for the settings
`tuning(op)` reads on each call (interpreter or GPU, autotuning on or off, the disk cache on or off), one set per
settings (functools.lru_cache), so a setting changed later in the process takes effect at the next call.

`launch` keeps an autotuner's choice per call key in the process, so that repeat launches skip the autotuner's own
per-call key building (the Triton ops launch every layer's kernels through it).
"""
from __future__ import annotations

import inspect
import os

import triton
from triton.runtime.autotuner import Autotuner

from .backend import autotuning, interpreted

_HAS_CACHE = "cache_results" in inspect.signature(triton.autotune).parameters


def cache_enabled() -> bool:
    v = os.environ.get("LM_TRITON_AUTOTUNE_CACHE", "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"LM_TRITON_AUTOTUNE_CACHE={v!r} must be 0 or 1 (or unset)")
    # (not under the interpreter: nothing is timed there, and triton 3.6 would still look for a GPU target)
    return _HAS_CACHE and v == "1" and not interpreted()


def tuning(op: str) -> tuple[bool, bool, bool]:
    """(interpreted(), autotuning(op), cache_enabled()) now: the settings `op`'s autotuners are built for (the key of
    the module's cached builder)."""
    return interpreted(), autotuning(op), cache_enabled()


def autotune(configs, key, cache: bool, **kwargs):
    """triton.autotune(configs, key, **kwargs), keeping its choices on disk if `cache` (see the module docstring)."""
    if cache:
        kwargs.setdefault("cache_results", True)
    return triton.autotune(configs=configs, key=key, **kwargs)


_BEST = {}  # launch key -> the autotuner's chosen config as launch kwargs (see launch)


def launch(tuner, key, grid, args, kw):
    """tuner[grid](*args, **kw) for a triton Autotuner `tuner`. Autotuner.run rebuilds its key from all the
    arguments on every call (30 - 70 us of host time per launch); so the first call per `key` goes through it
    and the config it chose is kept, and later calls launch the jitted kernel with that config directly. `key`
    must fix the autotuner's own key (shapes in it, tensor dtypes): it only selects a config, so a coarser key
    could cost speed, never correctness. Anything else than an Autotuner (a test's wrapper) is called plainly."""
    if not isinstance(tuner, Autotuner) or tuner.reset_to_zero or tuner.restore_value:
        tuner[grid](*args, **kw)
        return
    key = (id(tuner), id(tuner.configs), key)  # a test may swap the configs list
    meta = _BEST.get(key)
    if meta is None:
        tuner[grid](*args, **kw)
        if len(_BEST) > 4096:
            _BEST.clear()
        _BEST[key] = tuner.best_config.all_kwargs()
        return
    tuner.fn[grid(meta) if callable(grid) else grid](*args, **kw, **meta)
