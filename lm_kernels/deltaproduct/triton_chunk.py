"""Triton chunkwise (WY/UT) kernels for (Gated) DeltaProduct, forward and backward.

The op is a gated delta rule over the interleaved sequence of L = nh*T rows (see reference.py for the
chunk equations). Queries exist only on each token's last sub-step, so the output and the query
gradients are computed on a tile of the BQ ~ C/nh tokens whose last row lies in the chunk, not on all C
rows. Batches are handled as packed sequences (a batch of B equal sequences is B documents), so fixed
length and varlen share every kernel.

Forward:  _kkt_inv_kernel (parallel over chunks) gate cumsum, A = beta KK^T o Gam, T = (I+A)^-1 by
                                                  16x16 block inversion + merges; then (KKT_FUSE_WU, the default)
                                                  _wu_kernel's work on the same chunk (_wu_tile):
          _wu_kernel     (parallel over chunks)  W = T beta e^g K; for nh >= 2 also Aqk (with other switches also
                                                  U = T beta V, O_loc = Aqk U, Qe = e^g Q - Aqk W)
          _fwd_h_o_v2_kernel (parallel over V blocks x heads x sequences, sequential over chunks)
                                                  U = T beta V (U_IN), Vn = U - W S, o = scale e^g Q S + Aqk Vn,
                                                  S <- e^gC S + Kd^T Vn (with grad: also saves S per chunk and Vn)
Backward: _bwd_dh_v2_kernel (sequential, reverse) dVn (its state-independent part Aqk^T dO computed inline)
                                                  and the state gradient entering each chunk
          _fill_states_kernel (STATES_EVERY2 only) the odd chunks' states from the stored even ones
          _bwd_qk_kernel (parallel over K slices x chunks) the loop over the states: dq, dk's query and state
                                                  terms, dW, the slices' gate terms
          _bwd_wy_kernel (parallel over chunks)  dv, dbeta and the WY / (I+A)^-1 terms of dk and dg
          _bwd_main_kernel (parallel over chunks) the two in one kernel: dq, dk, dv, dbeta, dg for key heads of one
                                                  K slice (K <= 64), and with VN_RECOMPUTE_MIN_NH
Kept selectable as a measured alternative (module constants below, H100 timings in BENCH.md):
_bwd_dvloc_kernel (Aqk^T dO as its own launch, DH_FUSE_DVL=False). Removed after measuring slower in every
H100 run (session 4, BENCH.md keeps their numbers): the one-kernel forward prep (_prep_kernel), the first
versions of the sequential kernels (_fwd_h_o_kernel, _bwd_dh_kernel), the main backward in two V passes and
its output side in a kernel of its own (_bwd_out_kernel), the main backward reading the saved Aqk^T (MAIN_AQ)
and the prep's W/U half spread over V-block programs (_wu_v_kernel, WU_SPLIT_V); session 5: the main backward in
two V passes, one per half of the K columns (_bwd_main_ks_kernel, MAIN_KSPLIT: 1.98 vs 1.33 ms at nh=1); the K
halves as separate programs with the WY terms in a kernel of their own won at nh = 1 in session 11, and at every nh
once the WY kernel ran at 4 warps in session 12 (MAIN_SPLIT_MAX_NH).

The backward derivation (per chunk; S state entering, dS' gradient of the state leaving):
    dVn = (Q K^T o Gam o M)^T dO + Kd dS'                 dS = e^gC dS' + (e^g Q)^T dO - W^T dVn
    dQ  = e^g dO S^T + (dO Vn^T o Gam o M) K             dK += (dO Vn^T o Gam o M)^T Q + e^{gC-g} Vn dS'^T
    dW  = -dVn S^T,  dT = dW Kb^T + dVn Vb^T,  dKb = T^T dW,  dVb = T^T dVn,  dA = -T^T dT T^T (strict lower)
    A = beta (K K^T o Gam): dbeta += rowsum(dA o KK o Gam), dK += (dA beta o Gam) K + (..)^T K, dg via dA o A
and the gradient of every exp(gamma) factor goes to the within-chunk cumulative log gate, which a
reverse cumsum maps back to the per-row (per-token) log gate.
"""
from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ..autotune import autotune
from ._common import check_inputs
from .l2norm import l2norm_triton

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SUPPORTED_CHUNKS = (16, 32, 64)
# From which nh the S-independent output terms are computed in the parallel prep (_wu_kernel; O = O_loc + Qe S)
# instead of inside the sequential forward kernel. Measured on an H100 (B8 T2048 H16 K128 V256 bf16):
# nh=1 1.03 ms inside vs 1.36 ms in prep (the 64-token query tile of nh=1 overloads the prep kernel);
# nh=2 2.04 ms inside vs 1.58 ms in prep (session 1); again with the kernels of session 2 at nh=1: 1.275 in
# prep vs 1.074 inside.
INTRA_MIN_NH = int(os.environ.get("LM_DELTAPRODUCT_INTRA_MIN_NH", "2"))
# T = (I + A)^-1 stored in k's dtype (it is only ever used as a tensor-core operand in that dtype) or float32
TM_IN_K_DTYPE = True
# _wu_kernel: SCALE_T folds beta and the decay into T's columns instead of scaling the K and V tiles (measured
# in the one-kernel prep of session 2: on for nh>=2, nh=3 no-grad 1.988 vs 2.022; off for nh=1, 1.027 vs
# 1.074). None: that choice; True/False force it.
PREP_SCALE_T = None
# The forward prep was two launches: _kkt_inv_kernel (gate cumsum, A and T = (I+A)^-1) and _wu_kernel (W, U and
# with INTRA the intra-chunk output terms, pipelined over V); one kernel for both (255 registers, 2 programs per
# SM) was slower at every nh (BENCH.md, sessions 3 and 4), and was removed. Since session 10 U is formed in the
# sequential forward, and the rest of _wu_kernel's work runs at the end of _kkt_inv_kernel (KKT_FUSE_WU below).
# Launch configs (meta, num_warps, num_stages) of the two split kernels (compiled GPU runs; FIXED overrides).
# _kkt_inv_kernel at 2 warps: nh=1 forward 0.912 ms (4 warps 1.091, 1 warp 0.925; run 1); _wu_kernel at 3
# stages (nh=1 1.075 vs 1.091 at 2 stages, run 1) and capped at 168 registers (ptx maxnreg), so that three
# programs fit on an SM instead of two at nh >= 2 (188 registers uncapped; no spills at 168 for nh=2, 2 for nh=3;
# nh=1 needs 128 anyway): forward with grad nh=2/3 1.548/2.230 vs 1.614/2.308 ms (H100 session 5 run 1).
KKT_INV_CONFIG = ({}, 2, 1)
WU_CONFIG = ({"BV": 64}, 4, 3, 168)
# _wu_kernel without its V loop (U formed in the sequential forward, U_IN_H_O_MIN_NH): 1 stage, capped at 128
# registers (no spills), four programs per SM: forward with grad nh=2/3 1.346/1.970 vs 1.363/1.996 ms at WU_CONFIG
# (162 registers, three per SM) and 1.370/2.004 at 8 warps capped at 80 (H100 session 10 run 2).
WU_CONFIG_NO_U = ({"BV": 64}, 4, 1, 128)
# With U formed in the sequential forward (U_IN): _wu_kernel's work (W, Aqk) done at the end of _kkt_inv_kernel, in
# one launch with T still in L2 (KKT_FUSE_WU; its launch config then KKT_WU_CONFIG). H100 session 10 runs 4-5: the
# fused launch at 2 warps 0.158/0.377/0.539 ms vs 0.143+0.059/0.278+0.177/0.405+0.269 for the two (nh=1/2/3),
# forward with grad 0.726/1.258/1.835 vs 0.774/1.342/1.961, f+b 2.371/3.824/5.536 vs 2.420/3.909/5.655; at 4 warps
# (201-255 registers, 2 programs per SM) it is much slower (0.298/0.629/0.904).
KKT_FUSE_WU = True
KKT_WU_CONFIG = ({}, 2, 1)
# _kkt_inv_kernel computes all ten A blocks before the inversions, so the four K blocks die early (nh=1
# forward 0.837 vs 0.886 ms, kkt kernel ~0.17 vs 0.21; run 2).
KKT_EARLY_A = True
# _kkt_inv_kernel's 16x16 block merges on tf32 tensor cores for bf16 inputs, whose T is stored in bf16 anyway
# (float32 inputs keep ieee): nh=1 forward 0.860 vs 0.886 ms alone, 0.810 with KKT_EARLY_A (kkt 0.144 ms);
# float64 check at the bench shape unchanged (o 3.9e-3, worst gradient 4.6e-3).
KKT_MERGE_TF32 = True
# Launch config of the sequential forward kernel when it saves for backward (SAVE), or None: the same as the
# no-grad path. BV is split across programs; each S column block is computed the same way in both paths.
# One stage (less shared memory for the state and Vn stores): forward with grad nh=1/2/3 1.114/2.160/2.932 vs
# 1.160/2.255/3.065 ms with the no-grad config (BV 64, 4 warps, 2 stages); BV 32 was slower (1.498/2.343/3.174).
H_O_SAVE_CONFIG = ({"BV": 64}, 4, 1)
# Sequential backward kernel computes Aqk^T dO itself (the state-independent part of dVn) instead of reading
# it from _bwd_dvloc_kernel (one launch and a write + read of a V-sized tensor fewer): f+b nh=1/2/3
# 3.077/4.994/6.909 vs 3.086/5.374/7.460 ms unfused.
DH_FUSE_DVL = True
# Launch config (meta, num_warps, num_stages) of _bwd_dh_v2_kernel, or None: BV 64 (_blocks), 4 warps, 2 stages
# (BV 32 measured slower: f+b nh=2 5.184 vs 4.994 ms, run 1).
DH_CONFIG = None
# REBASE for the main backward kernel (f+b nh=1/2/3: 3.070/4.948/7.033 vs 3.152/5.093/7.594 without)
MAIN_REBASE = True
# Main backward kernel: load the K and Q tiles after the V loop (they are only used after it): main kernel
# nh=1/2/3 1.328/2.019/2.885 vs 1.370/2.139/2.938 ms (run 2).
MAIN_LATE_LOADS = True
# Measured and removed (H100 session 10 run 5): beta's gradient through U as colsum(T o dVn V^T) once after the V loop
# instead of a row reduction per V block (main kernel nh=1/2/3 1.374/2.218/3.102 vs 1.249/1.995/2.807 ms: 90/60/58
# spills vs 76/40/40), dK's two A-terms as one product (dP + dP^T) K (1.573/2.394/3.420: the register transpose spills).
# Up to which nh the main backward stores dbeta in float32 (then a cast kernel follows) instead of in beta's dtype.
# H100 session 11 (B8 T2048 H16 K128 V256 bf16, f+b ms): nh=2/3 3.820/5.503 stored in bf16 vs 3.840/5.553 with the
# cast (run 2), 3.813/5.505 vs 3.839/5.553 (run 3); nh=1 2.493 vs 2.378 (run 2): the bf16 store costs the nh = 1
# kernel spills (sm_90: 344 vs 304 B of stack).
# Measured and removed (session 11 runs 1-2): the main backward reading the forward's Aqk (the prep's, or the nh = 1
# sequential forward's Aqk^T) for dAqk o Aqk instead of forming Q K^T again: nh=2/3 3.870/5.570 (the load's latency
# is exposed after the V loop, once per program, 93 waves at nh = 3), nh=1 2.371 (no gain); 16-wide V blocks for
# the main backward (fewer spills at nh = 2, 3 but f+b 4.47/6.58 at 5 stages).
MAIN_DB_FP32_MAX_NH = 1
# Up to which nh the main backward runs as two kernels (_bwd_qk_kernel on K slices of MAIN_SPLIT_BK, then
# _bwd_wy_kernel) instead of _bwd_main_kernel, for key heads of at least two slices. The state loop on 64-wide K
# slices has half the accumulators: 4 warps, 255 registers, 0 spills, two programs per SM, so one program's loads
# overlap the other's epilogue; it costs a second read of Vn, dVn and dO (through L2: a chunk's slices run side by
# side) and dW / dk written by the first kernel and read by the second. H100 session 11 run 4 (B8 T2048 H16 K128 V256
# bf16, f+b ms): nh=1 2.241 vs 2.378 fused (state loop 0.593 + WY 0.518 vs 1.246), but nh=2/3 3.943/5.783 vs
# 3.805/5.499 (at 21-32 tokens per chunk the extra traffic outweighs the overlap); the state loop at 8 warps (1 per
# SM) 2.451 / capped at 128 registers 2.374 at nh=1; run 5: nh=1 2.239 vs 2.376. The WY kernel at 3 stages instead of
# 2 (_BASE["wy"]; runs 6-7): 2.191 / 2.182 vs 2.241 / 2.250 (the kernel 0.463 vs 0.526 ms); 4 stages 2.186; the state
# loop at 4 stages 2.182 (no change); 32-wide K slices 2.458 (capped at 168 registers for 3 per SM: 2.328). The split with a single
# slice (key heads of 32) gave NaN dk and wrong dbeta / dg on the H100 in run 4 (test_gpu_bf16_small_heads; the
# interpreter runs it right), while two-slice splits passed there (BK 32 at K = 64 in run 5's probe, BK 64 at K = 128 -
# 256 in the op tests): one-slice heads keep the fused kernel, which has no accumulators to halve there anyway.
# Session 12: with dg's dA terms formed before the dk products in _wy_terms, the WY kernel runs at 4 warps without
# spills (two programs per SM instead of one at 8 warps): run 2, f+b nh=1/2/3 2.047/3.555/5.199 vs 2.187/3.846/5.641
# with the WY kernel at 8 warps, 2.506/3.757/5.451 fused (the WY kernel 0.313 vs 0.463 ms at nh = 1, run 1), so the
# split now runs at every nh. The state loop at nh >= 2 at 8 warps capped at 128 registers (2 per SM) 3.669/5.382, at
# 4 warps capped at 168 (3 per SM) 3.647/5.326 (QK_CONFIG_NH2). The state loop at 4 pipeline stages instead of 3
# (_BASE["qk"]; 59 / 74 KB of shared memory, still two per SM): runs 3 / 4 2.044 / 2.039, 3.520 / 3.520, 5.141 / 5.136
# vs 2.051 / 2.052, 3.549 / 3.543, 5.193 / 5.185; the WY kernel at 2 / 4 stages 2.076 / 2.041, 3.600 / 3.537, 5.272 /
# 5.191 (run 3: 3 kept).
MAIN_SPLIT_MAX_NH = 99
MAIN_SPLIT_BK = 64
# The split's WY kernel stores dbeta in float32 and casts after (True) or in beta's dtype (False). H100 session 12 run 2
# (WY kernel at 4 warps): nh=1/2/3 2.043/3.541/5.186 in bf16 vs 2.047/3.555/5.199 (at 8 warps in run 1: 2.217 vs 2.199
# at nh = 1).
SPLIT_DB_FP32 = False
# The WY kernel for key heads over 128 (_BASE["wy"] below is for K <= 128): 8 warps (at 4 its [BT, K] tiles spill
# 2.6 KB on sm_90 at K = 256, 392 B at 8).
WY_CONFIG_WIDE_K = ({"BV": 64}, 8, 3)
# The state loop at nh >= 2 (None: _BASE["qk"], as at nh = 1).
QK_CONFIG_NH2 = None
# Main backward launch config (meta, num_warps, num_stages) or None (_BASE["main"]).
MAIN_CONFIG = None
# The main backward at nh = 1 (unless MAIN_CONFIG is set): 5 pipeline stages. H100 session 5 run 3 (lead): f+b
# 2.508 vs 2.534 ms at 4 stages (nh=2/3: 4.143/5.933 vs 4.126/5.961, so the autotuned 4 stays there).
MAIN_CONFIG_NH1 = ({"BV": 32}, 8, 5)
# From which nh the forward with grad skips the Vn store and the main backward recomputes Vn = U - W S from U
# (written by _wu_kernel anyway, kept for the backward instead of Vn), W and the saved chunk state it loads (one
# [BT, K] x [K, BV] product more per V block there). Off (99): H100 session 4 run 1, forward with grad nh=2/3
# 1.531/2.197 vs 1.615/2.309 ms, but f+b 4.636/6.862 vs 4.225/6.067 (the main backward spills more: 1.56 vs
# 1.32 ms at nh=1, 2.53 vs 2.02 at nh=2) and nh=1 2.962 vs 2.703.
VN_RECOMPUTE_MIN_NH = 99
# The forward with grad stores Aqk^T = (Q K^T o Gam o M)^T scale per chunk ([BT, BQ] in k's dtype, written by one
# program: _wu_kernel for nh >= INTRA_MIN_NH, the V-block-0 program of the sequential forward otherwise), and the
# sequential backward reads it instead of recomputing Q K^T and its decay in every V-block program (needs
# DH_FUSE_DVL). None: only where the sequential forward forms Aqk itself (nh < INTRA_MIN_NH); True/False force.
# H100 session 4 run 1: nh=1 f+b 2.577 vs 2.703 ms (sequential backward 0.411 vs 0.571), forward with grad
# 0.852 vs 0.836; at nh=2/3 f+b 4.506/6.481 vs 4.225/6.067 (the sequential backward grows to 0.876 / 1.287 ms).
AQK_SAVE = None
# nh >= INTRA_MIN_NH: _wu_kernel stores Aqk ([BQ, BT] per chunk in k's dtype) instead of O_loc = Aqk U ([BQ, V]), and
# the sequential forward forms O_loc = Aqk U from the U tile it loads anyway (one [BQ, BT] x [BT, BV] product per
# chunk, off the state recurrence); the tile it loads is the same size as the O_loc tile it no longer reads. Saves
# ~0.1 GB of writes at nh=2 (B8 T2048 H16 V256). On with OLOC_NO_QE (H100 session 5 run 3, lead, "oloc_noqe" vs
# "new"): forward with grad nh=2/3 1.494/2.191 vs 1.550/2.238 ms, f+b 4.078/5.908 vs 4.126/5.961 (nh=1 unchanged).
OLOC_IN_H_O = True
# With OLOC_IN_H_O: _wu_kernel does not form or store Qe = e^g Q - Aqk W either; the sequential forward computes
# o = scale e^g Q S + Aqk Vn (the nh=1 formula) from the Q tile, the stored Aqk and the Vn it forms anyway (~67 MB
# fewer writes and one [BQ, BT] x [BT, K] product less in the prep). On (see OLOC_IN_H_O; OLOC_IN_H_O alone: 1.514 /
# 2.214 ms forward with grad at nh=2/3).
OLOC_NO_QE = True
# The forward with grad stores the state entering every second chunk of a sequence only (local index 0, 2, ..);
# before the main backward, _fill_states_kernel forms the others from the one before (S_c = e^gC S_c-1 +
# Kd_c-1^T Vn_c-1, from the stored bf16 state and Vn). Halves the state stores of the forward (0.27 GB at nh=2) for
# a parallel pass in the backward (~0.7 GB of traffic at nh=2). Needs Vn stored. Off: H100 session 5 run 3 (lead),
# with the OLOC switches ("b_all" vs "oloc_noqe"): forward with grad nh=2/3 1.418/2.069 vs 1.494/2.191 ms (0.890 /
# 0.921 of fla) but f+b 4.364/6.351 vs 4.078/5.908, i.e. 3.08/3.07 x the forward with grad (limit 3).
STATES_EVERY2 = False
# Switches of the sequential forward, each one value or a (forward with grad, no-grad forward) pair. Session 9
# (H100, ncu source view of the SAVE launch at nh=2: half of the warp stalls waited on the chunk's tile loads, a
# further 13% on the query tiles loaded after Vn = U - W S, i.e. a second load latency per chunk):
# H_O_Q_EARLY: the query tiles (Q, its gates, Aqk) are loaded at the top of the chunk with W, U and K^T;
# H_O_QPAD: the query tile padded to this many rows (None: BQ; nh >= 2 has BQ = 32): at 64 rows both products with
# the state are warpgroup MMAs and share one shared-memory copy of it (BQ < 64 takes mma.sync from a second copy);
# H_O_STORE_LATE: the forward with grad stores the state entering a chunk after that chunk's loads are issued, so
# that the store (a layout conversion through shared memory) overlaps their latency.
# Together, same process as fla 0.6.0 (B8 T2048 H16 K128 V256 bf16): forward with grad nh=1/2/3 0.777/1.430/2.082
# vs 0.849/1.510/2.209 ms, no-grad 0.689/1.200/1.696 vs 0.733/1.261/1.832, f+b 2.420/3.993/5.776 vs 2.491/4.064/
# 5.903. Measured and removed: the next chunk's W / U / K^T / query tiles loaded into registers during the current
# chunk's state update (4 variants: slower, with or without spills), the output and Vn stores after the state
# update is issued (no gain), the state-gradient store of the sequential backward after its loads (slower).
H_O_Q_EARLY = True
H_O_QPAD = 64
H_O_STORE_LATE = True
# From which nh the sequential forward forms U = T diag(beta) V itself (one [BT, BT] x [BT, BV] product per chunk, off
# the state recurrence, from the V tile and T) instead of reading U from _wu_kernel, which then has no V loop: U is
# used nowhere else (the backward reads Vn), so its write and read (2 x 0.4 GB at nh = 3 on the bench shape) go. One
# value or a (forward with grad, no-grad forward) pair. Not with VN_RECOMPUTE (the backward reads U there) nor with
# INTRA without OLOC_IN_H_O (O_loc needs U in the prep). H100 session 10 (same process as fla 0.6.0): forward with grad
# nh=1/2/3 0.777/1.363/1.996 vs 0.819/1.475/2.142 ms (sequential forward +0.07/+0.08/+0.13 ms, _wu_kernel -0.10/-0.19/
# -0.28), f+b 2.422/3.937/5.703 vs 2.467/4.051/5.852; the no-grad forward is unchanged (1.746 vs 1.748 at nh=3: its
# sequential kernel spills 24 B at nh >= 2 with U_IN). Slower and removed: U and W S in one accumulator (2.061 ms at
# nh=3, run 2), the U product issued just before W S instead of after the V and T loads (run 3: 2.024 vs 1.964),
# beta folded into the V rows or T taken as a shared-memory operand (more spills on sm_90: 32-56 B).
U_IN_H_O_MIN_NH = 1
# Benchmarks only: kernel name -> (meta dict, num_warps, num_stages) launched as given instead of the defaults,
# e.g. {"main": ({"BV": 64}, 8, 1)}; names: kkt_inv, wu, h_o, h_o_save (the SAVE launch), dh, main.
FIXED: dict = {}


