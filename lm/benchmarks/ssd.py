#!/usr/bin/env python
"""Benchmark the SSD chunk scan: ours (lm_kernels.ssd, Triton) vs mamba_ssm's mamba_chunk_scan_combined.

Times (triton.testing.do_bench, median, bf16, random non-zero inputs, same run) per shape:
  fwd          forward with inputs requiring grad (what training runs)
  fwd+bwd      forward + backward
  nograd fwd   our forward under torch.no_grad (the fixed-point iterations), against mamba's fwd
and prints ratios ours/mamba_ssm, the accuracy of both against each other, and a per-kernel time
breakdown from torch.profiler. mamba_ssm is optional (PYTHONPATH to its ops/triton sources).

    lm bench ssd --json out.json
    lm bench ssd --tiny --no-peer        # CPU smoke test under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import defaultdict

import torch

SHAPES = {  # name: (batch, seqlen, nheads, headdim, dstate, ngroups, chunk)
    "B8_T2048": (8, 2048, 64, 64, 128, 1, 256),
    "B2_T8192": (2, 8192, 64, 64, 128, 1, 256),
    # Mamba2-350M's layer in the training step (micro-batch 16), at three chunk sizes (the model's chunk_size)
    "B16_T2048_H32_c256": (16, 2048, 32, 64, 128, 1, 256),
    "B16_T2048_H32_c128": (16, 2048, 32, 64, 128, 1, 128),
    "B16_T2048_H32_c64": (16, 2048, 32, 64, 128, 1, 64),
}
TINY = {"tiny": (1, 64, 2, 16, 16, 1, 32)}
TARGETS = {"fwd": 0.6, "fwd+bwd": 0.7, "nograd_fwd": 0.5}


def make_inputs(shape, device, dtype, seed=0):
    b, t, h, p, n, g, _ = shape
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(device)

    return dict(
        x=r(b, t, h, p).to(dtype), dt=r(b, t, h, scale=0.5).to(dtype),
        A=-torch.exp(r(h, scale=0.5)), B=r(b, t, g, n).to(dtype), C=r(b, t, g, n).to(dtype),
        D=r(h), dt_bias=r(h, scale=0.5) - 2.0,
    )


def ours_fn(inp, chunk):
    from lm_kernels.ssd import ssd_scan

    def f():
        return ssd_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size=chunk, D=inp["D"],
                        dt_bias=inp["dt_bias"], dt_softplus=True, backend="triton")[0]
    return f


def peer_fn(inp, chunk):
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    def f():
        return mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, D=inp["D"],
                                         dt_bias=inp["dt_bias"], dt_softplus=True)
    return f


def bench(fn, warmup, rep, grad_to_none=None):
    if torch.cuda.is_available():
        import triton.testing
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    fn()  # CPU smoke: one timed call
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def with_grad(inp):
    return {k: v.detach().clone().requires_grad_() for k, v in inp.items()}


def fwd_bwd(f, gy):
    def run():
        f().backward(gy)
    return run


def host_ms(fn, n=50, reps=5):
    """Host time per call (ms): the least over `reps` runs of n calls queued without waiting for the device (the
    launch queue stays far from full), each run starting on an idle device."""
    if not torch.cuda.is_available():
        return float("nan")
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e3)
        torch.cuda.synchronize()
    return best


def autotuned_configs():
    """{kernel: {autotune key: chosen config}} of our autotuned kernels."""
    from triton.runtime.autotuner import Autotuner

    import lm_kernels.ssd.launch as ln
    out = {}
    for name, obj in vars(ln).items():
        objs = obj.items() if isinstance(obj, dict) else [("", obj)]
        for sub, o in objs:
            if isinstance(o, Autotuner) and getattr(o, "cache", None):
                out[f"{name}{'' if sub == '' else f'[{sub}]'}"] = {str(k): str(v) for k, v in o.cache.items()}
                tim = getattr(o, "configs_timings", None)  # the last tuning's ms per config (median first)
                if tim:
                    out[f"{name}{'' if sub == '' else f'[{sub}]'} timings"] = {
                        str(c): [round(float(x), 4) for x in (t if isinstance(t, (list, tuple)) else [t])]
                        for c, t in tim.items()}
    return out


def kernel_resources():
    """[{kernel, num_warps, regs, spills, shared, constants}] of every compiled SSD kernel in this process (from the
    JIT caches; registers / spill bytes as ptxas reported them). Best effort: [] where the Triton version differs."""
    out = []
    try:
        from triton.runtime.jit import JITFunction

        from lm_kernels.ssd import backward, backward_dx, chunk_scan, chunk_state, dt_cb
        kernels = {name: fn for m in (dt_cb, chunk_state, chunk_scan, backward, backward_dx)
                   for name, fn in vars(m).items() if name.endswith("_kernel") and isinstance(fn, JITFunction)}
        for name, fn in kernels.items():
            for entry in (getattr(fn, "device_caches", None) or {}).values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                for ck in list(cache.values()):
                    if getattr(ck, "n_regs", None) is None:
                        continue
                    consts = getattr(getattr(ck, "src", None), "constants", None) or {}
                    out.append(dict(kernel=name, num_warps=ck.metadata.num_warps, regs=ck.n_regs, spills=ck.n_spills,
                                    shared=ck.metadata.shared,
                                    constants={(fn.arg_names[k[0]] if isinstance(k, tuple) and len(k) == 1
                                                else str(k)): str(v) for k, v in consts.items()
                                               if str(v) in ("True", "False") or str(v).isdigit()}))
    except Exception as e:  # noqa: BLE001 (a report, never a reason to lose the run)
        out.append(dict(error=repr(e)[:300]))
    return out


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def profile_kernels(fns, iters=5):
    """{label: [(kernel name, mean ms per call of fn), ...]} for each (label, fn)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {}
    for label, fn in fns:
        fn()
        sync()
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(iters):
                fn()
            sync()
        acc = defaultdict(float)
        for ev in prof.key_averages():
            t = getattr(ev, "self_device_time_total", None) if cuda else ev.self_cpu_time_total
            if t is None:
                t = getattr(ev, "self_cuda_time_total", 0.0)
            if t > 0:
                acc[ev.key] += t / 1e3 / iters
        out[label] = sorted(acc.items(), key=lambda kv: -kv[1])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write results to this JSON file")
    ap.add_argument("--shapes", nargs="*", default=None, help=f"of {list(SHAPES)} (default: the first two)")
    ap.add_argument("--tiny", action="store_true", help="tiny shape (CPU smoke test)")
    ap.add_argument("--no-peer", action="store_true", help="skip mamba_ssm")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel breakdown")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--rep", type=int, default=300)
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    names = args.shapes or ["B8_T2048", "B2_T8192"]  # the shapes of docs/performance.md unless named
    shapes = TINY if args.tiny else {k: v for k, v in SHAPES.items() if k in names}
    peer = not args.no_peer
    if peer:
        try:
            peer_fn(make_inputs(next(iter(shapes.values())), device, dtype), 256)
        except ImportError as e:
            print(f"mamba_ssm not importable ({e}); timing ours only", file=sys.stderr)
            peer = False
    import triton
    result = dict(device=torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
                  torch=torch.__version__, triton=triton.__version__, dtype="bfloat16", targets=TARGETS,
                  shapes={})
    # Phase 1: every wall / host timing of every shape, before any profiling: torch.profiler's CUDA
    # activity leaves CUPTI attached after it ends (pytorch/pytorch#144455), which can add host time to every
    # launch after it (the shapes measured after a profile saw more host time per call).
    profile_jobs = []  # (shape name, [(label, fn)], top-k) for phase 2
    host_fns = {}
    for name, shape in shapes.items():
        chunk = shape[-1]
        inp = make_inputs(shape, device, dtype)
        gin = with_grad(inp)
        gy = torch.randn(shape[0], shape[1], shape[2], shape[3], device=device, dtype=dtype)
        row = dict(shape=dict(zip(["batch", "seqlen", "nheads", "headdim", "dstate", "ngroups", "chunk"], shape)))
        result["shapes"][name] = row  # filled in as it goes; saved at checkpoints (a run cut short keeps them)
        ours = ours_fn(gin, chunk)
        ours_ng = ours_fn(inp, chunk)
        t0 = time.time()
        ours()  # compile / autotune outside the timings
        fwd_bwd(ours, gy)()
        row["ours_first_call_s"] = round(time.time() - t0, 2)
        print(f"{name}: ours compiled / tuned in {row['ours_first_call_s']} s", flush=True)
        with torch.no_grad():
            row["ours_nograd_fwd_ms"] = bench(ours_ng, args.warmup, args.rep)
        row["ours_fwd_ms"] = bench(ours, args.warmup, args.rep)
        with torch.no_grad():
            row["ours_nograd_fwd_ms_repeat"] = bench(ours_ng, args.warmup, args.rep)  # spread of one version
            row["ours_nograd_host_ms"] = host_ms(ours_ng)
        row["ours_fwd_host_ms"] = host_ms(ours)
        row["ours_fwd_bwd_ms"] = bench(fwd_bwd(ours, gy), args.warmup, args.rep, grad_to_none=list(gin.values()))
        print(f"{name}: ours fwd {row['ours_fwd_ms']:.3f} ms, no-grad {row['ours_nograd_fwd_ms']:.3f}, fwd+bwd "
              f"{row['ours_fwd_bwd_ms']:.3f}; host ms per call no-grad {row['ours_nograd_host_ms']:.3f}, fwd "
              f"{row['ours_fwd_host_ms']:.3f}", flush=True)
        if args.json:
            write_json(args.json, result)
        theirs = None
        if peer:
            pin = with_grad(inp)
            theirs = peer_fn(pin, chunk)
            t0 = time.time()
            theirs()
            fwd_bwd(theirs, gy)()
            row["mamba_first_call_s"] = round(time.time() - t0, 2)
            row["mamba_fwd_ms"] = bench(theirs, args.warmup, args.rep)
            row["mamba_fwd_host_ms"] = host_ms(theirs)
            row["mamba_fwd_bwd_ms"] = bench(fwd_bwd(theirs, gy), args.warmup, args.rep,
                                            grad_to_none=list(pin.values()))
            with torch.no_grad():
                row["mamba_nograd_fwd_ms"] = bench(peer_fn(inp, chunk), args.warmup, args.rep)
                row["mamba_nograd_host_ms"] = host_ms(peer_fn(inp, chunk))
            if args.json:
                write_json(args.json, result)
            row["ratio_nograd_vs_mamba_nograd"] = row["ours_nograd_fwd_ms"] / row["mamba_nograd_fwd_ms"]
            row["ratio_fwd"] = row["ours_fwd_ms"] / row["mamba_fwd_ms"]
            row["ratio_fwd_bwd"] = row["ours_fwd_bwd_ms"] / row["mamba_fwd_bwd_ms"]
            row["ratio_nograd_fwd"] = row["ours_nograd_fwd_ms"] / row["mamba_fwd_ms"]
            # agreement of the two implementations (both bf16 outputs, fp32 accumulation)
            for d in (gin, pin):
                for v in d.values():
                    v.grad = None
            yo, yp = ours(), theirs()
            yo.backward(gy)
            yp.backward(gy)
            row["ours_vs_mamba_rel"] = {"y": rel(yo, yp), **{f"d{k}": rel(gin[k].grad, pin[k].grad) for k in gin}}
        if not args.no_profile:  # (on CPU: the CPU ops, a dry run of phase 2)
            profile_jobs.append((name, [("ours fwd", ours), ("ours fwd+bwd", fwd_bwd(ours, gy))]
                                 + ([("mamba fwd", theirs), ("mamba fwd+bwd", fwd_bwd(theirs, gy))] if peer else []),
                                 14))
        host_fns[name] = (ours, ours_ng)
        row["autotuned"] = autotuned_configs()
        print_row(name, row)
        if args.json:  # after every shape, so a run cut short keeps what it measured
            write_json(args.json, result)
    # Phase 2: per-kernel device times (torch.profiler), then the host time per call once more (after profiling)
    for name, fns, top in profile_jobs:
        row = result["shapes"][name]
        try:
            row["kernels_ms"] = {k: [(n, round(t, 4)) for n, t in v[:top]] for k, v in profile_kernels(fns).items()}
            for label, ks in row["kernels_ms"].items():
                print(f"  {name} [{label}] " + ", ".join(f"{n[:40]}={t:.3f}" for n, t in ks[:10]), flush=True)
        except Exception as e:  # noqa: BLE001 (a report, never a reason to lose the run)
            print(f"profile {name} failed: {e!r}", file=sys.stderr)
        if args.json:
            write_json(args.json, result)
    if profile_jobs:
        for name, (ours, ours_ng) in host_fns.items():
            row = result["shapes"][name]
            with torch.no_grad():
                row["ours_nograd_host_ms_after_profile"] = host_ms(ours_ng)
            row["ours_fwd_host_ms_after_profile"] = host_ms(ours)
            print(f"{name}: host ms per call after profiling: no-grad {row['ours_nograd_host_ms_after_profile']:.3f}, "
                  f"fwd {row['ours_fwd_host_ms_after_profile']:.3f} (before: {row['ours_nograd_host_ms']:.3f}, "
                  f"{row['ours_fwd_host_ms']:.3f})", flush=True)
    del host_fns, profile_jobs
    result["kernel_resources"] = kernel_resources()
    for r in result["kernel_resources"]:
        if "error" in r or r["kernel"] in ("chunk_scan_fwd2_kernel", "chunk_scan_fwd4_kernel", "dx_bwd_kernel"):
            print("resources:", r)
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return result


