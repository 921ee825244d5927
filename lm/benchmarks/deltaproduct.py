"""Benchmark and check the (Gated) DeltaProduct chunk op: ours (Triton) vs fla 0.6.0 `chunk_gated_delta_product`.

    lm bench deltaproduct [--B 8 --T 2048 --H 16 --K 128 --V 256 --nh 1 2 3] [--json out.json]

Per n_h it times (triton.testing.do_bench, warmup 50 ms, rep 300 ms, median; bf16, random non-zero inputs,
gated): our forward without grad (the path the implicit models use; saves nothing), our forward with grad
enabled (also writes the chunk states for backward), our forward+backward, and fla's forward (fla's
backward is refused on triton 3.6 Hopper). It also checks, at the bench shape, our output against fla's and
against a float64 reference on a slice of the batch (relative error, forward and every gradient).
fla is optional: without it only our numbers are reported. --quick runs tiny shapes (CPU interpreter).

--variants A B ... times kernel variants (VARIANTS below: module switches and fixed launch configs) side by
side in one process, and on CUDA prints each compiled kernel's registers and spills (triton's metadata).
--warm ours|fla only compiles (one call of each path): run such processes beside the GPU tests so that the
timing process starts with triton's disk cache filled (set FLA_CACHE_RESULTS=0 so fla re-times its configs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F


# Candidate kernel choices compared side by side in one process (--variants): module attributes of
# lm_kernels.deltaproduct.triton_chunk set before each variant's timings.
VARIANTS = {
    "new": dict(),  # the module defaults
    "main_norebase": dict(MAIN_REBASE=False),
    "ho_64w8": dict(FIXED={"h_o": ({"BV": 64}, 8, 2)}),
    "ho_32w4": dict(FIXED={"h_o": ({"BV": 32}, 4, 2)}),
    "main_32s2": dict(FIXED={"main": ({"BV": 32}, 8, 2)}),
    # session 3 (BENCH.md): kkt kernel choices, Aqk^T dO inside the sequential backward (DH_FUSE_DVL), the SAVE
    # launch config of the sequential forward, late K/Q loads in the main backward
    "no_early": dict(KKT_EARLY_A=False),
    "no_tf32": dict(KKT_MERGE_TF32=False),
    "no_late": dict(MAIN_LATE_LOADS=False),
    "nofuse": dict(DH_FUSE_DVL=False),
    "save_def": dict(H_O_SAVE_CONFIG=None),
    "save_32": dict(H_O_SAVE_CONFIG=({"BV": 32}, 4, 2)),
    "kkt_w4": dict(KKT_INV_CONFIG=({}, 4, 1)),
    "kkt_w1": dict(KKT_INV_CONFIG=({}, 1, 1)),
    "wu_w8": dict(WU_CONFIG=({"BV": 64}, 8, 2)),
    "wu_s2": dict(WU_CONFIG=({"BV": 64}, 4, 2)),
    "dh_32": dict(DH_CONFIG=({"BV": 32}, 4, 2)),
    "main_64s2": dict(MAIN_CONFIG=({"BV": 64}, 8, 2)),
    "main_32s2l": dict(MAIN_CONFIG=({"BV": 32}, 8, 2)),
    "main_16s3": dict(MAIN_CONFIG=({"BV": 16}, 8, 3)),
    "main_w4": dict(MAIN_CONFIG=({"BV": 32}, 4, 2)),
    "intra1": dict(INTRA_MIN_NH=1),
    # session 4 (BENCH.md): the forward with grad stores less, the backward recomputes it
    "novn": dict(VN_RECOMPUTE_MIN_NH=1),  # no Vn store; the main backward forms Vn = U - W S
    "novn2": dict(VN_RECOMPUTE_MIN_NH=2),  # the same from nh=2 on (nh=1 stores Vn)
    "vn_all": dict(VN_RECOMPUTE_MIN_NH=99),  # Vn stored at every nh
    "aqk": dict(AQK_SAVE=True),  # Aqk^T stored by the forward, read by the sequential backward, at every nh
    "no_aqk": dict(AQK_SAVE=False),
    "novn_aqk": dict(VN_RECOMPUTE_MIN_NH=1, AQK_SAVE=True),
    "s3": dict(VN_RECOMPUTE_MIN_NH=99, AQK_SAVE=False),  # session 3's defaults
    "save_128w8": dict(H_O_SAVE_CONFIG=({"BV": 128}, 8, 1)),  # SAVE launch: half the programs, 8 warps
    "aqk_dh32": dict(AQK_SAVE=True, DH_CONFIG=({"BV": 32}, 4, 2)),
    "dh1": dict(DH_CONFIG=({"BV": 64}, 4, 1)),  # sequential backward at 1 stage (less shared memory)
    "aqk_dh1": dict(AQK_SAVE=True, DH_CONFIG=({"BV": 64}, 4, 1)),
    "novn_64s2": dict(VN_RECOMPUTE_MIN_NH=1, MAIN_CONFIG=({"BV": 64}, 8, 2)),
    # session 5 (BENCH.md): the main backward at more pipeline stages, register-capped launch configs (4th element:
    # ptx maxnreg) for more programs per SM
    "s4": dict(MAIN_CONFIG=({"BV": 32}, 8, 3), WU_CONFIG=({"BV": 64}, 4, 3), OLOC_IN_H_O=False,
               OLOC_NO_QE=False),  # session 4's defaults
    "s5r1": dict(MAIN_CONFIG=({"BV": 32}, 8, 4), OLOC_IN_H_O=False, OLOC_NO_QE=False),  # session 5 run 1's
    "main_32s5": dict(MAIN_CONFIG=({"BV": 32}, 8, 5)),
    "main_32s6": dict(MAIN_CONFIG=({"BV": 32}, 8, 6)),
    "main_64s3": dict(MAIN_CONFIG=({"BV": 64}, 8, 3)),
    "main_16s6": dict(MAIN_CONFIG=({"BV": 16}, 8, 6)),
    "dh_w8": dict(DH_CONFIG=({"BV": 64}, 8, 2)),  # sequential backward at 8 warps (190 registers, one per SM)
    "dh_s3": dict(DH_CONFIG=({"BV": 64}, 4, 3)),  # one more stage (214 KB of shared memory at nh=1)
    "dh_w8s3": dict(DH_CONFIG=({"BV": 64}, 8, 3)),
    "oloc": dict(OLOC_IN_H_O=True, OLOC_NO_QE=False),  # nh >= 2: _wu_kernel stores Aqk, the sequential forward forms O_loc = Aqk U
    "oloc_noqe": dict(OLOC_IN_H_O=True, OLOC_NO_QE=True),  # ... and no Qe: o = scale e^g Q S + Aqk Vn
    "every2": dict(STATES_EVERY2=True),  # chunk states stored for even chunks only, the others formed in the backward
    "b_all": dict(OLOC_IN_H_O=True, OLOC_NO_QE=True, STATES_EVERY2=True),  # the three (B) candidates together
    "oloc_r128": dict(OLOC_IN_H_O=True, WU_CONFIG=({"BV": 64}, 4, 3, 128)),
    "wu_r128": dict(WU_CONFIG=({"BV": 64}, 4, 3, 128)),  # 4 programs per SM (spills 52 at nh=2)
    "wu_r168s4": dict(WU_CONFIG=({"BV": 64}, 4, 4, 168)),
    # session 6: the no-grad sequential forward at 1 stage (73 KB of shared memory instead of 119: two programs per SM
    # instead of one for its 4 waves of chunk chains), as the SAVE launch already runs; adopted
    "ho_s1": dict(FIXED={"h_o": ({"BV": 64}, 4, 1)}),  # (the default since session 6)
    "ho_s2": dict(FIXED={"h_o": ({"BV": 64}, 4, 2)}),  # the no-grad launch before session 6
    # session 8 (ncu, nh=2): the sequential kernels run 512 chunk chains (B8 x H16 x 4 V blocks) at 2 programs per SM,
    # i.e. in 2 waves (1.94 per SM). 128-wide V blocks at 8 warps capped at 128 registers: 256 chains, 2 per SM (115 /
    # 82 KB of shared memory), one wave, but 110 - 380 B of spills per thread: 2-3x slower (H100 run 4, BENCH.md)
    "ho128": dict(FIXED={"h_o": ({"BV": 128}, 8, 1)}),  # uncapped (255 registers: one per SM, 2 waves)
    "ho128r": dict(FIXED={"h_o": ({"BV": 128}, 8, 1, 128)}),
    "dh128r": dict(DH_CONFIG=({"BV": 128}, 8, 1, 128)),
    "both128r": dict(FIXED={"h_o": ({"BV": 128}, 8, 1, 128)}, DH_CONFIG=({"BV": 128}, 8, 1, 128)),
    # session 9 (ncu source view, nh=2 SAVE: half of the sequential forward's warp stalls wait on the chunk's tile
    # loads, 13% more on the query tiles loaded after Vn): all tiles loaded at the top (q_early), the query tile
    # padded to 64 rows (one shared copy of the state), the state store after the loads (store_late); all three are
    # the defaults since. (Loading the next chunk's tiles into registers during the state update lost, in 4 forms.)
    "s8": dict(H_O_Q_EARLY=False, H_O_QPAD=None, H_O_STORE_LATE=False),  # session 8's sequential forward
    "q_early": dict(H_O_QPAD=None, H_O_STORE_LATE=False),
    "q_early_pad": dict(H_O_STORE_LATE=False),
    "pad": dict(H_O_Q_EARLY=False, H_O_STORE_LATE=False),
    # nh = 2, 3 through the nh = 1 form: the sequential forward forms Aqk from its Q and K^T tiles, _wu_kernel
    # only W and U (as fla's recompute_w_u); with / without Aqk^T saved for the sequential backward
    "intra4": dict(INTRA_MIN_NH=4, AQK_SAVE=False),
    "intra4_aq": dict(INTRA_MIN_NH=4),
    # session 10: U = T diag(beta) V formed in the sequential forward (U_IN_H_O_MIN_NH) instead of written by _wu_kernel
    # and read back (U is used nowhere else): off, or from nh = 2 only
    "u_off": dict(U_IN_H_O_MIN_NH=99),
    "u_nh2": dict(U_IN_H_O_MIN_NH=2),
    "u_grad": dict(U_IN_H_O_MIN_NH=(1, 99)),  # the forward with grad only
    # _wu_kernel without its V loop: 3 programs per SM (162 registers, WU_CONFIG), 4 at 4 warps capped at 128 (the
    # default since), or 3 at 8 warps capped at 80
    "wu_nou_r168s3": dict(WU_CONFIG_NO_U=({"BV": 64}, 4, 3, 168)),
    "wu_nou_w8r80": dict(WU_CONFIG_NO_U=({"BV": 64}, 8, 1, 80)),
    # W (and Aqk) at the end of _kkt_inv_kernel, one launch for the prep: at 2 or 4 warps
    "kwu2": dict(KKT_FUSE_WU=True, KKT_WU_CONFIG=({}, 2, 1)),
    "kwu4": dict(KKT_FUSE_WU=True, KKT_WU_CONFIG=({}, 4, 1)),
    "kwu_off": dict(KKT_FUSE_WU=False),
    # nh = 1 with the prep forming Aqk (and Aqk^T for the sequential backward) like nh >= 2, instead of the sequential
    # forward forming it from its Q and K^T tiles
    "intra1_aq": dict(INTRA_MIN_NH=1, AQK_SAVE=True),
    # session 11: the main backward at 16-wide V blocks (fewer spills at nh = 2, 3 on sm_90, half the shared memory);
    # dbeta stored in float32 and cast after the kernel at every nh (session 10), or in beta's dtype at every nh
    "main16": dict(MAIN_CONFIG=({"BV": 16}, 8, 5)),
    "main16s4": dict(MAIN_CONFIG=({"BV": 16}, 8, 4)),
    "db32": dict(MAIN_DB_FP32_MAX_NH=99),
    "db16": dict(MAIN_DB_FP32_MAX_NH=0),
    "nh1_s4": dict(MAIN_CONFIG_NH1=({"BV": 32}, 8, 4)),  # the nh = 1 main backward at 4 stages (5: session 5)
    # the main backward as one kernel (session 10) instead of the K-sliced state loop + WY kernel, and the state-loop
    # kernel at 8 warps (one program per SM), or at 8 warps capped at 128 registers (two per SM)
    "fused": dict(MAIN_SPLIT_MAX_NH=0),
    "split_w8": dict(FIXED={"qk": ({"BV": 32}, 8, 3)}),
    "split_r128": dict(FIXED={"qk": ({"BV": 32}, 8, 3, 128)}),
    # launch choices of the split: the state loop at 4 stages, the WY kernel at 3, 32-wide K slices (212 registers at
    # 4 warps), also capped at 168 registers (three programs per SM)
    "qk_s4": dict(FIXED={"qk": ({"BV": 32}, 4, 4)}),
    "wy_s2": dict(FIXED={"wy": ({"BV": 64}, 8, 2)}),
    "wy_s3": dict(FIXED={"wy": ({"BV": 64}, 8, 3)}),
    "wy_s4": dict(FIXED={"wy": ({"BV": 64}, 8, 4)}),
    "bk32": dict(MAIN_SPLIT_BK=32),
    "bk32_r168": dict(MAIN_SPLIT_BK=32, FIXED={"qk": ({"BV": 32}, 4, 3, 168)}),
    # session 12: the WY kernel at 4 warps (0 spills since _wy_terms forms dg's dA terms before the dk products: two
    # programs per SM; adopted, and with it the split at every nh), dbeta stored in bf16, the state loop at nh >= 2 at
    # 8 warps capped at 128 registers (2 per SM, 4-8 B of spills) or at 4 warps capped at 168 (3 per SM, 84-92 B)
    "wy_w8": dict(FIXED={"wy": ({"BV": 64}, 8, 3)}),  # the WY kernel's config of session 11
    "wy_w4b32": dict(FIXED={"wy": ({"BV": 32}, 4, 3)}),
    "wy_db16": dict(SPLIT_DB_FP32=False),
    "split_nh1": dict(MAIN_SPLIT_MAX_NH=1, FIXED={"wy": ({"BV": 64}, 8, 3)}),  # session 11's backward
    "qk2_w8r128": dict(QK_CONFIG_NH2=({"BV": 32}, 8, 3, 128)),
    "qk2_r168": dict(QK_CONFIG_NH2=({"BV": 32}, 4, 3, 168)),
    "wy4_s2": dict(FIXED={"wy": ({"BV": 64}, 4, 2)}),
    "wy4_s4": dict(FIXED={"wy": ({"BV": 64}, 4, 4)}),
    "qk_s3": dict(FIXED={"qk": ({"BV": 32}, 4, 3)}),  # the state loop at 3 stages (sessions 11-12 run 3)
}


def set_variant(name):
    import lm_kernels.deltaproduct.triton_chunk as tc
    defaults = getattr(set_variant, "defaults", None)
    if defaults is None:
        keys = {k for v in VARIANTS.values() for k in v}
        defaults = set_variant.defaults = {k: getattr(tc, k) for k in keys}
    for k, v in {**defaults, **VARIANTS[name]}.items():
        setattr(tc, k, {n: c for n, c in v.items() if c is not None} if k == "FIXED" else v)


def compile_stats():
    """Per compiled Triton kernel of the op: registers, spills, warps, stages, shared memory, and the
    autotuner's choice (from triton's own caches; CUDA only)."""
    import lm_kernels.deltaproduct.triton_chunk as tc
    out = []
    for name in dir(tc):
        obj = getattr(tc, name)
        if not name.startswith("_") or not name.endswith("_kernel"):
            continue
        fn, best = obj, None
        if hasattr(obj, "cache") and isinstance(getattr(obj, "cache"), dict):
            best = {str(k): str(v) for k, v in obj.cache.items()}
        while hasattr(fn, "fn") and not hasattr(fn, "device_caches"):
            fn = fn.fn
        for dev_cache in getattr(fn, "device_caches", {}).values():
            kc = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for ck in kc.values():
                md = ck.metadata
                out.append(dict(kernel=name, n_regs=getattr(ck, "n_regs", None), n_spills=getattr(ck, "n_spills", None),
                                num_warps=getattr(md, "num_warps", None), num_stages=getattr(md, "num_stages", None),
                                shared=getattr(md, "shared", None)))
        if best:
            out.append(dict(kernel=name, autotune_choice=best))
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
    p.add_argument("--variants", nargs="+", default=None, choices=sorted(VARIANTS),
                   help="time these kernel variants side by side (default: the module defaults only)")
    p.add_argument("--profile-variants", nargs="+", default=["new"],
                   help="with --profile and --variants: the variants whose kernels are profiled and checked")
    p.add_argument("--warm", choices=["ours", "fla"], default=None,
                   help="only compile (call each path once, no timing): run several such processes beside the "
                        "tests so that the timing process finds triton's disk cache filled")
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
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:
        pass
    for nh in a.nh:
        q, k, v, beta, g, h0 = make_inputs(a.B, a.T, a.H, a.K, a.V, nh, device, dtype)
        if a.warm:
            warm(a, nh, q, k, v, beta, g, fla_fwd, chunk_deltaproduct)
            continue
        for var in (a.variants or [None]):
            if var is not None:
                set_variant(var)
            r = dict(nh=nh, variant=var or "default")
            run_one(a, r, rows, nh, var, q, k, v, beta, g, h0, device, fla_fwd, chunk_deltaproduct)
        if a.variants:
            set_variant(a.variants[-1])
        del q, k, v, beta, g, h0
        if device == "cuda":
            torch.cuda.empty_cache()
    if not a.warm:
        finish(a, info, rows, dtype, device)
    return rows


def warm(a, nh, q, k, v, beta, g, fla_fwd, chunk_deltaproduct):
    t0 = time.perf_counter()
    if a.warm == "fla":
        if fla_fwd is not None:
            with torch.no_grad():
                fla_fwd(q, k, v, g, beta, num_householder=nh)
    else:
        for var in (a.variants or [None]):
            if var is not None:
                set_variant(var)
            with torch.no_grad():
                chunk_deltaproduct(q, k, v, beta, g, num_householder=nh, backend="triton")
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v, beta, g)]
            o, _ = chunk_deltaproduct(*leaves, num_householder=nh, backend="triton")
            torch.autograd.grad(o, leaves, torch.randn_like(o))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"warm {a.warm} nh={nh} {a.variants}: {time.perf_counter() - t0:.1f}s", flush=True)


def run_one(a, r, rows, nh, var, q, k, v, beta, g, h0, device, fla_fwd, chunk_deltaproduct):
    if True:  # noqa: SIM108 (kept flat for the diff)
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
        if a.profile and device == "cuda" and var in (None, *a.profile_variants):
            with torch.no_grad():
                r["kernels_fwd_nograd_ms"] = kernel_breakdown(ours_fwd)
            r["kernels_fwd_bwd_ms"] = kernel_breakdown(ours_fwd_bwd)
            if fla_fwd is not None:
                with torch.no_grad():
                    r["kernels_fla_fwd_ms"] = kernel_breakdown(fla_call)
        if a.check_batch > 0 and var in (None, *a.profile_variants):
            r["check_vs_float64"] = check_vs_reference(q, k, v, beta, g, h0, nh, a.check_batch)
        rows.append(r)
        print(json.dumps(r), flush=True)


def finish(a, info, rows, dtype, device):
    if device == "cuda":
        info["compile_stats"] = compile_stats()
        for cs in info["compile_stats"]:
            print("compile:", json.dumps(cs), flush=True)
    hdr = f"{'nh':>3} {'variant':>8} {'ours fwd':>9} {'ours fwd(g)':>11} {'ours f+b':>9} {'fla fwd':>8} " \
          f"{'ours/fla':>9} {'(g)/fla':>9} " \
          f"{'f+b/fwd':>8} {'f+b/fwd(g)':>10} {'err o':>8} {'worst grad err':>15}"
    print(f"\nDeltaProduct chunk op, {info['device']}, B{a.B} T{a.T} H{a.H} K{a.K} V{a.V} {dtype}, gated "
          f"(ms, median)")
    print(hdr)
    for r in rows:
        chk = r.get("check_vs_float64", {})
        worst = max((v for n, v in chk.items() if n.startswith("d")), default=float("nan"))
        print(f"{r['nh']:>3} {r['variant']:>8} {r['ours_fwd_nograd_ms']:>9.3f} {r['ours_fwd_grad_ms']:>11.3f} "
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
