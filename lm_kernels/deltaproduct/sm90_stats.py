"""Registers / spills / shared memory of the DeltaProduct kernels compiled for sm_90 on a machine without a GPU.

    python -m lm_kernels.deltaproduct.sm90_stats [--nh 1 2 3] [--configs BV/warps/stages ..] [--kernels main dh ..]
        [--K 128] [--V 256] [--chunk 64] [--dtype bf16|fp16|fp32]

Run it in a process without TRITON_INTERPRET (triton ships ptxas and cuobjdump). The numbers come from the CPU's
triton (3.9 here), whose code generation can differ from the GPU image's (3.6): use them to compare variants,
and the bench's compile_stats (triton's metadata on the H100) for the record. Defaults: the bench shape (K 128, V 256,
chunk 64, bf16); --K / --V / --chunk / --dtype check other shapes, e.g. that a launch fits in the 232448 bytes of
shared memory an H100 gives a program (session 10 found two that did not: bf16 K 256 in dh, float32 K 128 in main).
"""
from __future__ import annotations

import argparse

import triton

from ..sm90 import TARGET, resources
from . import triton_chunk as tc

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
    """Registers, spill store / load bytes, stack bytes (triton's n_spills on the GPU is stack / 4) and shared
    memory of `kernel` compiled for sm_90 with these constexprs and launch options (lm_kernels.sm90.resources);
    dtype: of the inputs (bf16, fp16, fp32); fp32_ptrs: the float32 pointer arguments (default _FP32_PTRS). An H100
    gives a program at most 232448 bytes of shared memory."""
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


def _main_cx(nh, BV, **extra):
    BT, K, V = 64, 128, 256
    cx = dict(NH=nh, H=16, K=K, V=V, BT=BT, BK=128, BV=BV, BQ=tc._bq(BT, nh), USE_G=True, PREC="tf32",
              REBASE=True, LATE=True, RECOMP_VN=False)
    cx.update(extra)
    return cx


def _dh_cx(nh, BV, **extra):
    BT, K, V = 64, 128, 256
    cx = dict(NH=nh, H=16, K=K, V=V, BT=BT, BK=128, BV=BV, BQ=tc._bq(BT, nh), USE_DHT=False, STORE_DH0=False,
              PREC="tf32", FUSE_DVL=True, LOAD_AQ=nh < tc.INTRA_MIN_NH)
    cx.update(extra)
    return cx


def _ho_cx(nh, BV, save, **extra):
    """The sequential forward at the module's switches (SAVE: the launch of the forward with grad)."""
    BT, K, V = 64, 128, 256
    BQ, intra = tc._bq(BT, nh), nh >= tc.INTRA_MIN_NH
    noqe = intra and tc.OLOC_IN_H_O and tc.OLOC_NO_QE
    cx = dict(NH=nh, H=16, K=K, V=V, BT=BT, BK=128, BV=BV, BQ=BQ, USE_H0=False, STORE_FINAL=False, SAVE=save,
              INTRA=intra, PREC="tf32", SAVE_VN=save, SAVE_AQ=save and not intra, AQF=intra and tc.OLOC_IN_H_O,
              NOQE=noqe, EVERY2=False, BQP=tc._bqp(BQ, save), Q_EARLY=tc._pick(tc.H_O_Q_EARLY, save),
              STORE_LATE=tc._pick(tc.H_O_STORE_LATE, save), U_IN=nh >= tc._pick(tc.U_IN_H_O_MIN_NH, save))
    cx.update(extra)
    return cx


def _kkt_cx(nh, BV, **extra):
    """The forward prep as the op launches it by default (the T inversion, then W and Aqk: KKT_FUSE_WU)."""
    BT, K, V = extra.get("BT", 64), extra.get("K", 128), extra.get("V", 256)
    intra = nh >= tc.INTRA_MIN_NH
    cx = dict(NH=nh, H=16, K=K, BT=BT, BK=128, USE_G=True, PREC="tf32", EARLY_A=True, MP="tf32", FUSE_WU=True, V=V,
              BV=BV, BQ=tc._bq(BT, nh), INTRA=intra, SCALE_T=intra, SAVE_AQ=False, AQF=intra, NOQE=intra)
    cx.update(extra)
    return cx


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nh", type=int, nargs="+", default=[1])
    p.add_argument("--configs", nargs="+", default=["32/8/3"], help="BV/warps/stages of the main backward")
    p.add_argument("--kernels", nargs="+", default=["main"], help="main, dh, h_o, h_o_save, kkt (the fused prep), qk, wy (the split "
                   "main backward)")
    p.add_argument("--K", type=int, default=128, help="key head size")
    p.add_argument("--V", type=int, default=256, help="value head size")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="of the op's inputs")
    a = p.parse_args(argv)
    for nh in a.nh:
        BQ = tc._bq(a.chunk, nh)
        shape = dict(K=a.K, BK=max(16, triton.next_power_of_2(a.K)), V=a.V, BT=a.chunk, BQ=BQ,
                     PREC="tf32x3" if a.dtype == "fp32" else "tf32")
        for kname in a.kernels:
            for c in a.configs:
                bv, w, s = (int(x) for x in c.split("/"))
                if kname == "main":
                    db32 = nh <= tc.MAIN_DB_FP32_MAX_NH  # dbeta's dtype as _bwd allocates it
                    r = stats(tc._bwd_main_kernel, _main_cx(nh, bv, **shape), w, s, dtype=a.dtype,
                              fp32_ptrs=_FP32_PTRS if db32 else _FP32_PTRS - {"db"})
                elif kname == "dh":  # the sequential backward
                    r = stats(tc._bwd_dh_v2_kernel, _dh_cx(nh, bv, **shape), w, s, dtype=a.dtype)
                elif kname in ("h_o", "h_o_save"):  # the sequential forward (no-grad / with grad)
                    save = kname == "h_o_save"
                    r = stats(tc._fwd_h_o_v2_kernel, _ho_cx(nh, bv, save, **shape, BQP=tc._bqp(BQ, save)), w, s,
                              dtype=a.dtype)
                elif kname == "qk":  # the split main backward's state loop (MAIN_SPLIT_MAX_NH), one K slice
                    bk = min(shape["BK"], tc.MAIN_SPLIT_BK)
                    cx = dict(NH=nh, H=16, K=a.K, V=a.V, BT=a.chunk, BK=bk, BV=bv, BQ=BQ, PREC=shape["PREC"])
                    r = stats(tc._bwd_qk_kernel, cx, w, s, dtype=a.dtype)
                elif kname == "wy":  # the split main backward's WY kernel
                    nk = triton.cdiv(a.K, min(shape["BK"], tc.MAIN_SPLIT_BK))
                    cx = dict(NH=nh, H=16, K=a.K, V=a.V, BT=a.chunk, BK=shape["BK"], BV=bv, NK=nk, USE_G=True,
                              PREC=shape["PREC"])
                    r = stats(tc._bwd_wy_kernel, cx, w, s, dtype=a.dtype,
                              fp32_ptrs=_FP32_PTRS if tc.SPLIT_DB_FP32 else _FP32_PTRS - {"db"})
                elif kname == "kkt":
                    mp = "ieee" if a.dtype == "fp32" else "tf32"
                    r = stats(tc._kkt_inv_kernel, _kkt_cx(nh, bv, **shape, MP=mp), w, s, dtype=a.dtype)
                else:
                    raise SystemExit(f"unknown kernel {kname}")
                print(f"nh={nh} {kname} BV{bv} w{w} s{s} K{a.K} V{a.V} chunk{a.chunk} {a.dtype}: {r}", flush=True)


if __name__ == "__main__":
    main()
