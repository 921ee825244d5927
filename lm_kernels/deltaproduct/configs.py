"""Launch configs of the DeltaProduct chunk kernels, shared by the kernel modules (autotune lists) and chunk.py.

Compiled GPU runs launch each kernel at one fixed (meta, num_warps, num_stages) config, the fastest measured on an
H100 at B8 T2048 H16 K128 V256 bf16 (docs/performance.md gives the candidates and their timings); a
one-entry autotune list compiles once and is never re-timed. The interpreter runs its own small config.
"""
from __future__ import annotations

import os

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# name -> (meta, num_warps, num_stages): prep, fwd, bwd_state = the kernels of those modules; main = the one-kernel
# backward of one-slice key heads, qk / wy = the backward of key heads of two or more K slices (the state loop on K
# slices, then the WY terms; bwd.py)
BASE = {"prep": ({}, 2, 1), "fwd": ({"BV": 64}, 4, 1), "bwd_state": ({}, 4, 2), "main": ({"BV": 32}, 8, 4),
        "qk": ({"BV": 32}, 4, 4), "wy": ({"BV": 64}, 4, 3)}
MAIN_NH1 = ({"BV": 32}, 8, 5)  # the one-kernel backward at nh = 1: one more pipeline stage
WY_WIDE_K = ({"BV": 64}, 8, 3)  # the WY kernel for K > 128: at 4 warps its [BT, K] tiles spill (2.6 KB at K = 256)


def base_configs(name, interpret_meta=None):
    """The autotune list of kernel `name`: its BASE config, or the interpreter's (4 warps, 1 stage, interpret_meta)."""
    if INTERPRET:
        return [triton.Config(interpret_meta or {}, num_warps=4, num_stages=1)]
    meta, nw, ns = BASE[name]
    return [triton.Config(meta, num_warps=nw, num_stages=ns)]
