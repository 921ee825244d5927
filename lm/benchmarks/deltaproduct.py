"""Benchmark and check the (Gated) DeltaProduct chunk op: ours (Triton) vs fla 0.6.0 `chunk_gated_delta_product`.

    lm bench deltaproduct [--B 8 --T 2048 --H 16 --K 128 --V 256 --nh 1 2 3] [--json out.json]

Per n_h it times (triton.testing.do_bench, warmup 50 ms, rep 300 ms, median; bf16, random non-zero inputs,
gated): our forward without grad (the path the implicit models use; saves nothing), our forward with grad
enabled (also writes the chunk states for backward), our forward+backward, and fla's forward (fla's
backward is refused on triton 3.6 Hopper). It also checks, at the bench shape, our output against fla's and
against a float64 reference on a slice of the batch (relative error, forward and every gradient).
fla is optional: without it only our numbers are reported. --quick runs tiny shapes (CPU interpreter).

On CUDA it also prints each compiled kernel's registers and spills (triton's metadata). --decode times the
decode step instead. `bash scripts/gpu_session.sh kernels` runs it on a GPU machine; the current figures are in
docs/performance.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from lm_kernels.backend import triton_available


def compile_stats():
    """Per compiled Triton kernel of the op: registers, spills, warps, stages, shared memory (from triton's own
    caches; CUDA only). The kernels run fixed configs (lm_kernels/deltaproduct/configs.py): nothing is autotuned."""
    from lm_kernels.deltaproduct import bwd, bwd_state, fwd, prep
    out = []
    for name, obj in ((n, getattr(m, n)) for m in (prep, fwd, bwd_state, bwd) for n in dir(m)):
        if not name.startswith("_") or not name.endswith("_kernel"):
            continue
        fn = obj
        while hasattr(fn, "fn") and not hasattr(fn, "device_caches"):
            fn = fn.fn
        for dev_cache in getattr(fn, "device_caches", {}).values():
            kc = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for ck in kc.values():
                md = ck.metadata
                out.append(dict(kernel=name, n_regs=getattr(ck, "n_regs", None), n_spills=getattr(ck, "n_spills", None),
                                num_warps=getattr(md, "num_warps", None), num_stages=getattr(md, "num_stages", None),
                                shared=getattr(md, "shared", None)))
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def make_inputs(B, T, H, K, V, nh, device, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T * nh, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T * nh, H, V, generator=gen)
    beta = torch.rand(B, T * nh, H, generator=gen) * 2  # [0, 2]
    g = -torch.rand(B, T, H, generator=gen) * 0.1  # log decay
    h0 = torch.randn(B, H, K, V, generator=gen) * 0.1
    q, k, v, beta = (x.to(device=device, dtype=dtype) for x in (q, k, v, beta))
    return q, k, v, beta, g.to(device=device, dtype=torch.float32), h0.to(device=device, dtype=torch.float32)


def bench(fn, quick):
    if quick:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def kernel_breakdown(fn, iters=5):
    """Device time per kernel name (ms per call of fn), from torch.profiler: the 12 largest."""
    from lm.benchmarks import kernel_times
    return {k[:60]: v for k, v in list(kernel_times(fn, iters).items())[:12]}


def check_vs_reference(q, k, v, beta, g, h0, nh, n_check):
    """Our bf16 Triton forward and gradients vs the float64 reference on the first n_check sequences."""
    from lm_kernels.deltaproduct import chunk_deltaproduct
    sl = slice(0, n_check)
    ins = [x[sl].detach() for x in (q, k, v, beta, g, h0)]
    gen = torch.Generator(device="cpu").manual_seed(1)
    B, T, H, _ = ins[0].shape
    wo = torch.randn(B, T, H, v.shape[-1], generator=gen, dtype=torch.float64).to(q.device)
    ws = torch.randn(*ins[5].shape, generator=gen, dtype=torch.float64).to(q.device)
    res = {}
    for backend, dt in (("reference", torch.float64), ("triton", None)):
        leaves = [(x.to(dt) if dt is not None else x).clone().requires_grad_(True) for x in ins]
        o, s = chunk_deltaproduct(*leaves[:5], num_householder=nh, initial_state=leaves[5],
                                  output_final_state=True, backend=backend)
        ((o.double() * wo).sum() + (s.double() * ws).sum()).backward()
        res[backend] = [o.detach(), s.detach()] + [x.grad for x in leaves]
    names = ["o", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dh0"]
    out = {n: rel(a, b) for n, a, b in zip(names, res["triton"], res["reference"])}
    out["finite"] = all(bool(torch.isfinite(a).all()) for a in res["triton"])
    return out


def bench_decode(a):
    """Per nh: one decode step (B sequences, H heads, K, V; bf16 q / k / v, float32 gates and state, L2 norm, gated)
    through the Triton kernel and through the PyTorch reference step (do_bench medians, or one host-timed call with
    --quick), and the Triton step's relative error against the float64 reference."""
    from lm_kernels.deltaproduct import deltaproduct_step
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for nh in a.nh:
        gen = torch.Generator(device="cpu").manual_seed(nh)
        S = torch.randn(a.B, a.H, a.K, a.V, generator=gen) * 0.1
        q = torch.randn(a.B, a.H, a.K, generator=gen)
        k = torch.randn(a.B, nh, a.H, a.K, generator=gen)
        v = torch.randn(a.B, nh, a.H, a.V, generator=gen)
        beta = torch.rand(a.B, nh, a.H, generator=gen) * 2
        g = -torch.rand(a.B, a.H, generator=gen) * 0.1
        f32 = [x.to(device) for x in (S, q, k, v, beta, g)]
        ins = [f32[0], *(x.to(dtype) for x in f32[1:4]), f32[4], f32[5]]
        r = dict(nh=nh, B=a.B, H=a.H, K=a.K, V=a.V)
        for be in ("triton", "reference"):
            def call(be=be):
                return deltaproduct_step(*ins, use_qk_l2norm=True, backend=be)
            call()
            r[f"{be}_us"] = bench(call, a.quick) * 1e3
        o64, s64 = deltaproduct_step(*(x.double() for x in f32), use_qk_l2norm=True, backend="reference")
        o, s = deltaproduct_step(*ins, use_qk_l2norm=True, backend="triton")
        r["rel_err_o"], r["rel_err_state"] = rel(o, o64), rel(s, s64)
        r["speedup"] = r["reference_us"] / r["triton_us"]
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(decode=rows), f, indent=1)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=256)
    p.add_argument("--nh", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--check-batch", type=int, default=1, help="sequences checked against float64 (0: skip)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--quick", action="store_true", help="tiny shapes, host timer (CPU interpreter debug)")
    p.add_argument("--profile", action="store_true", help="per-kernel device times (CUDA only)")
    p.add_argument("--decode", action="store_true",
                   help="time the decode step instead (one token, batch B, gated, L2 norm): Triton kernel vs the "
                        "PyTorch reference step, and check it against float64")
    a = p.parse_args(argv)
    if a.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if a.decode:
        return bench_decode(a)
    from lm_kernels.deltaproduct import chunk_deltaproduct

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        from fla.ops.gated_delta_product import chunk_gated_delta_product as fla_fwd
    except Exception as e:  # optional peer
        print(f"fla not available ({type(e).__name__}: {e}); reporting ours only", file=sys.stderr)
        fla_fwd = None
    if device != "cuda":
        fla_fwd = None
    rows = []
    info = dict(device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
                dtype=str(dtype), shape=dict(B=a.B, T=a.T, H=a.H, K=a.K, V=a.V), gated=True)
    if triton_available():
        import triton
        info["triton"] = triton.__version__
    for nh in a.nh:
        q, k, v, beta, g, h0 = make_inputs(a.B, a.T, a.H, a.K, a.V, nh, device, dtype)
        rows.append(run_one(a, nh, q, k, v, beta, g, h0, device, fla_fwd, chunk_deltaproduct))
        del q, k, v, beta, g, h0
        if device == "cuda":
            torch.cuda.empty_cache()
    finish(a, info, rows, dtype, device)
    return rows


def run_one(a, nh, q, k, v, beta, g, h0, device, fla_fwd, chunk_deltaproduct):
    """Timings (and with fla its forward and our error against it), the profile and the float64 check at one nh."""
    r = dict(nh=nh)

    def ours_fwd():
        return chunk_deltaproduct(q, k, v, beta, g, num_householder=nh, backend="triton")

    with torch.no_grad():
        r["ours_fwd_nograd_ms"] = bench(ours_fwd, a.quick)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, beta, g)]
    do = torch.randn_like(v[:, :a.T])

    def ours_fwd_grad():
        return chunk_deltaproduct(*leaves, num_householder=nh, backend="triton")

    def ours_fwd_bwd():
        o, _ = chunk_deltaproduct(*leaves, num_householder=nh, backend="triton")
        torch.autograd.grad(o, leaves, do)

    r["ours_fwd_grad_ms"] = bench(ours_fwd_grad, a.quick)
    r["ours_fwd_bwd_ms"] = bench(ours_fwd_bwd, a.quick)
    r["ours_bwd_over_fwd"] = r["ours_fwd_bwd_ms"] / r["ours_fwd_grad_ms"]  # fwd+bwd over fwd with grad
    r["ours_fwdbwd_over_nograd_fwd"] = r["ours_fwd_bwd_ms"] / r["ours_fwd_nograd_ms"]
    if fla_fwd is not None:
        def fla_call():
            return fla_fwd(q, k, v, g, beta, num_householder=nh)

        with torch.no_grad():
            r["fla_fwd_ms"] = bench(fla_call, a.quick)
            o_fla = fla_call()[0]
            o_ours = ours_fwd()[0]
        r["ratio_nograd_fwd_vs_fla"] = r["ours_fwd_nograd_ms"] / r["fla_fwd_ms"]
        r["ratio_grad_fwd_vs_fla"] = r["ours_fwd_grad_ms"] / r["fla_fwd_ms"]
        r["rel_err_ours_vs_fla_o"] = rel(o_ours, o_fla)
    if a.profile and device == "cuda":
        with torch.no_grad():
            r["kernels_fwd_nograd_ms"] = kernel_breakdown(ours_fwd)
        r["kernels_fwd_bwd_ms"] = kernel_breakdown(ours_fwd_bwd)
        if fla_fwd is not None:
            with torch.no_grad():
                r["kernels_fla_fwd_ms"] = kernel_breakdown(fla_call)
    if a.check_batch > 0:
        r["check_vs_float64"] = check_vs_reference(q, k, v, beta, g, h0, nh, a.check_batch)
    print(json.dumps(r), flush=True)
    return r


