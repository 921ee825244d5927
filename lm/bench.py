"""`lm bench NAME [args]`: run scripts/bench_NAME.py (kernel and training benchmarks; GPU for timings), and
the per-kernel device-time breakdown those scripts share."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys

from .models.presets import repo_root


def main(argv: list[str]) -> int:
    scripts = sorted(p.stem[len("bench_"):] for p in (repo_root() / "scripts").glob("bench_*.py"))
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lm bench NAME [args]\n\nbenchmarks: " + ", ".join(scripts))
        return 0
    name = argv[0]
    if name not in scripts:
        print(f"lm bench: unknown benchmark {name!r}; available: {', '.join(scripts)}", file=sys.stderr)
        return 2
    script = repo_root() / "scripts" / f"bench_{name}.py"
    if "--quick" in argv[1:] and os.environ.get("TRITON_INTERPRET") != "1":
        # the CPU-interpreter mode must be set before triton is first imported, which `lm` has done by now
        return subprocess.call([sys.executable, str(script), *argv[1:]], env={**os.environ, "TRITON_INTERPRET": "1"})
    sys.argv = [f"bench_{name}.py", *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")
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