_SEQUENTIAL = ("h_o", "h_o_save", "dh")  # the chunk-sequential kernels (see _launch)
# Compiled GPU runs launch every kernel at a fixed config: `default` where the call gives one, else this (also the
# one-entry autotune lists of these kernels, _base_configs; the interpreter runs its own small config)
_BASE = {"h_o": ({"BV": 64}, 4, 1), "dh": ({}, 4, 2), "main": ({"BV": 32}, 8, 4), "fill": ({}, 4, 1),
         "qk": ({"BV": 32}, 4, 4), "wy": ({"BV": 64}, 4, 3)}
_FIT: dict = {}  # (name, config, dtype, constexprs) -> the config that fit in shared memory


def _refused(name, bv, nw, ns):
    return name in _SEQUENTIAL and bv is not None and bv < 64 and nw >= 4 and ns == 1


def _smaller(name, meta, nw, ns, kw, vary_bv=True):
    """Configs to try after an out-of-shared-memory launch, in order: fewer pipeline stages, then (vary_bv: where the
    grid follows BV or does not depend on it) narrower V blocks, at 2 warps for the sequential kernels where 4 would hit
    the refused config. Same results, less shared memory."""
    bv0 = meta.get("BV", kw.get("BV"))
    for bv in ([bv0] if bv0 is None or not vary_bv else [b for b in (bv0, bv0 // 2, bv0 // 4) if b >= 16]):
        for st in range(ns, 0, -1):
            if (bv, st) != (bv0, ns):
                yield ({**meta, "BV": bv} if bv is not None else dict(meta)), \
                    (2 if _refused(name, bv, nw, st) else nw), st


def _launch(kern, name, grid, args, kw, default=None):
    """kern[grid](*args, **kw) at the fixed config FIXED[name], else `default`, else _BASE[name] (compiled GPU runs;
    the interpreter runs the autotune list): (meta, num_warps, num_stages) or (meta, num_warps, num_stages, maxnreg).
    grid is a tuple or a function of the meta-parameters. A config that needs more shared memory than the GPU has
    (wide key heads, float32 inputs) is retried with fewer stages, then narrower V blocks (_smaller), with a warning;
    the config that fit is remembered for these constexprs and dtype."""
    fixed = FIXED.get(name, default if default is not None else _BASE.get(name))
    if fixed is None or _INTERPRET:
        kern[grid](*args, **kw)
        return
    meta, nw, ns = fixed[:3]
    if _refused(name, meta.get("BV", 64), nw, ns):
        raise ValueError(
            f"{name}: V blocks of {meta['BV']} at {nw} warps and 1 stage gave wrong results or illegal addresses on "
            "an H100 with triton 3.6 (session 9, lm_kernels/deltaproduct/BENCH.md); use BV 64, 2 warps or 2 stages")
    cap = fixed[3] if len(fixed) > 3 else None  # a register cap (ptx .maxnreg): more programs per SM
    key = (name, repr(fixed), str(args[0].dtype), tuple(sorted((k, v) for k, v in kw.items()
                                                             if isinstance(v, (bool, int, float, str)))))
    tries = [_FIT[key]] if key in _FIT else \
        [(meta, nw, ns), *_smaller(name, meta, nw, ns, kw, vary_bv=callable(grid) or "BV" in meta)]
    err = None
    for m, w, st in tries:
        kwm = {**kw, **m}
        if cap:
            kwm["maxnreg"] = cap
        try:
            kern.fn[grid(kwm) if callable(grid) else grid](*args, **kwm, num_warps=w, num_stages=st)
        except OutOfResources as e:
            err = err or e
            continue
        if key not in _FIT:
            _FIT[key] = (m, w, st)
            if err is not None:
                warnings.warn(f"lm_kernels.deltaproduct: {name} at {meta}, {nw} warps, {ns} stages needs more shared "
                              f"memory than this GPU has ({err}); running {m}, {w} warps, {st} stages (same results, "
                              "slower)", stacklevel=3)
        return
    raise err


def _base_configs(name, interpret_meta=None):
    """The autotune list of a kernel that compiled runs launch at _BASE[name] (see _launch): that config, or the
    interpreter's (4 warps, 1 stage, interpret_meta)."""
    if _INTERPRET:
        return [triton.Config(interpret_meta or {}, num_warps=4, num_stages=1)]
    meta, nw, ns = _BASE[name]
    return [triton.Config(meta, num_warps=nw, num_stages=ns)]


def _configs(warps, stages):
    if _INTERPRET:
        return [triton.Config({}, num_warps=4, num_stages=1)]
    return [triton.Config({}, num_warps=w, num_stages=s) for w in warps for s in stages]


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _inv16(A):
    """(I + A)^-1 for a strictly lower-triangular 16x16 fp32 A, by forward substitution on rows."""
    o = tl.arange(0, 16)
    X = -A
    for i in tl.static_range(2, 16):
        x = tl.sum(tl.where((o == i)[:, None], X, 0.0), 0)
        x = x + tl.sum(x[:, None] * X, 0)
        X = tl.where((o == i)[:, None], x[None, :], X)
    return X + tl.where(o[:, None] == o[None, :], 1.0, 0.0)


@triton.jit
def _load_blk(k, beta, gc, r0, eos, i_h, i: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    rows = r0 + i * 16 + tl.arange(0, 16)
    m = rows < eos
    o_k = tl.arange(0, BK)
    kk = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m[:, None] & (o_k < K)[None, :],
                 other=0.0)
    bb = tl.load(beta + rows * H + i_h, mask=m, other=0.0).to(tl.float32)
    gg = tl.load(gc + rows * H + i_h, mask=m, other=0.0)
    return kk, bb, gg, m


@triton.jit
def _akk(ki, bi, gi, mi, kj, gj, mj, DIAG: tl.constexpr, PREC: tl.constexpr):
    """A_ij = beta_i (K_i K_j^T) o exp(g_i - g_j) on valid pairs (strictly lower on the diagonal)."""
    a = tl.dot(ki, tl.trans(kj), input_precision=PREC)
    m = mi[:, None] & mj[None, :]
    if DIAG:
        o = tl.arange(0, 16)
        m = m & (o[:, None] > o[None, :])
    d = tl.where(m, gi[:, None] - gj[None, :], float("-inf"))
    return tl.where(m, a * bi[:, None] * tl.exp(d), 0.0)


@triton.jit
def _mm(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _mmp(P: tl.constexpr, a, b):
    return tl.dot(a, b, input_precision=P)


@triton.jit
def _store_blk(T, r0, eos, i_h, i: tl.constexpr, j: tl.constexpr, X, H: tl.constexpr, BT: tl.constexpr):
    rows = r0 + i * 16 + tl.arange(0, 16)
    cols = j * 16 + tl.arange(0, 16)
    tl.store(T + (rows[:, None] * H + i_h) * BT + cols[None, :], X.to(T.dtype.element_ty), mask=(rows < eos)[:, None])


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------
# One config per kernel, the fastest the autotuner found on an H100 at B8 T2048 H16 K128 V256 nh=1 bf16
# (among those named beside each); a single config compiles once and is never re-timed at start.
@autotune(configs=_configs([4], [1]), key=["H", "K", "BT", "NH", "EARLY_A", "MP", "FUSE_WU", "INTRA", "SAVE_AQ"])
@triton.jit
def _kkt_inv_kernel(k, beta, g, gc, Tm, chunk_seq, chunk_row, cu_rows,
                    q, v, w, u, qe, o, aq, aqf, scale,
                    NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                    USE_G: tl.constexpr, PREC: tl.constexpr, EARLY_A: tl.constexpr,
                    MP: tl.constexpr, FUSE_WU: tl.constexpr = False, V: tl.constexpr = 16, BV: tl.constexpr = 16,
                    BQ: tl.constexpr = 16, INTRA: tl.constexpr = False, SCALE_T: tl.constexpr = False,
                    SAVE_AQ: tl.constexpr = False, AQF: tl.constexpr = False, NOQE: tl.constexpr = False):
    """First half of the forward prep: within-chunk gate cumsum (gc) and T = (I + A)^-1,
    A = strict_lower(beta (K K^T o Gam)), by 16x16 block inversions and merges (the merge products at
    precision MP: "ieee", or "tf32" for bf16 inputs whose T is stored in bf16 anyway). Holds only the four 16-row
    K blocks and 16x16 fp32 blocks, so many programs fit on an SM. FUSE_WU (KKT_FUSE_WU): then, after a barrier,
    _wu_kernel's work on the same chunk (W, and Aqk for INTRA; never U) from T as just stored, in the same launch."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    n = tl.load(chunk_seq + i_c)
    r0 = tl.load(chunk_row + i_c).to(tl.int64)
    eos = tl.load(cu_rows + n + 1).to(tl.int64)
    ph = (r0 % NH).to(tl.int32)  # sub-step of the chunk's first row
    t0 = r0 // NH
    k += (r0 * H + i_h) * K
    beta += r0 * H + i_h
    gc += r0 * H + i_h
    Tm += (r0 * H + i_h) * BT
    g += t0 * H + i_h
    eos = (eos - r0).to(tl.int32)
    o_t = tl.arange(0, BT)
    m_t = o_t < eos
    if USE_G:
        gl = tl.load(g + ((o_t + ph) // NH) * H, mask=m_t & ((o_t + ph) % NH == 0), other=0.0).to(tl.float32)
    else:
        gl = tl.zeros([BT], dtype=tl.float32)
    gcs = tl.cumsum(gl, 0)
    tl.store(gc + o_t * H, gcs, mask=m_t)
    tl.debug_barrier()
    if EARLY_A and BT >= 64:
        # all ten A blocks first, so the four K blocks die before the inversions start
        k1, b1, g1, m1 = _load_blk(k, beta, gc, 0, eos, 0, 0, H, K, BK)
        k2, b2, g2, m2 = _load_blk(k, beta, gc, 0, eos, 0, 1, H, K, BK)
        k3, b3, g3, m3 = _load_blk(k, beta, gc, 0, eos, 0, 2, H, K, BK)
        k4, b4, g4, m4 = _load_blk(k, beta, gc, 0, eos, 0, 3, H, K, BK)
        A11 = _akk(k1, b1, g1, m1, k1, g1, m1, True, PREC)
        A22 = _akk(k2, b2, g2, m2, k2, g2, m2, True, PREC)
        A33 = _akk(k3, b3, g3, m3, k3, g3, m3, True, PREC)
        A44 = _akk(k4, b4, g4, m4, k4, g4, m4, True, PREC)
        A21 = _akk(k2, b2, g2, m2, k1, g1, m1, False, PREC)
        A31 = _akk(k3, b3, g3, m3, k1, g1, m1, False, PREC)
        A32 = _akk(k3, b3, g3, m3, k2, g2, m2, False, PREC)
        A41 = _akk(k4, b4, g4, m4, k1, g1, m1, False, PREC)
        A42 = _akk(k4, b4, g4, m4, k2, g2, m2, False, PREC)
        A43 = _akk(k4, b4, g4, m4, k3, g3, m3, False, PREC)
        T11 = _inv16(A11)
        T22 = _inv16(A22)
        T33 = _inv16(A33)
        T44 = _inv16(A44)
        T21 = -_mmp(MP, _mmp(MP, T22, A21), T11)
        _store_blk(Tm, 0, eos, 0, 0, 0, T11, H, BT)
        _store_blk(Tm, 0, eos, 0, 1, 0, T21, H, BT)
        _store_blk(Tm, 0, eos, 0, 1, 1, T22, H, BT)
    else:
        k1, b1, g1, m1 = _load_blk(k, beta, gc, 0, eos, 0, 0, H, K, BK)
        T11 = _inv16(_akk(k1, b1, g1, m1, k1, g1, m1, True, PREC))
        _store_blk(Tm, 0, eos, 0, 0, 0, T11, H, BT)
        if BT >= 32:
            k2, b2, g2, m2 = _load_blk(k, beta, gc, 0, eos, 0, 1, H, K, BK)
            T22 = _inv16(_akk(k2, b2, g2, m2, k2, g2, m2, True, PREC))
            A21 = _akk(k2, b2, g2, m2, k1, g1, m1, False, PREC)
            T21 = -_mmp(MP, _mmp(MP, T22, A21), T11)
            _store_blk(Tm, 0, eos, 0, 1, 0, T21, H, BT)
            _store_blk(Tm, 0, eos, 0, 1, 1, T22, H, BT)
        if BT >= 64:
            k3, b3, g3, m3 = _load_blk(k, beta, gc, 0, eos, 0, 2, H, K, BK)
            k4, b4, g4, m4 = _load_blk(k, beta, gc, 0, eos, 0, 3, H, K, BK)
            T33 = _inv16(_akk(k3, b3, g3, m3, k3, g3, m3, True, PREC))
            T44 = _inv16(_akk(k4, b4, g4, m4, k4, g4, m4, True, PREC))
            A31 = _akk(k3, b3, g3, m3, k1, g1, m1, False, PREC)
            A32 = _akk(k3, b3, g3, m3, k2, g2, m2, False, PREC)
            A41 = _akk(k4, b4, g4, m4, k1, g1, m1, False, PREC)
            A42 = _akk(k4, b4, g4, m4, k2, g2, m2, False, PREC)
            A43 = _akk(k4, b4, g4, m4, k3, g3, m3, False, PREC)
    if BT >= 64:
        T32 = -_mmp(MP, _mmp(MP, T33, A32), T22)
        T43 = -_mmp(MP, _mmp(MP, T44, A43), T33)
        T31 = -_mmp(MP, T33, _mmp(MP, A31, T11) + _mmp(MP, A32, T21))
        T42 = -_mmp(MP, T44, _mmp(MP, A42, T22) + _mmp(MP, A43, T32))
        T41 = -_mmp(MP, T44, _mmp(MP, A41, T11) + _mmp(MP, A42, T21) + _mmp(MP, A43, T31))
        _store_blk(Tm, 0, eos, 0, 2, 0, T31, H, BT)
        _store_blk(Tm, 0, eos, 0, 2, 1, T32, H, BT)
        _store_blk(Tm, 0, eos, 0, 2, 2, T33, H, BT)
        _store_blk(Tm, 0, eos, 0, 3, 0, T41, H, BT)
        _store_blk(Tm, 0, eos, 0, 3, 1, T42, H, BT)
        _store_blk(Tm, 0, eos, 0, 3, 2, T43, H, BT)
        _store_blk(Tm, 0, eos, 0, 3, 3, T44, H, BT)
    if FUSE_WU:  # T is in global memory now (visible to the whole program after the barrier)
        tl.debug_barrier()
        _wu_tile(q + (t0 * H + i_h) * K, k, v + (r0 * H + i_h) * V, beta, gc, Tm, w + (r0 * H + i_h) * K,
                 u + (r0 * H + i_h) * V, qe + (t0 * H + i_h) * K, o + (t0 * H + i_h) * V, aq, aqf, i_c, i_h, ph,
                 tl.minimum(eos, BT), scale, NH, H, K, V, BT, BK, BV, BQ, INTRA, PREC, SCALE_T, SAVE_AQ, AQF, NOQE,
                 False)


def _wu_configs():
    if _INTERPRET:
        return [triton.Config({"BV": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BV": 64}, num_warps=4, num_stages=2)]


@autotune(configs=_wu_configs(), key=["H", "K", "V", "BT", "NH", "INTRA", "SCALE_T", "SAVE_AQ", "AQF", "NOQE", "U_OUT"])
@triton.jit
def _wu_kernel(q, k, v, beta, gc, Tm, w, u, qe, o, aq, aqf, chunk_seq, chunk_row, cu_rows, scale,
               NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, BQ: tl.constexpr, INTRA: tl.constexpr, PREC: tl.constexpr,
               SCALE_T: tl.constexpr, SAVE_AQ: tl.constexpr, AQF: tl.constexpr, NOQE: tl.constexpr,
               U_OUT: tl.constexpr = True):
    """Second half of the forward prep (T and gc from _kkt_inv_kernel): W = T diag(beta e^g) K,
    U = T diag(beta) V over V blocks (software-pipelined by num_stages), and with INTRA the outputs' state-
    independent terms O_loc = Aqk U and Qe = e^g Q - Aqk W; AQF (OLOC_IN_H_O): Aqk itself is stored for the
    sequential forward instead of O_loc; NOQE (OLOC_NO_QE): no Qe either. Without U_OUT (U_IN_H_O_MIN_NH) U is not
    formed here (the sequential forward forms it from V and T): no V loop."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    n = tl.load(chunk_seq + i_c)
    r0 = tl.load(chunk_row + i_c).to(tl.int64)
    eos = tl.load(cu_rows + n + 1).to(tl.int64)
    ph = (r0 % NH).to(tl.int32)
    t0 = r0 // NH
    _wu_tile(q + (t0 * H + i_h) * K, k + (r0 * H + i_h) * K, v + (r0 * H + i_h) * V, beta + r0 * H + i_h,
             gc + r0 * H + i_h, Tm + (r0 * H + i_h) * BT, w + (r0 * H + i_h) * K, u + (r0 * H + i_h) * V,
             qe + (t0 * H + i_h) * K, o + (t0 * H + i_h) * V, aq, aqf, i_c, i_h, ph,
             (tl.minimum(eos - r0, BT)).to(tl.int32), scale, NH, H, K, V, BT, BK, BV, BQ, INTRA, PREC, SCALE_T,
             SAVE_AQ, AQF, NOQE, U_OUT)


@triton.jit
def _wu_tile(q, k, v, beta, gc, Tm, w, u, qe, o, aq, aqf, i_c, i_h, ph, nt, scale,
             NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, BQ: tl.constexpr, INTRA: tl.constexpr, PREC: tl.constexpr,
             SCALE_T: tl.constexpr, SAVE_AQ: tl.constexpr, AQF: tl.constexpr, NOQE: tl.constexpr,
             U_OUT: tl.constexpr):
    """_wu_kernel's work on one (chunk, head): the row pointers already at the chunk's first row (q, qe, o at its
    first token), nt rows (<= BT), ph the sub-step of the first row; also run by _kkt_inv_kernel with FUSE_WU."""
    o_t = tl.arange(0, BT)
    m_t = o_t < nt
    o_k = tl.arange(0, BK)
    mk = o_k < K
    gcs = tl.load(gc + o_t * H, mask=m_t, other=0.0)
    tri = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    b_T = tl.load(Tm + o_t[:, None] * (H * BT) + o_t[None, :], mask=tri, other=0.0)
    b_b = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & mk[None, :], other=0.0)
    kdt = b_k.dtype
    if SCALE_T:
        b_Tf = b_T.to(tl.float32)
        b_Tw = (b_Tf * (b_b * tl.exp(gcs))[None, :]).to(kdt)
        b_T = (b_Tf * b_b[None, :]).to(kdt)
        b_w = tl.dot(b_Tw, b_k, input_precision=PREC).to(kdt)
    else:
        b_T = b_T.to(kdt)
        b_kb = (b_k.to(tl.float32) * (b_b * tl.exp(gcs))[:, None]).to(kdt)
        b_w = tl.dot(b_T, b_kb, input_precision=PREC).to(kdt)
    tl.store(w + o_t[:, None] * (H * K) + o_k[None, :], b_w.to(w.dtype.element_ty), mask=m_t[:, None] & mk[None, :])
    if INTRA:
        o_q = tl.arange(0, BQ)
        rq = o_q * NH + NH - 1 - ph  # row of each token's last sub-step, relative to the chunk's first row
        m_q = rq < nt
        b_q = tl.load(q + o_q[:, None] * (H * K) + o_k[None, :], mask=m_q[:, None] & mk[None, :], other=0.0)
        b_gq = tl.load(gc + rq * H, mask=m_q, other=0.0)
        m_qk = (rq[:, None] >= o_t[None, :]) & m_q[:, None] & m_t[None, :]
        b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        b_A = tl.where(m_qk, b_A * (scale * tl.exp(tl.where(m_qk, b_gq[:, None] - gcs[None, :], 0.0))), 0.0)
        b_Ak = b_A.to(kdt)
        if SAVE_AQ:  # Aqk^T for the sequential backward (i_c is the global chunk index)
            tl.store(aq + (i_c.to(tl.int64) * H + i_h) * (BT * BQ) + o_t[None, :] * BQ + o_q[:, None],
                     b_Ak.to(aq.dtype.element_ty))
        if AQF:  # Aqk for the sequential forward, which forms O_loc = Aqk U itself
            tl.store(aqf + (i_c.to(tl.int64) * H + i_h) * (BQ * BT) + o_q[:, None] * BT + o_t[None, :],
                     b_Ak.to(aqf.dtype.element_ty))
        if not NOQE:
            b_qe = b_q.to(tl.float32) * (scale * tl.exp(b_gq))[:, None] - tl.dot(b_Ak, b_w, input_precision=PREC)
            tl.store(qe + o_q[:, None] * (H * K) + o_k[None, :], b_qe.to(qe.dtype.element_ty),
                     mask=m_q[:, None] & mk[None, :])
    if U_OUT:
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            mv = m_t[:, None] & (o_v < V)[None, :]
            b_v = tl.load(v + o_t[:, None] * (H * V) + o_v[None, :], mask=mv, other=0.0)
            if SCALE_T:
                b_u = tl.dot(b_T, b_v, input_precision=PREC).to(kdt)
            else:
                b_vb = (b_v.to(tl.float32) * b_b[:, None]).to(kdt)
                b_u = tl.dot(b_T, b_vb, input_precision=PREC).to(kdt)
            tl.store(u + o_t[:, None] * (H * V) + o_v[None, :], b_u.to(u.dtype.element_ty), mask=mv)
            if INTRA and not AQF:
                b_ol = tl.dot(b_Ak, b_u, input_precision=PREC)
                tl.store(o + o_q[:, None] * (H * V) + o_v[None, :], b_ol.to(o.dtype.element_ty),
                         mask=m_q[:, None] & (o_v < V)[None, :])


@triton.jit
def _ho_tiles_q(q, qe, gc, aqf, c0, c, bos, eos, i_h, off_qk, o_t, o_q, mk,
                NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BQ: tl.constexpr,
                BQP: tl.constexpr, INTRA: tl.constexpr, NOQE: tl.constexpr, AQF: tl.constexpr):
    """The query tile of chunk c (Q, or Qe for INTRA without NOQE; BQP >= BQ rows, the padding masked), its gate
    cumsums and Aqk (AQF; else an unused zero tile)."""
    r0 = bos + c * BT
    re = tl.minimum(r0 + BT, eos)
    t0 = r0 // NH
    rq = (t0 + o_q) * NH + NH - 1
    m_q = (rq < re) & (o_q < BQ)
    bq = (t0.to(tl.int64) * H + i_h) * K
    if INTRA and not NOQE:
        b_q = tl.load(qe + bq + off_qk, mask=m_q[:, None] & mk[None, :], other=0.0)
    else:
        b_q = tl.load(q + bq + off_qk, mask=m_q[:, None] & mk[None, :], other=0.0)
    b_gq = tl.load(gc + rq * H + i_h, mask=m_q, other=0.0)
    if AQF:
        b_aq = tl.load(aqf + ((c0 + c) * H + i_h) * (BQ * BT) + o_q[:, None] * BT + o_t[None, :],
                       mask=(o_q < BQ)[:, None], other=0.0)
    else:
        b_aq = tl.zeros([BQP, BT], dtype=q.dtype.element_ty)
    return b_q, b_gq, b_aq


@triton.jit
def _ho_store_state(hs, b_S, c0, c, i_h, off_kv, m_kv, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                    EVERY2: tl.constexpr):
    """The sequential forward's save of the state entering local chunk c of the sequence whose first chunk is
    c0 (EVERY2: even local chunks only)."""
    if EVERY2:
        tl.store(hs + ((c0 + c) * H + i_h) * K * V + off_kv, b_S.to(hs.dtype.element_ty), mask=m_kv & (c % 2 == 0))
    else:
        tl.store(hs + ((c0 + c) * H + i_h) * K * V + off_kv, b_S.to(hs.dtype.element_ty), mask=m_kv)


# _BASE["h_o"]: among BV 32/2 warps, 32/4, 64/4, 64/8 (all 2 stages; session 2), then 64/4 at 1 stage (session 6: 73
# instead of 119 KB of shared memory, so two programs per SM instead of one for the 512 chunk chains of the bench
# shape; H100 no-grad forward nh=1/2/3 0.739/1.236/1.800 vs 0.817/1.304/1.903 ms, the forward with grad already ran 1
# stage)
@autotune(configs=_base_configs("h_o", {"BV": 16}), key=["H", "K", "V", "BT", "NH", "SAVE", "INTRA", "SAVE_VN", "SAVE_AQ",
                                                 "AQF", "NOQE", "EVERY2", "U_IN"],
                 restore_value=["o"])
@triton.jit
def _fwd_h_o_v2_kernel(q, k, w, u, qe, gc, h0, o, ht, hs, vn, aq, aqf, v, Tm, beta, cu_rows, chunk_off, scale,
                    NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                    BK: tl.constexpr, BV: tl.constexpr, BQ: tl.constexpr, USE_H0: tl.constexpr,
                    STORE_FINAL: tl.constexpr, SAVE: tl.constexpr, INTRA: tl.constexpr, PREC: tl.constexpr,
                    SAVE_VN: tl.constexpr, SAVE_AQ: tl.constexpr, AQF: tl.constexpr, NOQE: tl.constexpr,
                    EVERY2: tl.constexpr, BQP: tl.constexpr, Q_EARLY: tl.constexpr, STORE_LATE: tl.constexpr,
                    U_IN: tl.constexpr = False):
    """Sequential over the chunks of one sequence (one V block of the state per program): Vn = U - W S,
    S <- e^gC S + Kd^T Vn, and the outputs: INTRA: o = O_loc + Qe S (O_loc, Qe from _wu_kernel); else
    o = scale (e^g Q S + (Q K^T o Gam o M) Vn). K^T is loaded directly (one tile serves Q K^T and K^T Vn), the
    decays scale the small row operands (Vn rows, output rows) instead of the K and Q tiles, tile offsets are
    int32 from an int64 chunk base (no spills on sm_90, where session 1's version spilled 96-224 B/thread).
    SAVE (forward with grad): also writes the state entering each chunk, Vn (SAVE_VN) and Aqk^T (SAVE_AQ).
    AQF (with INTRA): O_loc = Aqk U from _wu_kernel's Aqk and the U tile, instead of _wu_kernel's O_loc; with NOQE
    o = scale e^g Q S + Aqk Vn from the Q tile and _wu_kernel's (scaled) Aqk, no Qe. EVERY2: SAVE stores the
    states of even chunks only (_fill_states_kernel forms the others in the backward). BQP: rows of the query tile
    (BQ padded); Q_EARLY: the query tiles loaded with the chunk's other tiles; STORE_LATE: the state store after
    them (see H_O_Q_EARLY, H_O_QPAD, H_O_STORE_LATE). U_IN: U = T diag(beta) V is formed here from the V tile, T and
    beta (off the state recurrence) instead of being read from _wu_kernel (see U_IN_H_O_MIN_NH)."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_rows + i_n)
    eos = tl.load(cu_rows + i_n + 1)
    c0 = tl.load(chunk_off + i_n).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_q = tl.arange(0, BQP)  # the query tile padded to BQP >= BQ rows (masked)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    kdt = k.dtype.element_ty
    # in-tile offsets (int32); the chunk's base offset is int64
    off_tk = o_t[:, None] * (H * K) + o_k[None, :]
    off_kt = o_k[:, None] + o_t[None, :] * (H * K)
    off_tv = o_t[:, None] * (H * V) + o_v[None, :]
    off_qk = o_q[:, None] * (H * K) + o_k[None, :]
    off_qv = o_q[:, None] * (H * V) + o_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    off_tt = o_t[:, None] * (H * BT) + o_t[None, :]
    m_kv = mk[:, None] & mv[None, :]
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0 + (i_n * H + i_h).to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0).to(tl.float32)
    for c in range(tl.cdiv(eos - bos, BT)):
        r0 = bos + c * BT
        re = tl.minimum(r0 + BT, eos)
        t0 = r0 // NH
        nt = re - r0
        if SAVE and not STORE_LATE:
            _ho_store_state(hs, b_S, c0, c, i_h, off_kv, m_kv, H, K, V, EVERY2)
        bk = (r0.to(tl.int64) * H + i_h) * K
        bv = (r0.to(tl.int64) * H + i_h) * V
        m_t = o_t < nt
        m_tv = m_t[:, None] & mv[None, :]
        m_tt = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
        b_g = tl.load(gc + (r0 + o_t) * H + i_h, mask=m_t, other=0.0)
        g_last = tl.load(gc + (re - 1) * H + i_h)
        b_w = tl.load(w + bk + off_tk, mask=m_t[:, None] & mk[None, :], other=0.0)
        if U_IN:  # U = (T diag(beta)) V; T is lower triangular (its upper blocks are never written)
            b_vv = tl.load(v + bv + off_tv, mask=m_tv, other=0.0)
            b_T = tl.load(Tm + (r0.to(tl.int64) * H + i_h) * BT + off_tt, mask=m_tt, other=0.0)
            b_bt = tl.load(beta + (r0 + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
            b_uf = tl.dot((b_T.to(tl.float32) * b_bt[None, :]).to(kdt), b_vv, input_precision=PREC)
        else:
            b_uf = tl.load(u + bv + off_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_kt = tl.load(k + bk + off_kt, mask=mk[:, None] & m_t[None, :], other=0.0)
        if Q_EARLY:
            b_q, b_gq, b_aq = _ho_tiles_q(q, qe, gc, aqf, c0, c, bos, eos, i_h, off_qk, o_t, o_q, mk,
                                          NH, H, K, BT, BQ, BQP, INTRA, NOQE, AQF)
        if SAVE and STORE_LATE:  # after the tile loads are issued: the store overlaps their latency
            _ho_store_state(hs, b_S, c0, c, i_h, off_kv, m_kv, H, K, V, EVERY2)
        b_Sk = b_S.to(kdt)
        b_vn = b_uf - tl.dot(b_w, b_Sk, input_precision=PREC)
        if SAVE and SAVE_VN:
            tl.store(vn + bv + off_tv, b_vn.to(vn.dtype.element_ty), mask=m_tv)
        if not Q_EARLY:
            b_q, b_gq, b_aq = _ho_tiles_q(q, qe, gc, aqf, c0, c, bos, eos, i_h, off_qk, o_t, o_q, mk,
                                          NH, H, K, BT, BQ, BQP, INTRA, NOQE, AQF)
        rq = (t0 + o_q) * NH + NH - 1
        m_q = (rq < re) & (o_q < BQ)
        bo = (t0.to(tl.int64) * H + i_h) * V
        m_qv = m_q[:, None] & mv[None, :]
        if INTRA and NOQE:
            b_o = tl.dot(b_q, b_Sk, input_precision=PREC) * (scale * tl.exp(b_gq))[:, None] \
                + tl.dot(b_aq, b_vn.to(kdt), input_precision=PREC)
        elif INTRA:  # b_q holds Qe here
            if AQF:
                b_o = tl.dot(b_aq, b_uf.to(kdt), input_precision=PREC) + tl.dot(b_q, b_Sk, input_precision=PREC)
            else:
                b_ol = tl.load(o + bo + off_qv, mask=m_qv, other=0.0)
                b_o = b_ol.to(tl.float32) + tl.dot(b_q, b_Sk, input_precision=PREC)
        else:
            m_qk = ((rq - r0)[:, None] >= o_t[None, :]) & m_q[:, None] & m_t[None, :]
            b_A = tl.dot(b_q, b_kt, input_precision=PREC)
            b_A = tl.where(m_qk, b_A * tl.exp(tl.where(m_qk, b_gq[:, None] - b_g[None, :], 0.0)), 0.0)
            if SAVE_AQ:
                # Aqk^T (scaled) for the sequential backward, written once per chunk (V block 0)
                tl.store(aq + ((c0 + c) * H + i_h) * (BT * BQ) + o_t[None, :] * BQ + o_q[:, None],
                         (b_A * scale).to(aq.dtype.element_ty),
                         mask=((tl.zeros([BQP, BT], dtype=tl.int32) + i_v) == 0) & (o_q < BQ)[:, None])
            b_o = tl.dot(b_q, b_Sk, input_precision=PREC) * tl.exp(b_gq)[:, None] \
                + tl.dot(b_A.to(kdt), b_vn.to(kdt), input_precision=PREC)
            b_o = b_o * scale
        tl.store(o + bo + off_qv, b_o.to(o.dtype.element_ty), mask=m_qv)
        b_vd = (b_vn * tl.exp(g_last - b_g)[:, None]).to(kdt)
        b_S = b_S * tl.exp(g_last) + tl.dot(b_kt, b_vd, input_precision=PREC)
    if STORE_FINAL:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * K * V + off_kv, b_S, mask=m_kv)


# ----------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------
@autotune(configs=_base_configs("fill"), key=["H", "K", "V", "BT", "NH"])
@triton.jit
def _fill_states_kernel(k, gc, vn, hs, chunk_seq, chunk_row, cu_rows,
                        NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                        BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """STATES_EVERY2: the state entering each odd chunk of a sequence (local index 1, 3, ..), from the stored state
    and Vn of the chunk before (which is full: only a sequence's last chunk can be partial), as the sequential
    forward updates it: S_c = e^gC S_c-1 + K_c-1^T (Vn_c-1 o e^(gC - g)). One V block per program; programs of even
    chunks load and store nothing."""
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(chunk_seq + i_c)
    r0 = tl.load(chunk_row + i_c).to(tl.int64)
    bos = tl.load(cu_rows + n).to(tl.int64)
    par = ((r0 - bos) // BT) % 2  # 1: an odd chunk of its sequence
    rp = r0 - BT  # first row of the chunk before
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    # (the parity enters the masks through tensor comparisons: the interpreter refuses a tensor & scalar-bool mask)
    m_kv = (mk & (o_k * 0 + par == 1))[:, None] & mv[None, :]
    m_t = o_t * 0 + par == 1
    kdt = k.dtype.element_ty
    off_kv = o_k[:, None] * V + o_v[None, :]
    b_S = tl.load(hs + ((i_c - 1).to(tl.int64) * H + i_h) * K * V + off_kv, mask=m_kv, other=0.0).to(tl.float32)
    b_g = tl.load(gc + (rp + o_t) * H + i_h, mask=m_t, other=0.0)
    g_last = tl.sum(tl.where(o_t == BT - 1, b_g, 0.0), 0)
    b_kt = tl.load(k + ((rp + o_t)[None, :] * H + i_h) * K + o_k[:, None], mask=mk[:, None] & m_t[None, :],
                   other=0.0)
    b_vn = tl.load(vn + ((rp + o_t)[:, None] * H + i_h) * V + o_v[None, :], mask=m_t[:, None] & mv[None, :],
                   other=0.0)
    b_vd = (b_vn.to(tl.float32) * tl.exp(g_last - b_g)[:, None]).to(kdt)
    b_S = b_S * tl.exp(g_last) + tl.dot(b_kt, b_vd, input_precision=PREC)
    tl.store(hs + (i_c.to(tl.int64) * H + i_h) * K * V + off_kv, b_S.to(hs.dtype.element_ty), mask=m_kv)


@autotune(configs=_configs([4], [1]), key=["H", "K", "V", "BT", "NH", "BV"])  # among 4/1, 8/1
@triton.jit
def _bwd_dvloc_kernel(q, k, gc, do, dvn, chunk_seq, chunk_row, cu_rows, scale,
                      NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, BQ: tl.constexpr, PREC: tl.constexpr):
    """The state-independent part of dVn: (Q K^T o Gam o M)^T dO, parallel over chunks."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    n = tl.load(chunk_seq + i_c)
    r0 = tl.load(chunk_row + i_c).to(tl.int64)
    eos = tl.load(cu_rows + n + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_q = tl.arange(0, BQ)
    o_k = tl.arange(0, BK)
    mk = o_k < K
    rows = r0 + o_t
    m_t = rows < eos
    re = tl.minimum(r0 + BT, eos)
    kdt = k.dtype.element_ty
    b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & mk[None, :], other=0.0)
    b_g = tl.load(gc + rows * H + i_h, mask=m_t, other=0.0)
    toks = r0 // NH + o_q
    rq = toks * NH + NH - 1
    m_q = rq < re
    b_q = tl.load(q + (toks[:, None] * H + i_h) * K + o_k[None, :], mask=m_q[:, None] & mk[None, :], other=0.0)
    b_gq = tl.load(gc + rq * H + i_h, mask=m_q, other=0.0)
    m_qk = ((rq - r0)[:, None] >= o_t[None, :]) & m_q[:, None] & m_t[None, :]
    b_A = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    b_A = tl.where(m_qk, b_A * (scale * tl.exp(tl.where(m_qk, b_gq[:, None] - b_g[None, :], 0.0))), 0.0)
    b_At = tl.trans(b_A.to(kdt))
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mv = o_v < V
        b_do = tl.load(do + (toks[:, None] * H + i_h) * V + o_v[None, :], mask=m_q[:, None] & mv[None, :],
                       other=0.0)
        b_dvl = tl.dot(b_At, b_do, input_precision=PREC)
        tl.store(dvn + (rows[:, None] * H + i_h) * V + o_v[None, :], b_dvl.to(dvn.dtype.element_ty),
                 mask=m_t[:, None] & mv[None, :])


# among 4/2, 8/2
@autotune(configs=_base_configs("dh"), key=["H", "K", "V", "BT", "NH", "BV", "FUSE_DVL", "LOAD_AQ"],
                 restore_value=["dvn"])
@triton.jit
def _bwd_dh_v2_kernel(q, k, w, gc, do, dht, dh0, dh, dvn, aq, cu_rows, chunk_off, scale,
                      NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, BQ: tl.constexpr, USE_DHT: tl.constexpr,
                      STORE_DH0: tl.constexpr, PREC: tl.constexpr, FUSE_DVL: tl.constexpr, LOAD_AQ: tl.constexpr):
    """Sequential over the chunks of one sequence in reverse: dVn and the state gradient entering each chunk.
    Q^T and W^T are loaded directly, the decays scale dO rows and the (K dS) rows instead of the Q and K tiles,
    int32 tile offsets. FUSE_DVL: the state-independent part of dVn, (Q K^T o Gam o M)^T dO, is computed here
    (off the loop-carried chain) instead of being read from _bwd_dvloc_kernel's output; LOAD_AQ: its
    Aqk^T factor is read from the forward's save instead of recomputed."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_rows + i_n)
    eos = tl.load(cu_rows + i_n + 1)
    c0 = tl.load(chunk_off + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mk = o_k < K
    mv = o_v < V
    o_t = tl.arange(0, BT)
    o_q = tl.arange(0, BQ)
    kdt = k.dtype.element_ty
    off_tk = o_t[:, None] * (H * K) + o_k[None, :]
    off_kt = o_k[:, None] + o_t[None, :] * (H * K)
    off_kq = o_k[:, None] + o_q[None, :] * (H * K)
    off_tv = o_t[:, None] * (H * V) + o_v[None, :]
    off_qv = o_q[:, None] * (H * V) + o_v[None, :]
    off_kv = o_k[:, None] * V + o_v[None, :]
    m_kv = mk[:, None] & mv[None, :]
    b_dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dS += tl.load(dht + (i_n * H + i_h).to(tl.int64) * K * V + off_kv, mask=m_kv, other=0.0).to(tl.float32)
    NT = tl.cdiv(eos - bos, BT)
    for cc in range(NT):
        c = NT - 1 - cc
        r0 = bos + c * BT
        re = tl.minimum(r0 + BT, eos)
        t0 = r0 // NH
        tl.store(dh + ((c0 + c) * H + i_h) * K * V + off_kv, b_dS.to(dh.dtype.element_ty), mask=m_kv)
        bk = (r0.to(tl.int64) * H + i_h) * K
        bv = (r0.to(tl.int64) * H + i_h) * V
        m_t = o_t < re - r0
        m_tv = m_t[:, None] & mv[None, :]
        b_k = tl.load(k + bk + off_tk, mask=m_t[:, None] & mk[None, :], other=0.0)
        b_wt = tl.load(w + bk + off_kt, mask=mk[:, None] & m_t[None, :], other=0.0)
        b_g = tl.load(gc + (r0 + o_t) * H + i_h, mask=m_t, other=0.0)
        g_last = tl.load(gc + (re - 1) * H + i_h)
        rq = (t0 + o_q) * NH + NH - 1
        m_q = rq < re
        bq = (t0.to(tl.int64) * H + i_h) * K
        bo = (t0.to(tl.int64) * H + i_h) * V
        b_qt = tl.load(q + bq + off_kq, mask=mk[:, None] & m_q[None, :], other=0.0)
        b_gq = tl.load(gc + rq * H + i_h, mask=m_q, other=0.0)
        b_do = tl.load(do + bo + off_qv, mask=m_q[:, None] & mv[None, :], other=0.0)
        p_dvn = dvn + bv + off_tv
        if LOAD_AQ:
            # Aqk^T saved by the forward ([BT, BQ] per chunk, scaled, zero off the causal mask)
            b_at = tl.load(aq + ((c0 + c) * H + i_h) * (BT * BQ) + o_t[:, None] * BQ + o_q[None, :])
            b_dvl = tl.dot(b_at, b_do, input_precision=PREC)
        elif FUSE_DVL:
            # (K Q^T o Gam^T o M^T) dO: row t of the chunk, token column j with last row rq_j >= t
            m_kq = ((rq - r0)[None, :] >= o_t[:, None]) & m_q[None, :] & m_t[:, None]
            b_at = tl.dot(b_k, b_qt, input_precision=PREC)
            b_at = tl.where(m_kq, b_at * (scale * tl.exp(tl.where(m_kq, b_gq[None, :] - b_g[:, None], 0.0))), 0.0)
            b_dvl = tl.dot(b_at.to(kdt), b_do, input_precision=PREC)
        else:
            b_dvl = tl.load(p_dvn, mask=m_tv, other=0.0)  # Aqk^T dO, from _bwd_dvloc_kernel
        b_dSk = b_dS.to(kdt)
        b_dvn = b_dvl.to(tl.float32) + tl.dot(b_k, b_dSk, input_precision=PREC) * tl.exp(g_last - b_g)[:, None]
        b_dvn = tl.where(m_t[:, None], b_dvn, 0.0)
        tl.store(p_dvn, b_dvn.to(dvn.dtype.element_ty), mask=m_tv)
        b_dog = (b_do.to(tl.float32) * (scale * tl.exp(b_gq))[:, None]).to(kdt)
        b_dS = b_dS * tl.exp(g_last) + tl.dot(b_qt, b_dog, input_precision=PREC) \
            - tl.dot(b_wt, b_dvn.to(kdt), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h).to(tl.int64) * K * V + off_kv, b_dS, mask=m_kv)


@triton.jit
def _qs_terms(b_q, b_k, b_dqi, b_dovn, b_dkd, b_dgc, b_g, b_gq, g_last, rq, m_q, m_t, o_t, nt, scale, dq, dq_rows, o_k,
              mk, PREC: tl.constexpr):
    """The intra-chunk output and state-passing terms of one chunk (or of one K slice of it) from the main backward's V
    loop (dO S^T, dO Vn^T, Vn dS'^T, rowsum(dS' o S)): stores dq (complete; at dq + dq_rows + o_k, as soon as it is
    formed, so that it does not hold registers through the rest) and returns dk's query and state terms and
    d(gate cumsum); rq: each token's last row, relative to the chunk's first row, nt: the chunk's rows."""
    kdt = b_k.dtype
    b_qs = b_q.to(tl.float32) * scale
    m_qk = (rq[:, None] >= o_t[None, :]) & m_q[:, None] & m_t[None, :]
    b_gamq = tl.exp(tl.where(m_qk, b_gq[:, None] - b_g[None, :], float("-inf")))
    b_qk = tl.dot(b_qs.to(kdt), tl.trans(b_k), input_precision=PREC)
    b_daq = tl.where(m_qk, b_dovn * b_gamq, 0.0)
    b_dq = b_dqi * tl.exp(b_gq)[:, None] + tl.dot(b_daq.to(kdt), b_k, input_precision=PREC)
    tl.store(dq + dq_rows[:, None] + o_k[None, :], (b_dq * scale).to(dq.dtype.element_ty), mask=m_q[:, None] & mk[None, :])
    b_dk = tl.dot(tl.trans(b_daq.to(kdt)), b_qs.to(kdt), input_precision=PREC)
    b_e2 = b_daq * b_qk
    b_dgq = tl.sum(b_e2, 1) + tl.exp(b_gq) * tl.sum(b_qs * b_dqi, 1)
    b_dg = -tl.sum(b_e2, 0)
    b_dg += tl.sum(tl.where((rq[:, None] == o_t[None, :]) & m_q[:, None], b_dgq[:, None], 0.0), 0)
    # state passing terms
    b_ed = tl.exp(g_last - b_g)
    b_dk += b_dkd * b_ed[:, None]
    b_f = tl.sum(b_dkd * b_k.to(tl.float32), 1) * b_ed
    b_dg -= b_f
    b_dglast = tl.sum(b_f, 0) + tl.exp(g_last) * tl.sum(b_dgc, 0)
    b_dg += tl.where(o_t == nt - 1, b_dglast, 0.0)
    return b_dk, b_dg


@triton.jit
def _wy_terms(b_k, b_dwk, b_Tk, b_b, b_g, b_dvnvb, m_t, o_t, b_dk, b_db, b_dg, PREC: tl.constexpr):
    """The WY (W = T Kb, U = T Vb) and T = (I + A)^-1 terms of one chunk's dk, dbeta and d(gate cumsum), added to
    b_dk, b_db, b_dg; b_dwk: dW in k's dtype, b_dvnvb: dVn V^T. dg's dA terms come before the two [BT, K] products
    with K, so that b_e and b_p are dead by then: the split's WY kernel at 4 warps has no spills in this order (392 B
    when the products came first; sm_90, triton 3.6)."""
    kdt = b_k.dtype
    b_eb = b_b * tl.exp(b_g)
    b_kb = b_k.to(tl.float32) * b_eb[:, None]
    b_dT = tl.dot(b_dwk, tl.trans(b_kb.to(kdt)), input_precision=PREC) + b_dvnvb * b_b[None, :]
    b_dkb = tl.dot(tl.trans(b_Tk), b_dwk, input_precision=PREC)
    b_dk += b_dkb * b_eb[:, None]
    b_t = tl.sum(b_dkb * b_k.to(tl.float32), 1)
    b_db += b_t * tl.exp(b_g)
    b_dg += b_t * b_eb
    # T = (I + A)^-1: dA = -T^T dT T^T on the strictly lower part
    b_dA = tl.dot(b_dT.to(kdt), tl.trans(b_Tk), input_precision=PREC)
    b_dA = -tl.dot(tl.trans(b_Tk), b_dA.to(kdt), input_precision=PREC)
    m_s = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_gam = tl.exp(tl.where(m_s, b_g[:, None] - b_g[None, :], float("-inf")))
    b_kk = tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    b_p = tl.where(m_s, b_kk * b_gam, 0.0)
    b_dA = tl.where(m_s, b_dA, 0.0)
    b_db += tl.sum(b_dA * b_p, 1)
    b_dpg = b_dA * b_b[:, None] * b_gam
    b_e = b_dA * b_p * b_b[:, None]
    b_dg += tl.sum(b_e, 1) - tl.sum(b_e, 0)
    b_dk += tl.dot(b_dpg.to(kdt), b_k, input_precision=PREC) + tl.dot(tl.trans(b_dpg.to(kdt)), b_k,
                                                                        input_precision=PREC)
    return b_dk, b_db, b_dg


# _BASE["main"]: among BV/warps/stages 64/8/1, 64/8/2, 32/8/2, 32/8/3, 32/8/4: stages >= 2 pipeline the V loop's
# loads (one program per SM at 8 warps: nothing else hides them; the V loop itself does not spill on sm_90, the 40-76
# spilled registers are after it). 4 stages: f+b nh=1/2/3 2.539/4.186/6.012 vs 2.571/4.222/6.072 ms at 3 (H100
# session 5 run 1; 123 / 109 KB of shared memory, still one program per SM)
@autotune(configs=_base_configs("main", {"BV": 16}), key=["H", "K", "V", "BT", "NH", "REBASE", "LATE", "RECOMP_VN"])
@triton.jit
def _bwd_main_kernel(q, k, v, beta, gc, Tm, hs, vn, w, do, dh, dvn, dq, dk, dv, db, dg,
                     chunk_seq, chunk_row, cu_rows, chunk_off, scale,
                     NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, BQ: tl.constexpr, USE_G: tl.constexpr,
                     PREC: tl.constexpr, REBASE: tl.constexpr, LATE: tl.constexpr, RECOMP_VN: tl.constexpr):
    """dq, dk, dv, dbeta, dg of one chunk: one loop over V blocks with five fp32 accumulators (dO S^T,
    dO Vn^T, Vn dS^T, dVn S^T, dVn V^T), then the intra-chunk, state and WY terms. LATE: the K and Q tiles
    (used only after the V loop) are loaded after it, so that they do not hold registers across it.
    RECOMP_VN: `vn` holds U, and Vn = U - W S is formed per V block from the W tile and the loaded state."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    n = tl.load(chunk_seq + i_c)
    r0 = tl.load(chunk_row + i_c).to(tl.int64)
    bos = tl.load(cu_rows + n).to(tl.int64)
    eos = tl.load(cu_rows + n + 1).to(tl.int64)
    c_glob = tl.load(chunk_off + n).to(tl.int64) + (r0 - bos) // BT
    ph = 0
    if REBASE:
        # every pointer moved once to this chunk (int64): the tile offsets below are small int32
        ph = (r0 % NH).to(tl.int32)  # sub-step of the chunk's first row
        t0 = r0 // NH
        k += (r0 * H + i_h) * K
        dk += (r0 * H + i_h) * K
        v += (r0 * H + i_h) * V
        vn += (r0 * H + i_h) * V
        w += (r0 * H + i_h) * K
        dvn += (r0 * H + i_h) * V
        dv += (r0 * H + i_h) * V
        beta += r0 * H + i_h
        db += r0 * H + i_h
        gc += r0 * H + i_h
        Tm += (r0 * H + i_h) * BT
        q += (t0 * H + i_h) * K
        dq += (t0 * H + i_h) * K
        do += (t0 * H + i_h) * V
        dg += t0 * H + i_h
        hs += (c_glob * H + i_h) * K * V
        dh += (c_glob * H + i_h) * K * V
        eos = (eos - r0).to(tl.int32)
        r0 = 0
        i_h = 0
        c_glob = 0
    o_t = tl.arange(0, BT)
    o_q = tl.arange(0, BQ)
    o_k = tl.arange(0, BK)
    mk = o_k < K
    rows = r0 + o_t
    m_t = rows < eos
    re = tl.minimum(r0 + BT, eos)
    kdt = k.dtype.element_ty
    mkv = m_t[:, None] & mk[None, :]
    if not LATE:
        b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mkv, other=0.0)
    b_b = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_g = tl.load(gc + rows * H + i_h, mask=m_t, other=0.0)
    g_last = tl.load(gc + (re - 1) * H + i_h)
    tri = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    b_T = tl.load(Tm + (rows[:, None] * H + i_h) * BT + o_t[None, :], mask=tri, other=0.0)
    b_Tk = b_T.to(kdt)
    toks = r0 // NH + o_q
    rq = toks * NH + NH - 1 - ph
    m_q = rq < re
    if not LATE:
        b_q = tl.load(q + (toks[:, None] * H + i_h) * K + o_k[None, :], mask=m_q[:, None] & mk[None, :],
                      other=0.0)
    b_gq = tl.load(gc + rq * H + i_h, mask=m_q, other=0.0)
    b_dqi = tl.zeros([BQ, BK], dtype=tl.float32)
    b_dovn = tl.zeros([BQ, BT], dtype=tl.float32)
    if RECOMP_VN:  # vn points at U here: Vn = U - W S per V block
        b_w = tl.load(w + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mkv, other=0.0)
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dvnvb = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dgc = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mv = o_v < V
        mtv = m_t[:, None] & mv[None, :]
        p_h = (c_glob * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        b_S = tl.load(hs + p_h, mask=mk[:, None] & mv[None, :], other=0.0)
        b_dS = tl.load(dh + p_h, mask=mk[:, None] & mv[None, :], other=0.0)
        b_vn = tl.load(vn + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=mtv, other=0.0)
        if RECOMP_VN:
            b_vn = (b_vn.to(tl.float32) - tl.dot(b_w, b_S.to(kdt), input_precision=PREC)).to(kdt)
        b_dvn = tl.load(dvn + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=mtv, other=0.0)
        b_v = tl.load(v + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=mtv, other=0.0)
        b_do = tl.load(do + (toks[:, None] * H + i_h) * V + o_v[None, :], mask=m_q[:, None] & mv[None, :],
                       other=0.0)
        b_dqi += tl.dot(b_do, tl.trans(b_S), input_precision=PREC)
        b_dovn += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        b_dkd += tl.dot(b_vn, tl.trans(b_dS), input_precision=PREC)
        b_dw -= tl.dot(b_dvn, tl.trans(b_S), input_precision=PREC)
        b_dgc += tl.sum(b_dS.to(tl.float32) * b_S.to(tl.float32), 1)
        b_dvnvb += tl.dot(b_dvn, tl.trans(b_v), input_precision=PREC)  # dVn Vb^T = (dVn V^T) diag(beta)
        b_dvb = tl.dot(tl.trans(b_Tk), b_dvn, input_precision=PREC)
        tl.store(dv + (rows[:, None] * H + i_h) * V + o_v[None, :],
                 (b_dvb * b_b[:, None]).to(dv.dtype.element_ty), mask=mtv)
        b_db += tl.sum(b_dvb * b_v.to(tl.float32), 1)
    if LATE:
        b_q = tl.load(q + (toks[:, None] * H + i_h) * K + o_k[None, :], mask=m_q[:, None] & mk[None, :],
                      other=0.0)
        b_k = tl.load(k + (rows[:, None] * H + i_h) * K + o_k[None, :], mask=mkv, other=0.0)
    b_dk, b_dg = _qs_terms(b_q, b_k, b_dqi, b_dovn, b_dkd, b_dgc, b_g, b_gq, g_last, rq - r0, m_q, m_t, o_t, re - r0,
                           scale, dq, (toks * H + i_h) * K, o_k, mk, PREC)
    b_dk, b_db, b_dg = _wy_terms(b_k, b_dw.to(kdt), b_Tk, b_b, b_g, b_dvnvb, m_t, o_t, b_dk, b_db, b_dg, PREC)
    tl.store(dk + (rows[:, None] * H + i_h) * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=mkv)
    tl.store(db + rows * H + i_h, b_db.to(db.dtype.element_ty), mask=m_t)
    if USE_G:
        b_dg = tl.where(m_t, b_dg, 0.0)
        b_dgl = tl.sum(b_dg, 0) - tl.cumsum(b_dg, 0) + b_dg  # reverse cumsum
        tl.store(dg + ((rows + ph) // NH) * H + i_h, b_dgl.to(dg.dtype.element_ty),
                 mask=m_t & ((rows + ph) % NH == 0))


# The main backward split in two (MAIN_SPLIT_MAX_NH), as flash-linear-attention splits its gated delta rule backward:
# _bwd_qk_kernel runs the V loop over the chunk states on one K slice per program (the fp32 accumulators halve at
# K = 128) and forms dq, the state and query parts of dk (stored in k's dtype), dW and each slice's share of dg;
# _bwd_wy_kernel then forms dv, dbeta and the WY / (I + A)^-1 terms of dk and dg from dVn, V, T, K and that dW.
@autotune(configs=_base_configs("qk", {"BV": 16}), key=["H", "K", "V", "BT", "NH", "BK"])
@triton.jit
def _bwd_qk_kernel(q, k, gc, hs, vn, do, dh, dvn, dq, dkp, dwp, dgp, chunk_seq, chunk_row, cu_rows, chunk_off, scale,
                   LH, NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, BQ: tl.constexpr, PREC: tl.constexpr):
    """One chunk, one BK-wide K slice (program_id 0, so that a chunk's slices run side by side and share its Vn, dVn
    and dO tiles through L2): V loop with dO S^T, dO Vn^T, Vn dS^T, dVn S^T, then dq (complete), dk's query and state
    terms (dkp), dW (dwp) and the slice's terms of d(gate cumsum) (dgp[i_k])."""
    i_k, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(chunk_seq + i_c)
    r0 = tl.load(chunk_row + i_c).to(tl.int64)
    bos = tl.load(cu_rows + n).to(tl.int64)
    eos = tl.load(cu_rows + n + 1).to(tl.int64)
    c_glob = tl.load(chunk_off + n).to(tl.int64) + (r0 - bos) // BT
    ph = (r0 % NH).to(tl.int32)
    t0 = r0 // NH
    k0 = i_k * BK
    k += (r0 * H + i_h) * K + k0
    dkp += (r0 * H + i_h) * K + k0
    dwp += (r0 * H + i_h) * K + k0
    vn += (r0 * H + i_h) * V
    dvn += (r0 * H + i_h) * V
    gc += r0 * H + i_h
    dgp += i_k.to(tl.int64) * LH + r0 * H + i_h
    q += (t0 * H + i_h) * K + k0
    dq += (t0 * H + i_h) * K + k0
    do += (t0 * H + i_h) * V
    hs += (c_glob * H + i_h) * K * V + k0 * V
    dh += (c_glob * H + i_h) * K * V + k0 * V
    nt = (tl.minimum(eos, r0 + BT) - r0).to(tl.int32)
    o_t = tl.arange(0, BT)
    o_q = tl.arange(0, BQ)
    o_k = tl.arange(0, BK)
    mk = o_k < K - k0
    m_t = o_t < nt
    b_g = tl.load(gc + o_t * H, mask=m_t, other=0.0)
    g_last = tl.load(gc + (nt - 1) * H)
    rq = o_q * NH + NH - 1 - ph
    m_q = rq < nt
    b_gq = tl.load(gc + rq * H, mask=m_q, other=0.0)
    b_dqi = tl.zeros([BQ, BK], dtype=tl.float32)
    b_dovn = tl.zeros([BQ, BT], dtype=tl.float32)
    b_dkd = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgc = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mv = o_v < V
        mtv = m_t[:, None] & mv[None, :]
        p_h = o_k[:, None] * V + o_v[None, :]
        b_S = tl.load(hs + p_h, mask=mk[:, None] & mv[None, :], other=0.0)
        b_dS = tl.load(dh + p_h, mask=mk[:, None] & mv[None, :], other=0.0)
        b_vn = tl.load(vn + o_t[:, None] * (H * V) + o_v[None, :], mask=mtv, other=0.0)
        b_dvn = tl.load(dvn + o_t[:, None] * (H * V) + o_v[None, :], mask=mtv, other=0.0)
        b_do = tl.load(do + o_q[:, None] * (H * V) + o_v[None, :], mask=m_q[:, None] & mv[None, :], other=0.0)
        b_dqi += tl.dot(b_do, tl.trans(b_S), input_precision=PREC)
        b_dovn += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        b_dkd += tl.dot(b_vn, tl.trans(b_dS), input_precision=PREC)
        b_dw -= tl.dot(b_dvn, tl.trans(b_S), input_precision=PREC)
        b_dgc += tl.sum(b_dS.to(tl.float32) * b_S.to(tl.float32), 1)
    mtk = m_t[:, None] & mk[None, :]
    tl.store(dwp + o_t[:, None] * (H * K) + o_k[None, :], b_dw.to(dwp.dtype.element_ty), mask=mtk)
    b_q = tl.load(q + o_q[:, None] * (H * K) + o_k[None, :], mask=m_q[:, None] & mk[None, :], other=0.0)
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=mtk, other=0.0)
    # every term is linear in the slice's columns (Q K^T, rowsum(Q o dQ), rowsum(dK o K), sum(dS o S) are sums over them)
    b_dk, b_dg = _qs_terms(b_q, b_k, b_dqi, b_dovn, b_dkd, b_dgc, b_g, b_gq, g_last, rq, m_q, m_t, o_t, nt, scale,
                           dq, o_q * (H * K), o_k, mk, PREC)
    tl.store(dkp + o_t[:, None] * (H * K) + o_k[None, :], b_dk.to(dkp.dtype.element_ty), mask=mtk)
    tl.store(dgp + o_t * H, b_dg, mask=m_t)


@autotune(configs=_base_configs("wy", {"BV": 16}), key=["H", "K", "V", "BT", "NH", "NK"])
@triton.jit
def _bwd_wy_kernel(k, v, beta, gc, Tm, dvn, dwp, dkp, dgp, dk, dv, db, dg, chunk_seq, chunk_row, cu_rows, LH,
                   NH: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr, USE_G: tl.constexpr, PREC: tl.constexpr):
    """One chunk: dv and beta's U-gradient (V loop over dVn, V), then the WY terms (W = T Kb, U = T Vb) and the
    (I + A)^-1 terms of dk, dbeta and dg from _bwd_qk_kernel's dW, added to its dk and dg shares."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    n = tl.load(chunk_seq + i_c)
    r0 = tl.load(chunk_row + i_c).to(tl.int64)
    eos = tl.load(cu_rows + n + 1).to(tl.int64)
    ph = (r0 % NH).to(tl.int32)
    k += (r0 * H + i_h) * K
    dk += (r0 * H + i_h) * K
    dkp += (r0 * H + i_h) * K
    dwp += (r0 * H + i_h) * K
    v += (r0 * H + i_h) * V
    dv += (r0 * H + i_h) * V
    dvn += (r0 * H + i_h) * V
    beta += r0 * H + i_h
    db += r0 * H + i_h
    gc += r0 * H + i_h
    dgp += r0 * H + i_h
    Tm += (r0 * H + i_h) * BT
    dg += (r0 // NH) * H + i_h
    nt = (tl.minimum(eos, r0 + BT) - r0).to(tl.int32)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    mk = o_k < K
    m_t = o_t < nt
    mkv = m_t[:, None] & mk[None, :]
    kdt = k.dtype.element_ty
    b_b = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_g = tl.load(gc + o_t * H, mask=m_t, other=0.0)
    tri = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    b_Tk = tl.load(Tm + o_t[:, None] * (H * BT) + o_t[None, :], mask=tri, other=0.0).to(kdt)
    b_dvnvb = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mtv = m_t[:, None] & (o_v < V)[None, :]
        b_dvn = tl.load(dvn + o_t[:, None] * (H * V) + o_v[None, :], mask=mtv, other=0.0)
        b_v = tl.load(v + o_t[:, None] * (H * V) + o_v[None, :], mask=mtv, other=0.0)
        b_dvnvb += tl.dot(b_dvn, tl.trans(b_v), input_precision=PREC)  # dVn Vb^T = (dVn V^T) diag(beta)
        b_dvb = tl.dot(tl.trans(b_Tk), b_dvn, input_precision=PREC)
        tl.store(dv + o_t[:, None] * (H * V) + o_v[None, :], (b_dvb * b_b[:, None]).to(dv.dtype.element_ty), mask=mtv)
        b_db += tl.sum(b_dvb * b_v.to(tl.float32), 1)
    b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=mkv, other=0.0)
    b_dw = tl.load(dwp + o_t[:, None] * (H * K) + o_k[None, :], mask=mkv, other=0.0).to(kdt)
    b_dg = tl.zeros([BT], dtype=tl.float32)
    for i_k in tl.static_range(NK):
        b_dg += tl.load(dgp + i_k * LH + o_t * H, mask=m_t, other=0.0)
    b_dk = tl.load(dkp + o_t[:, None] * (H * K) + o_k[None, :], mask=mkv, other=0.0).to(tl.float32)
    b_dk, b_db, b_dg = _wy_terms(b_k, b_dw, b_Tk, b_b, b_g, b_dvnvb, m_t, o_t, b_dk, b_db, b_dg, PREC)
    tl.store(dk + o_t[:, None] * (H * K) + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=mkv)
    tl.store(db + o_t * H, b_db.to(db.dtype.element_ty), mask=m_t)
    if USE_G:
        b_dg = tl.where(m_t, b_dg, 0.0)
        b_dgl = tl.sum(b_dg, 0) - tl.cumsum(b_dg, 0) + b_dg  # reverse cumsum
        tl.store(dg + ((o_t + ph) // NH) * H, b_dgl.to(dg.dtype.element_ty), mask=m_t & ((o_t + ph) % NH == 0))


# ----------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------
def _chunk_tables(cu_rows_list, BT, device):
    """Per chunk: its sequence and first row; per sequence: index of its first chunk."""
    seq, row, off = [], [], []
    for n, (a, b) in enumerate(zip(cu_rows_list[:-1], cu_rows_list[1:])):
        off.append(len(seq))
        for r in range(a, b, BT):
            seq.append(n)
            row.append(r)
    mk = lambda x: torch.tensor(x if x else [0], dtype=torch.int32, device=device)  # noqa: E731
    return mk(seq), mk(row), mk(off), len(seq)


_TABLES: dict = {}


def _tables(cu_tok, nh, BT, device):
    """Chunk tables for these token offsets, cached (fixed-length batches repeat the same key, so the
    host-to-device copies happen once, not on every call)."""
    key = (cu_tok, nh, BT, str(device))
    hit = _TABLES.get(key)
    if hit is None:
        cu_rows_list = [c * nh for c in cu_tok]
        cseq, crow, coff, NT = _chunk_tables(cu_rows_list, BT, device)
        hit = (cseq, crow, coff, NT, torch.tensor(cu_rows_list, dtype=torch.int32, device=device))
        if len(_TABLES) > 64:
            _TABLES.clear()
        _TABLES[key] = hit
    return hit


def _bq(BT: int, nh: int) -> int:
    """Token-tile rows: the tokens whose last sub-step lies in a chunk (~BT/nh), at least 32. 16-row
    tiles (nh = 4 at chunk 64, or nh = 1 at chunk 16) were never run on a GPU before, and the nh = 4
    S5 runs crashed on an H100 (triton 3.6, illegal memory access while autotuning the old backward)
    while nh = 1..3 with 32- and 64-row tiles pass, and no out-of-bounds access shows under
    lm_kernels.bounds_check: a shape/config-dependent Hopper code-generation fault like those flash-linear-
    attention works around (fla #984: num_warps=4 at 64-row chunks -> illegal address; #640: tl.trans of
    an MMA-layout result fed to another dot). The extra rows are masked."""
    return max(32, triton.next_power_of_2(triton.cdiv(BT, nh)))


def _pick(switch, save: bool):
    """A (forward with grad, no-grad forward) switch pair, or one value for both."""
    return switch[0 if save else 1] if isinstance(switch, tuple) else switch


def _bqp(BQ: int, save: bool) -> int:
    """Rows of the sequential forward's query tile: BQ padded to H_O_QPAD."""
    pad = _pick(H_O_QPAD, save)
    return max(BQ, pad) if pad else BQ


def _prec(dtype):
    # float32 inputs: 3xTF32 on the GPU (about float32 accuracy on the tensor cores)
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _blocks(K, V):
    BK = max(16, triton.next_power_of_2(K))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    return BK, BV


def _fwd(q, k, v, beta, g, h0, meta, save):
    """q (1,T,H,K), k,v,beta rows (1,L,..), g (1,T,H) or None. Returns o, final, saved tensors."""
    nh, BT, scale, output_final = meta["nh"], meta["BT"], meta["scale"], meta["output_final"]
    _, L, H, K = k.shape
    V = v.shape[-1]
    dev = k.device
    cseq, crow, coff, NT, cu_rows, N = meta["cseq"], meta["crow"], meta["coff"], meta["NT"], meta["cu_rows"], meta["N"]
    BK, BV = _blocks(K, V)
    BQ = _bq(BT, nh)
    prec = _prec(k.dtype)
    gc = torch.empty(1, L, H, dtype=torch.float32, device=dev)
    # T = (I + A)^-1 is only ever used as a tensor-core operand in k's dtype: store it in that dtype
    Tm = torch.empty(1, L, H, BT, dtype=k.dtype if TM_IN_K_DTYPE else torch.float32, device=dev)
    w = torch.empty_like(k)
    intra = nh >= INTRA_MIN_NH
    noqe = intra and OLOC_IN_H_O and OLOC_NO_QE
    qe = torch.empty_like(q) if intra and not noqe else gc
    o = torch.empty(*q.shape[:3], V, dtype=v.dtype, device=dev)
    scale_t = intra if PREP_SCALE_T is None else PREP_SCALE_T
    recomp = save and nh >= VN_RECOMPUTE_MIN_NH
    u_in = nh >= _pick(U_IN_H_O_MIN_NH, save) and not recomp and (not intra or OLOC_IN_H_O)
    # Aqk^T saved for the sequential backward (AQK_SAVE): written by the prep (_wu_tile, INTRA) or the sequential
    # forward
    aq = None
    if save and (not intra if AQK_SAVE is None else AQK_SAVE) and DH_FUSE_DVL:
        aq = torch.empty(NT, H, BT, BQ, dtype=k.dtype, device=dev)
    aqf = torch.empty(NT, H, BQ, BT, dtype=k.dtype, device=dev) if intra and OLOC_IN_H_O else None
    u = gc if u_in else torch.empty_like(v)
    fuse = u_in and KKT_FUSE_WU
    wu_args = (q, v, w, u, qe, o, aq if aq is not None else gc, aqf if aqf is not None else gc, scale)
    wu_kw = dict(V=V, BQ=BQ, INTRA=intra, SCALE_T=scale_t, SAVE_AQ=aq is not None and intra, AQF=aqf is not None,
                 NOQE=noqe)
    _launch(_kkt_inv_kernel, "kkt_inv", (NT, H),
            (k, beta, g if g is not None else gc, gc, Tm, cseq, crow, cu_rows, *wu_args),
            dict(NH=nh, H=H, K=K, BT=BT, BK=BK, USE_G=g is not None, PREC=prec, EARLY_A=KKT_EARLY_A,
                 MP="tf32" if (KKT_MERGE_TF32 and prec == "tf32") else "ieee", FUSE_WU=fuse,
                 **(dict(wu_kw, BV=BV) if fuse else {})),
            default=KKT_WU_CONFIG if fuse else KKT_INV_CONFIG)
    if not fuse:
        _launch(_wu_kernel, "wu", (NT, H),
                (q, k, v, beta, gc, Tm, w, u, qe, o, aq if aq is not None else gc, aqf if aqf is not None else gc,
                 cseq, crow, cu_rows, scale),
                dict(NH=nh, H=H, K=K, BT=BT, BK=BK, PREC=prec, U_OUT=not u_in, **wu_kw),
                default=WU_CONFIG_NO_U if u_in else WU_CONFIG)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final else None
    hs = torch.empty(NT, H, K, V, dtype=k.dtype, device=dev) if save else None
    vn = torch.empty_like(v) if save and not recomp else None
    meta["recomp_vn"] = recomp
    every2 = save and STATES_EVERY2 and not recomp
    meta["every2"] = every2
    args = (q, k, w, u, qe, gc, h0 if h0 is not None else gc, o, ht if ht is not None else gc,
            hs if hs is not None else gc, vn if vn is not None else gc, aq if aq is not None else gc,
            aqf if aqf is not None else gc, v, Tm, beta, cu_rows, coff, scale)
    kw = dict(NH=nh, H=H, K=K, V=V, BT=BT, BK=BK, BQ=BQ, USE_H0=h0 is not None, STORE_FINAL=output_final,
              SAVE=save, INTRA=intra, PREC=prec, SAVE_VN=not recomp, SAVE_AQ=aq is not None and not intra,
              AQF=aqf is not None, NOQE=noqe, EVERY2=every2, BQP=_bqp(BQ, save),
              Q_EARLY=_pick(H_O_Q_EARLY, save), STORE_LATE=_pick(H_O_STORE_LATE, save), U_IN=u_in)
    _launch(_fwd_h_o_v2_kernel, "h_o_save" if save and "h_o_save" in FIXED else "h_o", lambda m: (triton.cdiv(V, m["BV"]), N, H),
            args, kw, default=H_O_SAVE_CONFIG if save and "h_o" not in FIXED else None)
    # the backward reads Vn, or U when it recomputes Vn (RECOMP_VN), and Aqk^T when saved
    return o, ht, (gc, Tm, w, hs, u if recomp else vn, aq)


def _bwd(q, k, v, beta, g, h0, saved, do, dht, meta):
    gc, Tm, w, hs, vn, aq = saved
    recomp = meta.get("recomp_vn", False)
    nh, BT, scale = meta["nh"], meta["BT"], meta["scale"]
    _, L, H, K = k.shape
    V = v.shape[-1]
    dev = k.device
    cseq, crow, coff, NT, cu_rows, N = meta["cseq"], meta["crow"], meta["coff"], meta["NT"], meta["cu_rows"], meta["N"]
    BK, BV = _blocks(K, V)
    BQ = _bq(BT, nh)
    prec = _prec(k.dtype)
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None  # autograd may hand over expanded (stride-0) grads
    dh = torch.empty(NT, H, K, V, dtype=k.dtype, device=dev)
    dvn = torch.empty_like(v)
    dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if h0 is not None else None
    fuse = DH_FUSE_DVL
    if not fuse:
        _bwd_dvloc_kernel[(NT, H)](q, k, gc, do, dvn, cseq, crow, cu_rows, scale, NH=nh, H=H, K=K, V=V, BT=BT,
                                   BK=BK, BV=BV, BQ=BQ, PREC=prec)
    _launch(_bwd_dh_v2_kernel, "dh", lambda m: (triton.cdiv(V, m["BV"]), N, H),
            (q, k, w, gc, do, dht if dht is not None else gc, dh0 if dh0 is not None else gc, dh, dvn,
             aq if aq is not None else gc, cu_rows, coff, scale),
            dict(NH=nh, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, BQ=BQ, USE_DHT=dht is not None, STORE_DH0=h0 is not None,
                 PREC=prec, FUSE_DVL=fuse, LOAD_AQ=aq is not None), default=DH_CONFIG)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    # one writer per row: stored in beta's dtype, or in float32 and cast after the kernel (SPLIT_DB_FP32 for the split
    # backward, MAIN_DB_FP32_MAX_NH for the fused kernel)
    split = nh <= MAIN_SPLIT_MAX_NH and K >= 2 * MAIN_SPLIT_BK and not recomp
    db_fp32 = SPLIT_DB_FP32 if split else nh <= MAIN_DB_FP32_MAX_NH
    db = torch.empty(beta.shape, dtype=torch.float32 if db_fp32 else beta.dtype, device=dev)
    dg = torch.empty(g.shape, dtype=torch.float32, device=dev) if g is not None else None
    if meta.get("every2", False):  # the odd chunks' states, which the forward did not store
        _launch(_fill_states_kernel, "fill", (NT, H, triton.cdiv(V, BV)), (k, gc, vn, hs, cseq, crow, cu_rows),
                dict(NH=nh, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, PREC=prec))
    if split:
        BK1 = min(BK, MAIN_SPLIT_BK)
        NK = triton.cdiv(K, BK1)
        dkp, dwp = torch.empty_like(k), torch.empty_like(k)
        dgp = torch.empty(NK, L, H, dtype=torch.float32, device=dev)
        _launch(_bwd_qk_kernel, "qk", (NK, NT, H),
                (q, k, gc, hs, vn, do, dh, dvn, dq, dkp, dwp, dgp, cseq, crow, cu_rows, coff, scale, L * H),
                dict(NH=nh, H=H, K=K, V=V, BT=BT, BK=BK1, BQ=BQ, PREC=prec), default=QK_CONFIG_NH2 if nh >= 2 else None)
        _launch(_bwd_wy_kernel, "wy", (NT, H),
                (k, v, beta, gc, Tm, dvn, dwp, dkp, dgp, dk, dv, db, dg if dg is not None else gc, cseq, crow,
                 cu_rows, L * H),
                dict(NH=nh, H=H, K=K, V=V, BT=BT, BK=BK, NK=NK, USE_G=g is not None, PREC=prec),
                default=WY_CONFIG_WIDE_K if K > 128 else None)
    else:
        _launch(_bwd_main_kernel, "main", (NT, H),
                (q, k, v, beta, gc, Tm, hs, vn, w, do, dh, dvn, dq, dk, dv, db, dg if dg is not None else gc,
                 cseq, crow, cu_rows, coff, scale),
                dict(NH=nh, H=H, K=K, V=V, BT=BT, BK=BK, BQ=BQ, USE_G=g is not None, PREC=prec, REBASE=MAIN_REBASE,
                     LATE=MAIN_LATE_LOADS, RECOMP_VN=recomp),
                default=MAIN_CONFIG if MAIN_CONFIG is not None else (MAIN_CONFIG_NH1 if nh == 1 else None))
    return dq, dk, dv, db.to(beta.dtype), (dg.to(g.dtype) if g is not None else None), \
        (dh0.to(h0.dtype) if h0 is not None else None)


class _ChunkDeltaProductFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, g, h0, meta):
        o, ht, saved = _fwd(q, k, v, beta, g, h0, meta, save=True)
        ctx.save_for_backward(q, k, v, beta, g, h0, *saved)
        ctx.meta = meta
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, g, h0, *saved = ctx.saved_tensors
        dq, dk, dv, db, dg, dh0 = _bwd(q, k, v, beta, g, h0, saved, do, dht, ctx.meta)
        return dq, dk, dv, db, dg, dh0, None


def _fitting_chunk(chunk_size: int, dtype, K: int, on_gpu: bool) -> int:
    """The chunk length the GPU kernels run: float32 inputs with key heads over 64 at 64-row chunks need more shared
    memory than an H100 has in the main backward (360 KB at K = 128, nh = 1; 393-720 KB at K = 256; sm_90 compiles,
    H100 session 10), so they run 32-row chunks (the same chunkwise algebra, 65-131 KB), with a warning."""
    if on_gpu and dtype == torch.float32 and K > 64 and chunk_size > 32:
        warnings.warn(f"chunk_deltaproduct: float32 inputs with head_k_dim {K} run 32-row chunks instead of "
                      f"{chunk_size} on the GPU (the 64-row backward needs more shared memory than the GPU has); "
                      "bf16 / fp16 inputs (torch.autocast) keep 64", stacklevel=3)
        return 32
    return chunk_size


def chunk_deltaproduct_triton(q, k, v, beta, g=None, *, num_householder, scale=None, initial_state=None,
                              output_final_state=False, use_qk_l2norm=False, cu_seqlens=None, chunk_size=64):
    """Triton path of `chunk_deltaproduct` (same contract). Computes in float32 inside the kernels;
    float64 inputs are not supported here (use the reference)."""
    B, T, H, K, V, N = check_inputs(q, k, v, beta, g, num_householder, initial_state, cu_seqlens)
    if chunk_size not in SUPPORTED_CHUNKS:
        raise ValueError(f"the triton backend supports chunk_size in {SUPPORTED_CHUNKS}, got {chunk_size}")
    if K > 256:
        raise ValueError(f"the triton backend supports head_k_dim <= 256, got {K}")
    if q.dtype == torch.float64:
        raise ValueError("the triton backend does not take float64 inputs; use backend='reference'")
    dt = v.dtype
    if not (q.dtype == k.dtype == dt):
        raise ValueError(f"q, k and v must share one dtype for the triton backend, got {q.dtype}, {k.dtype}, {dt}")
    nh = num_householder
    if _INTERPRET and dt == torch.bfloat16:
        # the interpreter's bf16 tl.dot returns garbage (triton 3.6 - 3.9; float16 is right): compute in float32 there,
        # as the SSD kernels do; autograd casts the gradients back to bf16
        o, ht = chunk_deltaproduct_triton(
            q.float(), k.float(), v.float(), beta.float(), g, num_householder=nh, scale=scale,
            initial_state=initial_state, output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
            cu_seqlens=cu_seqlens, chunk_size=chunk_size)
        return o.to(dt), ht
    chunk_size = _fitting_chunk(chunk_size, q.dtype, K, q.is_cuda and not _INTERPRET)
    scale = K ** -0.5 if scale is None else float(scale)
    if use_qk_l2norm:  # one Triton kernel each way per tensor (l2norm.py), contiguous outputs
        q, k = l2norm_triton(q), l2norm_triton(k)
    # a batch of B sequences is B packed documents
    q, k, v = (x.reshape(1, -1, H, x.shape[-1]).contiguous() for x in (q, k, v))
    beta = beta.reshape(1, -1, H).contiguous()
    g = g.reshape(1, -1, H).contiguous() if g is not None else None
    if cu_seqlens is None:
        cu_tok = tuple(b * T for b in range(B + 1))
    else:
        cu_tok = tuple(int(x) for x in cu_seqlens.tolist())
    cseq, crow, coff, NT, cu_rows = _tables(cu_tok, nh, chunk_size, q.device)
    meta = dict(nh=nh, BT=chunk_size, scale=scale, output_final=output_final_state, cseq=cseq, crow=crow,
                coff=coff, NT=NT, N=N, cu_rows=cu_rows)
    h0 = initial_state.contiguous() if initial_state is not None else None
    if NT == 0:
        o = v.new_zeros(1, 0, H, V)
        ht = (h0.float() if h0 is not None else v.new_zeros(N, H, K, V, dtype=torch.float32)) \
            if output_final_state else None
        return o.reshape(B, T, H, V), ht
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, beta, g, h0))
    if needs_grad:
        o, ht = _ChunkDeltaProductFn.apply(q, k, v, beta, g, h0, meta)
    else:
        o, ht, _ = _fwd(q, k, v, beta, g, h0, meta, save=False)
    return o.reshape(B, T, H, V), ht