def finish(a, info, rows, dtype, device):
    if device == "cuda":
        info["compile_stats"] = compile_stats()
        for cs in info["compile_stats"]:
            print("compile:", json.dumps(cs), flush=True)
    hdr = f"{'nh':>3} {'ours fwd':>9} {'ours fwd(g)':>11} {'ours f+b':>9} {'fla fwd':>8} " \
          f"{'ours/fla':>9} {'(g)/fla':>9} " \
          f"{'f+b/fwd':>8} {'f+b/fwd(g)':>10} {'err o':>8} {'worst grad err':>15}"
    print(f"\nDeltaProduct chunk op, {info['device']}, B{a.B} T{a.T} H{a.H} K{a.K} V{a.V} {dtype}, gated "
          f"(ms, median)")
    print(hdr)
    for r in rows:
        chk = r.get("check_vs_float64", {})
        worst = max((v for n, v in chk.items() if n.startswith("d")), default=float("nan"))
        print(f"{r['nh']:>3} {r['ours_fwd_nograd_ms']:>9.3f} {r['ours_fwd_grad_ms']:>11.3f} "
              f"{r['ours_fwd_bwd_ms']:>9.3f} {r.get('fla_fwd_ms', float('nan')):>8.3f} "
              f"{r.get('ratio_nograd_fwd_vs_fla', float('nan')):>9.3f} "
              f"{r.get('ratio_grad_fwd_vs_fla', float('nan')):>9.3f} "
              f"{r['ours_fwdbwd_over_nograd_fwd']:>8.2f} "
              f"{r['ours_bwd_over_fwd']:>10.2f} "
              f"{chk.get('o', float('nan')):>8.1e} {worst:>15.1e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
