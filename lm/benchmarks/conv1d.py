#!/usr/bin/env python
"""Benchmark the depthwise causal conv1d: ours (lm_kernels.conv1d, Triton) vs the PyTorch path the models
ran before (causal_conv1d_reference: transpose + cat + F.conv1d + bias + SiLU), eager and, unless
--no-compile, under torch.compile (what the per-block compiled training ran).

x is what the models pass: a split view of the input projection (stride(1) = projection width), in bf16.
Times (triton.testing.do_bench, median, same run) per shape:
  fwd (nograd)   forward under torch.no_grad (the fixed-point iterations)
  fwd            forward with inputs requiring grad (what training runs)
  fwd+bwd        forward + backward (gradients of x, weight, bias)
plus the bandwidth ours reaches (bytes of x, y, dy, dx moved once / time) and ours' relative difference
to the float32 reference (y and the gradients).

    lm bench conv1d --json out.json
    lm bench conv1d --tiny --no-compile     # CPU smoke test under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

# name: (batch, seqlen, channels, width, projection width, channel offset in it, bias, number of documents)
SHAPES = {
    "mamba2_350m_B8": (8, 2048, 2304, 4, 4384, 2048, True, 0),
    "mamba2_350m_B16": (16, 2048, 2304, 4, 4384, 2048, True, 0),
    "deltaproduct_392m_B8": (8, 2048, 5120, 4, 5136, 0, False, 0),
    "mamba2_350m_packed_T16384": (1, 16384, 2304, 4, 4384, 2048, True, 40),
}
TINY = {"tiny": (2, 24, 32, 4, 48, 8, True, 0), "tiny_packed": (1, 24, 32, 4, 48, 8, True, 3)}


def make_inputs(shape, device, dtype, seed=0):
    b, t, c, w, width, off, has_bias, n_docs = shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    proj = torch.randn(b, t, width, generator=g).to(device=device, dtype=dtype)
    x = proj[..., off:off + c].detach().requires_grad_()  # a non-contiguous leaf view, as the model's split
    weight = (torch.randn(c, w, generator=g) / w ** 0.5).to(device=device, dtype=dtype).requires_grad_()
    bias = torch.randn(c, generator=g).to(device=device, dtype=dtype).requires_grad_() if has_bias else None
    cu = None
    if n_docs:
        cuts = torch.randperm(t - 1, generator=g)[: n_docs - 1].add(1).sort().values
        cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([t])]).to(device=device, dtype=torch.int32)
    gy = torch.randn(b, t, c, generator=g).to(device=device, dtype=dtype)
    return x, weight, bias, cu, gy


def bench(fn, warmup, rep):
    if torch.cuda.is_available():
        import triton.testing
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    fn()  # CPU smoke: one timed call
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def timings(f, x, weight, bias, cu, gy, warmup, rep):
    leaves = [v for v in (x, weight, bias) if v is not None]

    def fwd():
        return f(x, weight, bias, cu_seqlens=cu)[0]

    def fwd_nograd():
        with torch.no_grad():
            return fwd()

    def fwd_bwd():
        y = fwd()
        return torch.autograd.grad(y, leaves, gy)

    return {"fwd_nograd_ms": bench(fwd_nograd, warmup, rep), "fwd_ms": bench(fwd, warmup, rep),
            "fwd_bwd_ms": bench(fwd_bwd, warmup, rep)}, fwd_bwd


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def autotuned_configs():
    from lm_kernels.conv1d import triton_conv1d as T

    out = {}
    for name in ("_fwd", "_bwd"):
        tuner = getattr(T, name)
        out[name.strip("_")] = {str(k): str(v) for k, v in getattr(tuner, "cache", {}).items()}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--shapes", default=None, help="comma-separated names from SHAPES (default: all)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd PyTorch path")
    ap.add_argument("--compile-shapes", default="mamba2_350m_B8",
                    help="comma-separated shapes that also time the torch.compile'd PyTorch path ('all': every "
                         "shape; each shape costs a compile)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--rep", type=int, default=300)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--profile", action="store_true", help="per-kernel device time of ours' fwd+bwd (torch.profiler)")
    args = ap.parse_args(argv)

    from lm_kernels.conv1d import causal_conv1d, causal_conv1d_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.profile and device == "cuda":
        from lm.benchmarks import kernel_times
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = TINY if args.tiny else SHAPES
    if args.shapes:
        shapes = {k: shapes[k] for k in args.shapes.split(",")}

    def ours(x, w, b, cu_seqlens=None):
        return causal_conv1d(x, w, b, cu_seqlens=cu_seqlens, backend="triton")

    compiled = None if args.no_compile else torch.compile(causal_conv1d_reference)

    res = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "dtype": str(dtype), "shapes": {}}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None  # not installed: only the PyTorch paths run
    header = (f"{'shape':28s} {'path':15s} {'fwd nograd':>11s} {'fwd':>9s} {'fwd+bwd':>9s}  "
              f"{'ours/path: fwd':>14s} {'f+b':>6s}")
    print(header)
    print("-" * len(header))
    for name, shape in shapes.items():
        b, t, c, w = shape[:4]
        x, weight, bias, cu, gy = make_inputs(shape, device, dtype)
        paths = {"ours": ours, "torch": causal_conv1d_reference}
        if compiled is not None and (args.compile_shapes == "all" or args.tiny or name in args.compile_shapes.split(",")):
            paths["torch_compiled"] = compiled
        row = {"shape": dict(zip(("batch", "seqlen", "channels", "width", "proj_width", "offset", "bias", "docs"),
                                 shape))}
        # accuracy of ours and of the bf16 PyTorch path against the float32 PyTorch path
        x32, w32, b32 = (v.detach().float().requires_grad_() if v is not None else None for v in (x, weight, bias))
        y32 = causal_conv1d_reference(x32, w32, b32, cu_seqlens=cu)[0]
        g32 = torch.autograd.grad(y32, [v for v in (x32, w32, b32) if v is not None], gy.float())
        for pname, f in paths.items():
            try:
                times, fb = timings(f, x, weight, bias, cu, gy, args.warmup, args.rep)
            except Exception as e:  # noqa: BLE001 (a failing path is reported, the others still run)
                row[pname] = {"error": f"{type(e).__name__}: {e}"[:500]}
                print(f"{name:28s} {pname:15s} failed: {row[pname]['error'][:120]}")
                continue
            y = f(x, weight, bias, cu_seqlens=cu)[0]
            grads = fb()
            times["y_rel_vs_fp32"] = rel(y, y32)
            for gname, gv, gr in zip(("dx", "dweight", "dbias"), grads, g32):
                times[f"{gname}_rel_vs_fp32"] = rel(gv, gr)
            row[pname] = times
        o = row.get("ours", {})
        if args.profile and device == "cuda" and "fwd_ms" in o:
            o["profile_fwd_bwd"] = kernel_times(timings(ours, x, weight, bias, cu, gy, 1, 1)[1])
            print("    ours: " + ", ".join(f"{k[:40]} {v:.4f}" for k, v in list(o["profile_fwd_bwd"].items())[:8]))
        if "fwd_ms" in o:
            nbytes = b * t * c * x.element_size()
            o["fwd_GBps"] = 2 * nbytes / (o["fwd_nograd_ms"] * 1e-3) / 1e9  # read x, write y
            o["fwd_bwd_GBps"] = 5 * nbytes / (o["fwd_bwd_ms"] * 1e-3) / 1e9  # + read x, dy, write dx
        for pname in paths:
            p = row.get(pname, {})
            if "fwd_ms" not in p:
                continue
            ratio_f = o.get("fwd_ms", float("nan")) / p["fwd_ms"]
            ratio_fb = o.get("fwd_bwd_ms", float("nan")) / p["fwd_bwd_ms"]
            if pname != "ours":
                row[f"ours_over_{pname}"] = {"fwd": ratio_f, "fwd_bwd": ratio_fb,
                                             "fwd_nograd": o.get("fwd_nograd_ms", float("nan")) / p["fwd_nograd_ms"]}
            print(f"{name:28s} {pname:15s} {p['fwd_nograd_ms']:11.4f} {p['fwd_ms']:9.4f} {p['fwd_bwd_ms']:9.4f}  "
                  f"{ratio_f:14.3f} {ratio_fb:6.3f}")
        if "fwd_ms" in o:
            print(f"{'':28s} ours: {o['fwd_GBps']:.0f} GB/s fwd, {o['fwd_bwd_GBps']:.0f} GB/s fwd+bwd; rel vs fp32: "
                  f"y {o['y_rel_vs_fp32']:.1e} dx {o['dx_rel_vs_fp32']:.1e} dw {o['dweight_rel_vs_fp32']:.1e}")
        res["shapes"][name] = row
        del x, weight, bias, gy, x32, w32, b32, y32, g32
        if args.json:  # keep what is done if a later shape fails or the run is cut short
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1)
    if device == "cuda":
        res["autotuned"] = autotuned_configs()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
