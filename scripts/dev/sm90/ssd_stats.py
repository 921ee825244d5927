"""Registers / spills / shared memory of the SSD forward kernels compiled for sm_90 on a machine without a GPU,
specialised exactly as they are launched at a bench shape.

    python scripts/dev/sm90/ssd_stats.py [--shape B8_T2048] [--kernels chunk_scan_fwd4_kernel state_fwd_kernel]
        [--configs "BP=64,num_warps=4,maxnreg=168" ...] [--backward]

Run it in a process without TRITON_INTERPRET. The forward runs on CPU tensors of the bench shape with every
launch intercepted (nothing runs); each launch's arguments go through triton's own binder for a GPUTarget
("cuda", 90, 32), so pointer alignment and integer divisibility are specialised as on the GPU, then it is
compiled and read with cuobjdump / ptxas -v (shipped with triton). The GPU image's triton is 3.6: put
`pip install --no-deps --target /tmp/t36 triton==3.6.0` first on PYTHONPATH to get the H100's numbers (3.9's
code generation differs). --configs replaces the launch's meta-parameters / options.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90 import TARGET, per_sm, resources  # noqa: E402


def capture_forward(shape, save=True, env=None, dtype=torch.bfloat16, gate=False, backward=False):
    """[(JITFunction, args, kwargs)] of the launches of one forward at `shape` (lm.benchmarks.ssd's (b, t, h, p,
    n, g, chunk)) in `dtype` (with the gate z if `gate`; and of the backward after it if `backward`), with the
    first config of every autotuner (kwargs hold its meta-parameters and options)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from lm_kernels.ssd import launch as ln
    from lm_kernels.ssd import triton_ssd as ts
    got = []
    orig_run, orig_bench, orig_disk = JITFunction.run, Autotuner._bench, Autotuner.check_disk_cache

    def run(self, *args, grid=None, warmup=False, **kwargs):
        got.append((self, args, kwargs))

    def no_disk_cache(self, tuning_key, configs, bench_fn):  # (the disk cache asks the driver for a GPU target)
        bench_fn()
        return False

    JITFunction.run = run
    Autotuner._bench = lambda self, *a, config=None, **k: [0.0]
    Autotuner.check_disk_cache = no_disk_cache
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        b, t, h, p, n, g, chunk = shape
        x = torch.randn(b, t, h, p).to(dtype)
        dt = torch.randn(b, t, h).to(dtype)
        B = torch.randn(b, t, g, n).to(dtype)
        C = torch.randn(b, t, g, n).to(dtype)
        z = torch.randn(b, t, h, p).to(dtype) if gate else None
        A, D, bias = -torch.rand(h) - 0.5, torch.randn(h), torch.randn(h)
        plan = ln.plan(x, B, None, chunk)
        y, _, *aux = ts._forward(x, dt, A, B, C, D, z, bias, None, plan, True, (0.0, float("inf")), False,
                                 save or backward)
        aux = aux[:3]  # dt / cumsum, states, pre-gate output (not the sums of squares)
        if backward:
            ts._backward(torch.randn(y.shape).to(dtype), None, x, dt, A, B, C, D, z, bias, None, plan, True,
                         (0.0, float("inf")), *aux)
    finally:
        JITFunction.run, Autotuner._bench, Autotuner.check_disk_cache = orig_run, orig_bench, orig_disk
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return got


def compile_launch(fn, args, kwargs):
    """The CompiledKernel of fn(*args, **kwargs) for sm_90, specialised as triton's launcher would."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(TARGET)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {"debug": False, **kwargs}
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=TARGET, options=options.__dict__)


def _parse_cfg(s):
    out = {}
    for kv in s.split(","):
        k, _, v = kv.partition("=")
        out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    return out


def main(argv=None):
    from lm.benchmarks.ssd import SHAPES  # noqa: PLC0415
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="B8_T2048", choices=list(SHAPES))
    ap.add_argument("--kernels", nargs="*", default=["chunk_scan_fwd4_kernel", "state_fwd_kernel"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--gate", action="store_true", help="with the gate z (and, with grad, the pre-gate output stored)")
    ap.add_argument("--backward", action="store_true", help="also the backward's kernels (e.g. --kernels dx_bwd_kernel)")
    ap.add_argument("--configs", nargs="*", default=[""], help="overrides of the launch's meta-parameters / options "
                                                                "per compile, e.g. BP=64,num_warps=4,maxnreg=168")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("ssd_stats: unset TRITON_INTERPRET (it compiles for sm_90)")
    print("triton", triton.__version__)
    for fn, args, kwargs in capture_forward(SHAPES[a.shape], dtype=getattr(torch, a.dtype), gate=a.gate,
                                          backward=a.backward):
        if fn.__name__ not in a.kernels:
            continue
        for c in a.configs:
            kw = {**kwargs, **(_parse_cfg(c) if c else {})}
            r = resources(compile_launch(fn, args, kw))
            r["per_sm"] = per_sm(r["regs"], kw.get("num_warps", 4), r["shared"])
            shown = {k: kw[k] for k in ("BP", "BN", "BK", "num_warps", "num_stages", "maxnreg") if k in kw}
            print(f"{fn.__name__} {shown}: {r}", flush=True)


if __name__ == "__main__":
    main()
