"""Registers / spills / shared memory of the DeltaProduct chunk kernels compiled for sm_90 on a machine without a GPU.

    python scripts/dev/sm90/deltaproduct_stats.py [--nh 1 2 3] [--kernels main dh ..] [--configs BV/warps/stages ..]
        [--K 128] [--V 256] [--chunk 64] [--dtype bf16|fp16|fp32]

Run it in a process without TRITON_INTERPRET (triton ships ptxas and cuobjdump). The numbers come from the local
triton, whose code generation can differ from the GPU image's: use them to compare launch configs and kernel edits,
and `lm bench deltaproduct`'s compile_stats (triton's metadata on the GPU) for the record. Defaults: the bench shape
(K 128, V 256, chunk 64, bf16) at each kernel's launch config (lm_kernels/deltaproduct/configs.py); --K / --V /
--chunk / --dtype check other shapes, e.g. that a launch fits in the 232448 bytes of shared memory an H100 gives a
program. Kernels: prep, prep_w (the prep's W alone, the backward's recompute), fwd (the sequential forward, with or
without grad), fwd_states (the same kernel in the backward's recompute: states, Vn, no output), bwd_state (the
sequential backward), qk / wy (the backward of key heads of two or more K slices), main (that of one-slice heads).
"""
from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(os.path.dirname(_HERE))]  # sm90.py beside it; this checkout's lm_kernels

import triton  # noqa: E402
from sm90 import TARGET, resources  # noqa: E402

from lm_kernels.deltaproduct import bwd, bwd_state, chunk, configs, fwd, prep  # noqa: E402

_FP32_PTRS = {"gc", "db", "dg", "ht", "h0", "dh0", "dht", "dgp"}
_INT_PTRS = {"chunk_seq", "chunk_row", "cu_rows", "chunk_off"}


def _signature(fn, constexprs, dtype="bf16", fp32_ptrs=None):
    fp32_ptrs = _FP32_PTRS if fp32_ptrs is None else fp32_ptrs
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "scale":
            sig[name] = "fp32"
        elif name == "LH":
            sig[name] = "i32"
        elif name in _INT_PTRS:
            sig[name] = "*i32"
        elif name in fp32_ptrs:
            sig[name] = "*fp32"
        else:
            sig[name] = "*" + dtype  # the op's inputs and the tensors stored in their dtype
    return sig


def stats(kernel, constexprs, num_warps, num_stages, maxnreg=None, dtype="bf16", fp32_ptrs=None):
    """Registers, spill store / load bytes, stack bytes and shared memory of `kernel` compiled for sm_90 with these
    constexprs and launch options; dtype: of the inputs (bf16, fp16, fp32); fp32_ptrs: the float32 pointer arguments
    (default _FP32_PTRS)."""
    fn = kernel
    while not isinstance(fn, triton.runtime.jit.JITFunction):
        fn = fn.fn
    sig = _signature(fn, constexprs, dtype, fp32_ptrs)
    # pointers 16-byte aligned, as torch allocates them (the launcher specializes on that)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages,
                                                    "maxnreg": maxnreg})
    return resources(k)


def launch_config(name, nh, K):
    """(BV or None, num_warps, num_stages) of `name` as chunk.py launches it."""
    cfg = configs.BASE[{"fwd_states": "fwd", "prep_w": "prep"}.get(name, name)]
    if name == "main" and nh == 1:
        cfg = configs.MAIN_NH1
    if name == "wy" and K > 128:
        cfg = configs.WY_WIDE_K
    meta, nw, ns = cfg
    return meta.get("BV"), nw, ns


def kernel_and_constexprs(name, nh, K, V, BT, BV, dtype):
    """The kernel `name` and its constexprs as chunk.py launches it at this shape; also the float32 pointers."""
    BK = max(16, triton.next_power_of_2(K))
    BQ = chunk._bq(BT, nh)
    prec = "tf32x3" if dtype == "fp32" else "tf32"
    intra = nh >= 2
    common = dict(NH=nh, H=16, K=K, BT=BT, BK=BK, PREC=prec)
    if name in ("prep", "prep_w"):
        return prep._prep_kernel, dict(common, BQ=BQ, USE_G=name == "prep", MP="ieee" if dtype == "fp32" else "tf32",
                                       INTRA=intra, W_ONLY=name == "prep_w"), _FP32_PTRS
    if name in ("fwd", "fwd_states"):
        return fwd._fwd_kernel, dict(common, V=V, BV=BV, BQ=BQ, BQP=max(BQ, 64), USE_H0=False, STORE_FINAL=False,
                                     OUT=name == "fwd", SAVE=name == "fwd_states", INTRA=intra), _FP32_PTRS
    if name == "bwd_state":
        return bwd_state._bwd_state_kernel, dict(common, V=V, BV=BV, BQ=BQ, USE_DHT=False, STORE_DH0=False,
                                                 LOAD_AQ=not intra), _FP32_PTRS
    if name == "main":  # dbeta in float32 at nh = 1, else in beta's dtype (as _bwd allocates it)
        return bwd._bwd_main_kernel, dict(common, V=V, BV=BV, BQ=BQ, USE_G=True), \
            _FP32_PTRS if nh == 1 else _FP32_PTRS - {"db"}
    if name == "qk":
        return bwd._bwd_qk_kernel, dict(common, V=V, BK=min(BK, chunk.SPLIT_BK), BV=BV, BQ=BQ), _FP32_PTRS
    if name == "wy":
        return bwd._bwd_wy_kernel, dict(common, V=V, BV=BV, NK=triton.cdiv(K, min(BK, chunk.SPLIT_BK)), USE_G=True), \
            _FP32_PTRS - {"db"}
    raise SystemExit(f"unknown kernel {name}: prep, prep_w, fwd, fwd_states, bwd_state, main, qk, wy")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nh", type=int, nargs="+", default=[1])
    p.add_argument("--kernels", nargs="+", default=["prep", "prep_w", "fwd", "fwd_states", "bwd_state", "qk", "wy"])
    p.add_argument("--configs", nargs="+", default=None,
                   help="BV/warps/stages to compile instead of each kernel's launch config")
    p.add_argument("--K", type=int, default=128, help="key head size")
    p.add_argument("--V", type=int, default=256, help="value head size")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="of the op's inputs")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("deltaproduct_stats: unset TRITON_INTERPRET (it compiles for sm_90)")
    for nh in a.nh:
        for name in a.kernels:
            cfgs = [launch_config(name, nh, a.K)] if a.configs is None else \
                [tuple(int(x) for x in c.split("/")) for c in a.configs]
            for bv, w, s in cfgs:
                bv = bv or min(64, max(16, triton.next_power_of_2(a.V)))
                kern, cx, fp32 = kernel_and_constexprs(name, nh, a.K, a.V, a.chunk, bv, a.dtype)
                if "BV" not in cx:  # the prep has no V blocks
                    bv = None
                r = stats(kern, cx, w, s, dtype=a.dtype, fp32_ptrs=fp32)
                print(f"nh={nh} {name} BV{bv} w{w} s{s} K{a.K} V{a.V} chunk{a.chunk} {a.dtype}: {r}", flush=True)


if __name__ == "__main__":
    main()