def write_json(path, result):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def print_row(name, row):
    print(f"\n== {name} {row['shape']}")
    print(f"{'':14s}{'ours ms':>10s}{'mamba ms':>10s}{'ratio':>8s}{'target':>8s}")
    for key, label, tkey in (("fwd", "fwd", "fwd"), ("fwd_bwd", "fwd+bwd", "fwd+bwd"),
                             ("nograd_fwd", "nograd fwd", "nograd_fwd")):
        ours = row[f"ours_{key}_ms"]
        theirs = row.get("mamba_fwd_ms" if key == "nograd_fwd" else f"mamba_{key}_ms")
        ratio = row.get(f"ratio_{key}")
        print(f"{label:14s}{ours:10.3f}{theirs if theirs is not None else float('nan'):10.3f}"
              f"{ratio if ratio is not None else float('nan'):8.3f}{TARGETS[tkey]:8.2f}")
    if "ours_nograd_fwd_ms_repeat" in row:
        print(f"ours no-grad fwd repeated: {row['ours_nograd_fwd_ms_repeat']:.3f} ms")
    if "mamba_nograd_fwd_ms" in row:
        print(f"mamba no-grad fwd {row['mamba_nograd_fwd_ms']:.3f} ms (ours no-grad / it: "
              f"{row['ratio_nograd_vs_mamba_nograd']:.3f}); host ms per call: ours no-grad "
              f"{row['ours_nograd_host_ms']:.3f}, ours fwd {row['ours_fwd_host_ms']:.3f}, mamba fwd "
              f"{row['mamba_fwd_host_ms']:.3f}, mamba no-grad {row['mamba_nograd_host_ms']:.3f}")
    if "ours_vs_mamba_rel" in row:
        print("ours vs mamba_ssm (relative L2):", {k: f"{v:.2e}" for k, v in row["ours_vs_mamba_rel"].items()})
    for label, ks in row.get("kernels_ms", {}).items():
        print(f"  [{label}] " + ", ".join(f"{n[:40]}={t:.3f}" for n, t in ks[:10]))


if __name__ == "__main__":
    main()
