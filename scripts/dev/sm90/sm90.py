"""Reading a Triton kernel compiled for sm_90 on a machine without a GPU: registers, stack, spill bytes and shared
memory (with the cuobjdump / ptxas that triton ships), and how many programs fit on an H100 SM. Used by the
scripts beside it (ssd_stats.py, ...). Put the GPU image's triton (3.6) first on
PYTHONPATH to get the H100's numbers (3.9's code generation differs)."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

TARGET = GPUTarget("cuda", 90, 32)


def resources(k):
    """{regs, stack, shared, spill_st, spill_ld} of a CompiledKernel (cuobjdump -res-usage; ptxas -v)."""
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        cub = os.path.join(d, "k.cubin")
        with open(cub, "wb") as f:
            f.write(k.asm["cubin"])
        out = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", cub], capture_output=True,
                             text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        sp = None
        for exe in ("ptxas", "ptxas-blackwell"):
            path = os.path.join(bindir, exe)
            if not os.path.exists(path):
                continue
            v = subprocess.run([path, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(d, "k.o")],
                               capture_output=True, text=True).stderr
            sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", v)
            if sp:
                break
    return dict(regs=int(m.group(1)), stack=int(m.group(2)), shared=k.metadata.shared,
                spill_st=int(sp.group(1)) if sp else None, spill_ld=int(sp.group(2)) if sp else None)


def per_sm(regs, warps, shared, smem_sm=233472, smem_block_reserved=1024):
    """Programs per SM that the registers (64k per SM, allocated per warp in units of 256) and the shared
    memory (228 KB per SM, 1 KB reserved per block) allow; at most 64 warps."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = 65536 // (per_warp * warps)
    by_smem = smem_sm // (shared + smem_block_reserved) if shared else 99
    return min(by_regs, by_smem, 64 // warps)
