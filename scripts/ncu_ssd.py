#!/usr/bin/env python
"""Driver for Nsight Compute: one forward + backward of the SSD per labelled case inside a profiler range.

    ncu --profile-from-start off --clock-control none --set detailed python scripts/ncu_ssd.py \
        [--shape B8_T2048] [--cases "ours=" "ours_dxfact0=LM_SSD_DXFACT=0" "mamba="] [--nograd]

Every case is first run `--warmup` times outside the range (autotuning, compilation), then once inside it,
so ncu reports exactly one launch per kernel per case, in the order of --cases. A case is NAME=ENV (ENV:
comma-separated LM_SSD_*=VALUE for ours); the name "mamba" runs mamba_ssm's mamba_chunk_scan_combined
(PYTHONPATH to its sources). Without ncu it runs the same calls and prints what it would profile.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ssd import SHAPES, env_set, make_inputs, ours_fn, peer_fn, with_grad  # noqa: E402


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
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ncu_ssd.py needs a CUDA device")
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


if __name__ == "__main__":
    main()
