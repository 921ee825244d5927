#!/usr/bin/env python
"""Driver for Nsight Compute: one forward + backward of the SSD (or the DeltaProduct op) per labelled case
inside a profiler range.

    ncu --profile-from-start off --clock-control none --set detailed python scripts/dev/ncu_ssd.py \
        [--shape B8_T2048] [--cases "ours=" "mamba="] [--nograd]
    ... python scripts/dev/ncu_ssd.py --op deltaproduct --nh 2 --cases "ours=" "fla="   (B8 T2048 H16 K128 V256 bf16;
        fla's chunk_gated_delta_product runs its forward only: its backward is refused on triton 3.6 Hopper)

Every case is first run `--warmup` times outside the range (autotuning, compilation), then once inside it,
so ncu reports exactly one launch per kernel per case, in the order of --cases. A case is NAME=ENV (ENV:
comma-separated LM_*=VALUE for ours, set around its calls; read at call time); the name "mamba" runs mamba_ssm's mamba_chunk_scan_combined
(PYTHONPATH to its sources), "fla" fla's DeltaProduct forward. Without ncu it runs the same calls and prints what it would profile.
"""
from __future__ import annotations

import argparse
import os

import torch

from lm.benchmarks.ssd import SHAPES, make_inputs, ours_fn, peer_fn, with_grad


class env_set:
    """Sets environment variables for a with-block and restores them after."""

    def __init__(self, env):
        self.env, self.saved = env, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_case(spec):
    name, _, env = spec.partition("=")
    kv = dict(x.split("=", 1) for x in env.split(",") if x)
    return name, kv


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="B8_T2048", choices=sorted(SHAPES))
    ap.add_argument("--cases", nargs="+", default=["ours=", "mamba="])
    ap.add_argument("--nograd", action="store_true", help="profile the no-grad forward instead of forward + backward")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--op", default="ssd", choices=["ssd", "deltaproduct"])
    ap.add_argument("--nh", type=int, default=2, help="DeltaProduct: Householder steps per token")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ncu_ssd.py needs a CUDA device")
    runs = _deltaproduct_runs(a) if a.op == "deltaproduct" else _ssd_runs(a)
    for name, env, run in runs:
        with env_set(env):
            for _ in range(a.warmup):
                run()
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    for name, env, run in runs:
        print(f"== case {name} {env}", flush=True)
        with env_set(env):
            torch.cuda.synchronize()
            cudart.cudaProfilerStart()
            run()
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()


def _deltaproduct_runs(a):
    from lm.benchmarks.deltaproduct import make_inputs as dp_inputs

    from lm_kernels.deltaproduct import chunk_deltaproduct
    q, k, v, beta, g, _ = dp_inputs(8, 2048, 16, 128, 256, a.nh, "cuda", torch.bfloat16)
    runs = []
    for spec in a.cases:
        name, env = parse_case(spec)
        if name == "fla":
            from fla.ops.gated_delta_product import chunk_gated_delta_product as fla_fwd

            def run(fla_fwd=fla_fwd):
                with torch.no_grad():
                    fla_fwd(q, k, v, g, beta, num_householder=a.nh)
        else:
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v, beta, g)]
            do = torch.randn_like(v[:, :q.shape[1]])

            def run(leaves=leaves, do=do):
                if a.nograd:
                    with torch.no_grad():
                        chunk_deltaproduct(q, k, v, beta, g, num_householder=a.nh, backend="triton")
                else:
                    o, _ = chunk_deltaproduct(*leaves, num_householder=a.nh, backend="triton")
                    torch.autograd.grad(o, leaves, do)
        runs.append((name, env, run))
    return runs


def _ssd_runs(a):
    shape = SHAPES[a.shape]
    inp = make_inputs(shape, "cuda", torch.bfloat16)
    gy = torch.randn(shape[0], shape[1], shape[2], shape[3], device="cuda", dtype=torch.bfloat16)
    runs = []
    for spec in a.cases:
        name, env = parse_case(spec)
        gi = with_grad(inp)
        f = peer_fn(gi, shape[-1]) if name == "mamba" else ours_fn(gi, shape[-1])

        def run(f=f):
            if a.nograd:
                with torch.no_grad():
                    f()
            else:
                f().backward(gy)
        runs.append((name, env, run))
    return runs


if __name__ == "__main__":
    main()
