"""`lm bench NAME [args]`: run the benchmark module lm.benchmarks.NAME (kernel and training benchmarks; GPU for
timings), and the per-kernel device-time breakdown those modules share. `--quick` / `--tiny` (the benchmarks' CPU
smoke modes) run the Triton kernels in triton's interpreter on a machine without CUDA. Developer tools (the step's
floor, saved-tensor accounting, Nsight Compute and sm_90 compile statistics) are in scripts/dev/."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path


def names() -> list[str]:
    return sorted(p.stem for p in Path(__file__).parent.glob("*.py") if not p.stem.startswith("_"))


def main(argv: list[str]) -> int:
    available = names()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lm bench NAME [args]\n\nbenchmarks: " + ", ".join(available))
        return 0
    name = argv[0]
    if name not in available:
        print(f"lm bench: unknown benchmark {name!r}; available: {', '.join(available)}", file=sys.stderr)
        return 2
    module = f"lm.benchmarks.{name}"
    if {"--quick", "--tiny"} & set(argv[1:]) and os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():
            # the smoke modes run the kernels in triton's CPU interpreter, which must be chosen before triton is
            # first imported: in a process of their own unless triton is not imported yet
            if "triton" in sys.modules:
                return subprocess.call([sys.executable, "-m", module, *argv[1:]],
                                       env={**os.environ, "TRITON_INTERPRET": "1"})
            os.environ["TRITON_INTERPRET"] = "1"
    sys.argv = [module, *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def kernel_times(fn, iters: int = 10) -> dict:
    """{CUDA kernel name: device ms per call of fn} over `iters` calls after one warm-up call (torch.profiler),
    largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        if t > 0 and e.device_type is not None and "cuda" in str(e.device_type).lower():
            out[e.key] = round(t / 1e3 / iters, 4)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
