"""Launch configs of the DeltaProduct chunk kernels (chunk.py launches them).

Compiled GPU runs launch each kernel at one fixed (meta, num_warps, num_stages) config, the fastest measured on an
H100 at B8 T2048 H16 K128 V256 bf16 (docs/performance.md gives the candidates and their timings): nothing is
autotuned. The interpreter runs its own small config (INTERPRETER).
"""
from __future__ import annotations

# name -> (meta, num_warps, num_stages): prep, fwd, bwd_state = the kernels of those modules; main = the one-kernel
# backward of one-slice key heads, qk / wy = the backward of key heads of two or more K slices (the state loop on K
# slices, then the WY terms; bwd.py)
BASE = {"prep": ({}, 2, 1), "fwd": ({"BV": 64}, 4, 1), "bwd_state": ({}, 4, 2), "main": ({"BV": 32}, 8, 4),
        "qk": ({"BV": 32}, 4, 4), "wy": ({"BV": 64}, 4, 3)}
MAIN_NH1 = ({"BV": 32}, 8, 5)  # the one-kernel backward at nh = 1: one more pipeline stage
WY_WIDE_K = ({"BV": 64}, 8, 3)  # the WY kernel for K > 128: at 4 warps its [BT, K] tiles spill (2.6 KB at K = 256)


# name -> the interpreter's config: 16-wide V blocks where the kernel's grid or loop takes BV from its config, so
# that tiny test heads cross V blocks
INTERPRETER = {name: ({"BV": 16} if name in ("fwd", "main", "qk", "wy") else {}, 4, 1) for name in BASE}
