"""Benchmark the LRU-family block scan (lm_kernels.lru.block_scan, Triton) against the SSD kernel.

    lm bench lru [--out bench_lru.json] [--batch 8] [--seqlen 2048] [--ms 2,4,8]
                                [--width 4096] [--state 65536] [--tiny]

For each block size m, BD-LRU-like inputs (nonnegative rows summing to < 1, bf16) at two sizes:
  width  nb * m = --width  (the scanned width; the SSD peer at the same width is H64 P64 N128, whose
                            state is N = 128 times larger), and
  state  nb * m = --state  (equal recurrent state size; SSD peer H = state / (64 * 128), P64 N128).
Times forward (no grad) and forward+backward (grads of A and x) with triton.testing.do_bench
(warmup 50 ms, rep 300 ms, median), and time per token. Peers, when importable: lm_kernels.ssd
(backend "triton") and mamba_ssm's mamba_chunk_scan_combined. Also checks the forward against the
float64 reference on batch row 0 and a small tile-size sweep at m = 4. Prints a table, writes JSON.
--tiny runs everything at toy sizes (CPU: under TRITON_INTERPRET=1) to test the script itself.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch



def bench(fn, tiny):
    if tiny:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def lru_inputs(b, t, nb, m, dev):
    A = torch.rand(b, t, nb, m, m, device=dev, dtype=torch.bfloat16) * (1.8 / m)  # rows sum ~0.9
    x = torch.randn(b, t, nb, m, device=dev, dtype=torch.bfloat16)
    return A, x


def time_lru(b, t, nb, m, dev, tiny, chunk=64):
    from lm_kernels.lru import block_scan
    A, x = lru_inputs(b, t, nb, m, dev)

    def fwd():
        with torch.no_grad():
            return block_scan(A, x, chunk_size=chunk, backend="triton")[0]

    Ag = A.clone().requires_grad_()
    xg = x.clone().requires_grad_()
    dh = torch.randn_like(x)

    def fwdbwd():
        h, _ = block_scan(Ag, xg, chunk_size=chunk, backend="triton")
        h.backward(dh)
        Ag.grad = None
        xg.grad = None

    out = {"fwd_ms": bench(fwd, tiny), "fwdbwd_ms": bench(fwdbwd, tiny)}
    del A, x, Ag, xg, dh
    return out


def check_lru(b, t, nb, m, dev):
    """Relative error of the Triton forward and gradients vs the float64 reference on one sequence."""
    from lm_kernels.lru import block_scan, block_scan_reference
    A, x = lru_inputs(1, t, nb, m, dev)
    Al, xl = A.clone().requires_grad_(), x.clone().requires_grad_()
    h, _ = block_scan(Al, xl, backend="triton")
    dh = torch.randn_like(x)
    h.backward(dh)
    Ad, xd = A.double().requires_grad_(), x.double().requires_grad_()
    hr, _ = block_scan_reference(Ad, xd)
    hr.backward(dh.double())

    def rel(a, r):
        return ((a.double() - r).norm() / r.norm()).item()
    return {"rel_h": rel(h, hr), "rel_dA": rel(Al.grad, Ad.grad), "rel_dx": rel(xl.grad, xd.grad)}


def ssd_inputs(b, t, h, p, n, dev):
    x = torch.randn(b, t, h, p, device=dev, dtype=torch.bfloat16)
    dt = torch.randn(b, t, h, device=dev, dtype=torch.bfloat16) * 0.5 - 1
    A = -torch.rand(h, device=dev, dtype=torch.float32) - 0.5
    B = torch.randn(b, t, 1, n, device=dev, dtype=torch.bfloat16)
    C = torch.randn(b, t, 1, n, device=dev, dtype=torch.bfloat16)
    return x, dt, A, B, C


def ssd_peers():
    peers = {}
    try:
        import lm_kernels.ssd as ssd
        from lm_kernels.backend import triton_available
        if triton_available():
            from lm_kernels.ssd.triton_ssd import ssd_scan_triton  # noqa: F401  (the Triton path exists)
            peers["ours_ssd"] = lambda *a, **k: ssd.ssd_scan(*a, backend="triton", **k)[0]
    except Exception as e:  # noqa: BLE001  (optional peer)
        print(f"lm_kernels.ssd Triton path not available: {type(e).__name__}: {e}")
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        peers["mamba_ssm"] = lambda *a, **k: mamba_chunk_scan_combined(*a, **k)
    except Exception as e:  # noqa: BLE001
        print(f"mamba_ssm SSD not importable: {type(e).__name__}: {e}")
    return peers


def time_ssd(fn, b, t, h, p, n, dev, tiny):
    x, dt, A, B, C = ssd_inputs(b, t, h, p, n, dev)

    def fwd():
        with torch.no_grad():
            return fn(x, dt, A, B, C, chunk_size=256, dt_softplus=True)

    leaves = [v.clone().requires_grad_() for v in (x, dt, A, B, C)]
    dy = torch.randn_like(x)

    def fwdbwd():
        y = fn(*leaves, chunk_size=256, dt_softplus=True)
        y.backward(dy)
        for v in leaves:
            v.grad = None

    return {"fwd_ms": bench(fwd, tiny), "fwdbwd_ms": bench(fwdbwd, tiny)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", "--out", dest="out", default="bench_lru.json")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--ms", default="2,4,8")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--state", type=int, default=65536)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="toy sizes to test this script (CPU interpreter)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.tiny:
        raise SystemExit("no CUDA GPU: timings need one (use --tiny under TRITON_INTERPRET=1 to test the script)")
    if args.tiny:
        args.batch, args.seqlen, args.width, args.state = 1, 16, 16, 32
    b, t = args.batch, args.seqlen
    ms = [int(v) for v in args.ms.split(",")]
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "batch": b, "seqlen": t, "width": args.width, "state": args.state, "lru": [], "ssd": [], "sweep": [],
           "check": []}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        pass

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    p, n = (64, 128) if not args.tiny else (4, 4)
    for m in ms:  # correctness on the benchmark shapes first
        nb = args.width // m
        c = check_lru(1, t, nb, m, dev)
        res["check"].append({"m": m, "nb": nb, **c})
        print(f"check m={m} nb={nb}: " + " ".join(f"{k}={v:.2e}" for k, v in c.items()), flush=True)
        save()
    for kind, size in (("width", args.width), ("state", args.state)):
        for m in ms:
            nb = size // m
            r = time_lru(b, t, nb, m, dev, args.tiny)
            r.update(kind=kind, m=m, nb=nb, state=nb * m, width=nb * m,
                     fwd_ns_tok=r["fwd_ms"] * 1e6 / (b * t), fwdbwd_ns_tok=r["fwdbwd_ms"] * 1e6 / (b * t))
            res["lru"].append(r)
            print(f"lru {kind} m={m} nb={nb}: fwd {r['fwd_ms']:.3f} ms  fwd+bwd {r['fwdbwd_ms']:.3f} ms",
                  flush=True)
            save()
            if dev == "cuda":
                torch.cuda.empty_cache()
    peers = ssd_peers()
    for name, fn in peers.items():
        for kind, hh in (("width", args.width // p), ("state", max(1, args.state // (p * n)))):
            try:
                r = time_ssd(fn, b, t, hh, p, n, dev, args.tiny)
            except Exception as e:  # noqa: BLE001
                print(f"{name} failed: {type(e).__name__}: {e}")
                continue
            r.update(peer=name, kind=kind, H=hh, P=p, N=n, state=hh * p * n, width=hh * p,
                     fwd_ns_tok=r["fwd_ms"] * 1e6 / (b * t), fwdbwd_ns_tok=r["fwdbwd_ms"] * 1e6 / (b * t))
            res["ssd"].append(r)
            print(f"{name} {kind} H={hh}: fwd {r['fwd_ms']:.3f} ms  fwd+bwd {r['fwdbwd_ms']:.3f} ms", flush=True)
            save()
    if not args.no_sweep and 4 in ms:
        from lm_kernels.lru import triton_scan
        for cfg in ((32, 16, 4), (128, 32, 4), (64, 8, 4), (64, 32, 8)):
            triton_scan.CONFIG_OVERRIDE[4] = cfg
            r = time_lru(b, t, args.width // 4, 4, dev, args.tiny)
            r.update(m=4, kind="width", cfg=list(cfg))
            res["sweep"].append(r)
            print(f"sweep m=4 (BN, BN_CHUNK, warps)={cfg}: fwd {r['fwd_ms']:.3f} fwd+bwd {r['fwdbwd_ms']:.3f}",
                  flush=True)
            save()
        triton_scan.CONFIG_OVERRIDE.clear()
        for chunk in (32, 128):
            r = time_lru(b, t, args.width // 4, 4, dev, args.tiny, chunk=chunk)
            r.update(m=4, kind="width", chunk=chunk)
            res["sweep"].append(r)
            print(f"sweep m=4 chunk={chunk}: fwd {r['fwd_ms']:.3f} fwd+bwd {r['fwdbwd_ms']:.3f}", flush=True)
            save()

    # table: ns per token, ours vs the SSD peers at the same width / state
    print(f"\nB{b} T{t} bf16, ns per token (fwd / fwd+bwd); ratio = ours / peer")
    hdr = f"{'size':>6} {'m':>2} {'nb':>6} {'state':>7} {'ours fwd':>9} {'ours f+b':>9}"
    for name in peers:
        hdr += f" | {name + ' fwd':>14} {'f+b':>8} {'ratio f':>7} {'ratio fb':>8}"
    print(hdr)
    for r in res["lru"]:
        line = (f"{r['kind']:>6} {r['m']:>2} {r['nb']:>6} {r['state']:>7} {r['fwd_ns_tok']:>9.2f} "
                f"{r['fwdbwd_ns_tok']:>9.2f}")
        for name in peers:
            s = next((q for q in res["ssd"] if q["peer"] == name and q["kind"] == r["kind"]), None)
            if s is None:
                line += f" | {'-':>14} {'-':>8} {'-':>7} {'-':>8}"
                continue
            rf, rb = r["fwd_ns_tok"] / s["fwd_ns_tok"], r["fwdbwd_ns_tok"] / s["fwdbwd_ns_tok"]
            line += f" | {s['fwd_ns_tok']:>14.2f} {s['fwdbwd_ns_tok']:>8.2f} {rf:>7.2f} {rb:>8.2f}"
            r.setdefault("ratio", {})[name] = {"fwd": rf, "fwdbwd": rb}
        print(line)
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
