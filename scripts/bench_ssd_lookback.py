"""Time the look-back SSD forward experiment (kernels/ssd/triton_lookback.py) against the op's no-grad forward
(ssd_scan_triton: dtcb + state + scan kernels) in one process; kernel times from torch.profiler, wall from
do_bench. Prints a table and writes JSON. GPU only (bf16).

    python scripts/bench_ssd_lookback.py --json out.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from lm_kernels.ssd.triton_lookback import prepare, ssd_forward_lookback
from lm_kernels.ssd.triton_ssd import ssd_scan_triton


def kernel_ms(fn, iters=20):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            out[e.key[:60]] = round(t / iters / 1000, 4)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["8x2048", "2x8192"])
    ap.add_argument("--warps", nargs="+", default=["4", "8"], help="num_warps[:maxnreg] per lookback launch")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    H, P, N, G, L = 64, 64, 128, 1, 256
    rows = []
    for shp in a.shapes:
        b, T = (int(v) for v in shp.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(b, T, H, P, device="cuda", generator=g).bfloat16()
        dt = (torch.randn(b, T, H, device="cuda", generator=g) * 0.5 - 1).bfloat16()
        A = -torch.rand(H, device="cuda", generator=g) * 4 - 0.5
        B = (torch.randn(b, T, G, N, device="cuda", generator=g) * 0.5).bfloat16()
        C = (torch.randn(b, T, G, N, device="cuda", generator=g) * 0.5).bfloat16()
        D = torch.randn(H, device="cuda", generator=g)
        bias = torch.randn(H, device="cuda", generator=g) * 0.1
        with torch.no_grad():
            op = lambda: ssd_scan_triton(x, dt, A, B, C, chunk_size=L, D=D, dt_bias=bias)  # noqa: E731
            y_ref = op()
            y_ref = y_ref[0] if isinstance(y_ref, tuple) else y_ref
            dtp, cs, CB = prepare(x, dt, A, B, C, dt_bias=bias, chunk_size=L)
            row = dict(shape=shp, op_wall_ms=triton.testing.do_bench(op, warmup=50, rep=300),
                       op_kernels=kernel_ms(op))
            for w in a.warps:
                nw, _, cap = w.partition(":")
                lb = lambda: ssd_forward_lookback(x, B, C, D, dtp, cs, CB, chunk_size=L, num_warps=int(nw),  # noqa: E731
                                                  maxnreg=int(cap) if cap else None)
                y = lb()
                err = ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
                row[f"lb_w{w}"] = dict(wall_ms=triton.testing.do_bench(lb, warmup=50, rep=300), kernels=kernel_ms(lb),
                                       rel_err_vs_op=err)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\nshape     op no-grad wall  op kernels (scan+state+dtcb)  lookback wall / kernel (warps)")
    for r in rows:
        ks = r["op_kernels"]
        tot = sum(v for k, v in ks.items() if "kernel" in k and ("scan" in k or "state" in k or "dtcb" in k))
        s = f"{r['shape']:>8}  {r['op_wall_ms']:.3f}           {tot:.3f}                       "
        for w in a.warps:
            lw = r[f"lb_w{w}"]
            kk = lw["kernels"].get("lb_scan_fwd_kernel", float("nan"))
            s += f" {lw['wall_ms']:.3f} / {kk:.3f} (w{w}, err {lw['rel_err_vs_op']:.1e})"
        print(s)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
