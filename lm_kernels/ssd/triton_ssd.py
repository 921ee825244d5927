"""Triton SSD scan: launches (forward 3 kernels, backward 5-6) and the autograd.Function.

Forward:  dtcb_fwd (dt bias/softplus/clamp + in-chunk cumsum of dt*A, and C.B per chunk and group, in one
                    launch; LM_SSD_DTCB=0: the two kernels dt_fwd, cb_fwd)
          state_fwd (chunk states and the chunk-to-chunk pass fused: one program walks a sequence's
                     chunks and stores every chunk's start state; the final state stays float32)
          chunk_scan_fwd4 (y = inter-chunk + intra-chunk + D skip, then the z gate; grid (p block, head,
                     chunk), the chunk's four row blocks in one program; chunk_scan_fwd2 with one row block per
                     program for other chunk sizes). Other scan kernels / layouts: LM_SSD_SCAN, LM_SSD_STATE and
                     LM_SSD_NOGRAD (see _scan_variant, _state_variant, _nograd_variant; lm_kernels/ssd/PERF.md);
                     LM_SSD_CFG: fixed launch configs for the xs4 scan / state kernel (_fixed_cfgs).
Launches go through _launch: the autotuner on the first call per shape / dtypes, its chosen config directly after.
Backward: [gate_bwd] -> dstate_bwd (reverse pass of dLoss/dstate, fused with the per-chunk dstate)
          -> dcb_bwd (per group Q = sum_heads dy.x^T * decay * dt) -> dx_bwd (dx, and the intra-chunk d(dt*A)
          shares) -> dbdc_bwd -> dt_bwd (LM_SSD_BWD: see _bwd_variant).
When no gradient is needed (torch.is_grad_enabled() False or no input requires grad) the forward runs
outside autograd: nothing is saved and the pre-gate output is not stored.
The chunk size must be a power of two >= 16. Accumulation is float32; chunk start states are kept
in bfloat16 for bfloat16 inputs (they enter the tensor-core products in that dtype anyway), else in
float32; so is C.B (per chunk and group, read by every head). float32 inputs use tf32 products unless torch.get_float32_matmul_precision() == "highest".
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from ..autotune import autotune
from . import triton_kernels as K
from .common import check_scan_args

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


STATE_STEP_ROWS = 256  # the state kernels take a whole chunk per step up to this many rows
TILE_ROWS = 64  # row / k blocks of C.B and the backward kernels: min(TILE_ROWS, chunk) (tests use 16)


_AUTOTUNE = not (_INTERPRET or os.environ.get("LM_SSD_AUTOTUNE", "1") == "0")


def _switch(var, choices):
    """The value of the environment variable `var` ("" when unset), one of `choices` (read per call: the
    LM_SSD_* kernel-variant switches)."""
    v = os.environ.get(var, "").strip().lower()
    if v and v not in choices:
        raise ValueError(f"{var}={v!r} must be one of {tuple(choices)} (or unset)")
    return v


def _tune(configs, key, reset_to_zero=None):
    """Autotune over `configs` on GPU; a single fixed config under the interpreter or with
    LM_SSD_AUTOTUNE=0 (saves compile time, e.g. in tests). Kernels that accumulate with atomics name
    those outputs in `reset_to_zero` (autotuning runs a kernel many times)."""
    if not _AUTOTUNE:
        configs = configs[:1]
    return lambda fn: autotune(configs=configs, key=key, reset_to_zero=reset_to_zero)(fn)


def _cfgs(*pairs):
    return [triton.Config({}, num_warps=w, num_stages=s) for w, s in pairs]


_dt_fwd = K.dt_fwd_kernel
_dt_bwd = K.dt_bwd_kernel
_gate_bwd = K.gate_bwd_kernel
_cb_fwd = _tune(_cfgs((4, 2), (8, 2)), ["N"])(K.cb_fwd_kernel)
_dtcb_fwd = _tune(_cfgs((4, 2), (8, 2)), ["N", "H"])(K.dtcb_fwd_kernel)
_state_fwd = _tune([triton.Config(dict(BP=bp), num_warps=w, num_stages=2) for bp, w in ((64, 8), (64, 4), (32, 4), (32, 8))],
                   ["P", "N", "R", "BN", "NC"])(K.state_fwd_kernel)  # 32-row p blocks: more programs for long T


def _prune_bm(configs, named_args, **kwargs):
    """Drop row blocks larger than the chunk (keeps at least the first config)."""
    L = kwargs.get("L", named_args.get("L"))
    keep = [c for c in configs if c.kwargs.get("BM", 0) <= L]
    return keep or configs[:1]


_scan_fwd_cfgs = [triton.Config(dict(BM=bm, BK=bk), num_warps=w, num_stages=st)
                  for bm, bk, w, st in ((64, 64, 4, 2), (128, 64, 4, 2), (128, 64, 8, 2), (128, 32, 4, 3),
                                        (64, 32, 4, 3), (128, 128, 8, 2))]
_scan_fwd = (autotune(configs=_scan_fwd_cfgs[:1] if _INTERPRET else _scan_fwd_cfgs, key=["P", "N", "R", "L"],
                             prune_configs_by={"early_config_prune": _prune_bm})(K.chunk_scan_fwd_kernel)
             if _AUTOTUNE
             else autotune(configs=_scan_fwd_cfgs[:1], key=["P", "N", "R", "L"])(K.chunk_scan_fwd_kernel))


def _prune_fwd2(configs, named_args, **kwargs):
    """Row blocks inside the chunk, k-blocks dividing the row block (BK <= BM, both powers of two)."""
    L = kwargs.get("L", named_args.get("L"))
    keep = [c for c in configs if c.kwargs["BM"] <= L and c.kwargs["BK"] <= c.kwargs["BM"]]
    return keep or [c for c in configs if c.kwargs["BK"] <= c.kwargs["BM"]][-1:]


_scan_fwd2_cfgs = [triton.Config(dict(BM=bm, BK=bk, BP=bp), num_warps=w, num_stages=st)
                   for bm, bk, bp, w, st in ((64, 64, 64, 4, 2), (64, 32, 64, 4, 2), (64, 32, 64, 4, 3),
                                             (128, 64, 64, 8, 2), (128, 32, 64, 8, 3), (64, 32, 32, 4, 2),
                                             (64, 64, 64, 8, 2), (32, 32, 64, 4, 2), (128, 128, 64, 8, 2),
                                             (64, 64, 64, 4, 3), (128, 64, 64, 8, 3),
                                             (32, 16, 16, 4, 2))]  # the last: interpreter tests (small chunks)
_scan_fwd2 = autotune(
    configs=(_scan_fwd2_cfgs if _AUTOTUNE else _scan_fwd2_cfgs[-1:] if _INTERPRET else _scan_fwd2_cfgs[:1]),
    key=["P", "N", "R", "L", "FACT", "XS"], prune_configs_by={"early_config_prune": _prune_fwd2})(K.chunk_scan_fwd2_kernel)


# H100 B8 T2048 H64 P64 N128 chunk 256 (session 5, triton 3.6; kernel ms / registers, no spills): BP 64 / 4 warps
# 0.288 / 253, BP 32 / 4 warps 0.439 / 188, BP 64 / 8 warps 0.451 / 205, BP 32 / 8 warps 0.749 / 169. No loops:
# num_stages does not matter. Session 6: BP 64 / 4 warps capped at 168 registers (ptx .maxnreg; 3 programs per SM
# instead of 2, 112 B of spills) 0.254 / 0.253 ms against 0.285 / 0.285 at B8 T2048 / B2 T8192 (capped at 200: 2 per
# SM, 0.291 / 0.289); first, so it is the config with LM_SSD_AUTOTUNE=0. With the gate z (HAS_Z, in the key) the cap
# spills twice as much and was not timed: the autotuner picks between the capped and the uncapped config there.
_scan_fwd4_cfgs = [triton.Config(dict(BP=64), num_warps=4, num_stages=1, maxnreg=168)] + [
    triton.Config(dict(BP=bp), num_warps=w, num_stages=1)
    for bp, w in ((64, 4), (32, 4), (64, 8),
                  (16, 4))]  # the last: interpreter tests (small chunks)
_scan_fwd4 = autotune(
    configs=(_scan_fwd4_cfgs[:-1] if _AUTOTUNE else _scan_fwd4_cfgs[-1:] if _INTERPRET else _scan_fwd4_cfgs[:1]),
    key=["P", "N", "R", "L", "HAS_Z"])(K.chunk_scan_fwd4_kernel)


def _prune_fused(configs, named_args, **kwargs):
    L = kwargs.get("L", named_args.get("L"))
    keep = [c for c in configs if c.kwargs["BM"] <= L]
    return keep or configs[-1:]


_fused_cfgs = [triton.Config(dict(BP=bp, BM=bm), num_warps=w, num_stages=st)
               for bp, bm, w, st in ((32, 64, 8, 2), (16, 64, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2),
                                     (16, 32, 4, 2), (64, 32, 4, 2), (32, 128, 8, 2),
                                     (16, 16, 4, 2))]  # the last: interpreter tests (small chunks)
_fused_fwd = autotune(
    configs=(_fused_cfgs if _AUTOTUNE else _fused_cfgs[-1:] if _INTERPRET else _fused_cfgs[:1]),
    key=["P", "N", "R", "L", "NC", "FACT"], prune_configs_by={"early_config_prune": _prune_fused})(
        K.ssd_fused_fwd_kernel)
# Session 6 additions to the backward's autotune lists (the first entry stays the LM_SSD_AUTOTUNE=0 config), from
# compiles for sm_90 with triton 3.6 (`sm90_stats --backward`): dstate_bwd and dbdc_bwd run one 8-warp program per
# SM (175 / 215 registers), capped at 128 two (28 / 52 B of spills); dcb_bwd at 1 stage 168 registers (3 per SM
# instead of 2); dx_bwd at 1 stage without its 16 B of spills. H100 run 19 (autotuner's own timings, B8 T2048):
# dx_bwd 4 warps 1 stage 1.011 ms vs 2 stages 1.078 (8 warps 1.610): now first; dbdc_bwd capped 0.218 vs 0.220 (4
# warps) / 0.305 (8); dcb_bwd 8 warps 0.224 vs 4 warps 0.257 / 1 stage 0.441; dstate_bwd 4 warps 0.194 vs 8 warps
# 0.268 / capped 0.208.
# Session 7 (H100, autotuner's own timings at B8 T2048, ms; lm_kernels/ssd/PERF.md): dx_bwd without its C S^T product
# (dcs in dbdc_bwd) capped at 168 registers (16 B of spills, 3 programs per SM) 0.73 - 0.86 vs 0.95 uncapped, 1.03 at
# 2 stages, 1.68 at 8 warps (both removed); dbdc_bwd with dcs at 8 warps 4 stages (190 KB of shared memory: loads
# of 4 heads in flight) 0.233 vs 0.323 at 2 stages; without dcs 8 warps capped 0.219, 3 stages 0.229, 4 warps 0.221,
# 4 warps capped 0.353 (removed); dcb_bwd 3 / 4 stages 0.238 / 0.360 vs 0.224 and dstate_bwd 8 warps 3 stages 0.295
# vs 0.194: not kept. (8, 4) is not first: float32 / float16 tiles need more shared memory than the H100 has at 4
# stages (the autotuner skips such configs; LM_SSD_AUTOTUNE=0 launches the first).
_dstate_bwd = _tune(_cfgs((8, 2), (4, 2)), ["P", "N", "R"])(K.dstate_bwd_kernel)  # (the capped one lost: removed)
_dcb_bwd = _tune(_cfgs((4, 2), (8, 2)), ["P", "R", "QONLY"])(K.dcb_bwd_kernel)  # (1 stage lost: removed)
_dbdc_bwd = _tune(_cfgs((8, 2), (8, 4), (4, 2), (8, 3)) + [triton.Config({}, num_warps=8, num_stages=2, maxnreg=128)],
                  ["P", "N", "R", "DCS", "BN"])(K.dbdc_bwd_kernel)
_dx_bwd = _tune([triton.Config({}, num_warps=4, num_stages=1, maxnreg=168)] + _cfgs((4, 1)),
                ["P", "N", "R", "DDA", "FACT", "DCS"])(K.dx_bwd_kernel)


_BEST = {}  # launch key -> the autotuner's chosen config as launch kwargs (see _launch)


def _launch(tuner, key, grid, args, kw, fixed=None):
    """tuner[grid](*args, **kw) for a triton Autotuner `tuner`. Autotuner.run rebuilds its key from all ~45
    arguments on every call (30 - 40 us of host time per launch on the 2-core CPU, ~1/3 of a forward's host
    time); so the first call per `key` goes through it and the config it chose is kept, and later calls launch
    the jitted kernel with that config directly. `key` must fix the autotuner's own key (shapes in it, tensor
    dtypes): it only selects a config, so a coarser key could cost speed, never correctness. `fixed`: launch
    kwargs (meta-parameters, num_warps, num_stages, maxnreg) used instead of the autotuner's (compiled runs
    only; the opt-in LM_SSD_CFG variants). Anything else than an Autotuner (a test's wrapper) is called
    plainly."""
    if not isinstance(tuner, Autotuner) or tuner.reset_to_zero or tuner.restore_value:
        tuner[grid](*args, **kw)
        return
    if fixed is not None and not _INTERPRET:
        meta = fixed
    else:
        key = (id(tuner), id(tuner.configs), key)  # a test may swap the configs list
        meta = _BEST.get(key)
        if meta is None:
            tuner[grid](*args, **kw)
            if len(_BEST) > 4096:
                _BEST.clear()
            _BEST[key] = tuner.best_config.all_kwargs()
            return
    tuner.fn[grid(meta) if callable(grid) else grid](*args, **kw, **meta)


_CFG_KERNELS = ("scan4", "state", "dx")


def _fixed_cfgs():
    """{kernel: launch kwargs} of LM_SSD_CFG = "KERNEL:BP:warps:stages[:maxnreg]+..." with KERNEL scan4
    (chunk_scan_fwd4), state (state_fwd) or dx (dx_bwd, BP written as 0), e.g. "scan4:64:4:1:168+state:32:4:2:128": opt-in launch configs
    instead of the autotuned ones (compiled runs only), e.g. a register cap (ptx .maxnreg) so that more programs
    fit on an SM; {} when unset. One variable for both, read per call like the other LM_SSD_* switches."""
    v = os.environ.get("LM_SSD_CFG", "")
    hit = _FIXED.get(v)
    if hit is not None:
        return hit
    hit = {}
    for item in v.replace(" ", "").split("+"):
        if not item:
            continue
        name, *parts = item.split(":")
        if name not in _CFG_KERNELS or len(parts) not in (3, 4) or not all(q.isdigit() for q in parts):
            raise ValueError(f"LM_SSD_CFG={v!r}: {item!r} is not KERNEL:BP:num_warps:num_stages[:maxnreg] with KERNEL "
                             f"one of {_CFG_KERNELS} (integers; several joined by '+'); unset it for the autotuned "
                             "configs")
        hit[name] = dict(BP=int(parts[0]), num_warps=int(parts[1]), num_stages=int(parts[2]))
        if name == "dx":  # dx_bwd has no BP meta-parameter (write 0)
            del hit[name]["BP"]
        if len(parts) == 4:
            hit[name]["maxnreg"] = int(parts[3])
    _FIXED[v] = hit
    return hit


_FIXED = {}


def _cdiv(a, b):
    """ceil(a / b) for ints (triton.cdiv is a jitted function: ~6 us of host time per call from Python)."""
    return -(-a // b)


def _p2(v, lo=16):
    return max(lo, triton.next_power_of_2(int(v)))


def _dot_dt(dtype):
    """Operand dtype of tl.dot: the input dtype; float32 under the interpreter (its bf16 dot is wrong)."""
    if _INTERPRET:
        return tl.float32
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _dot_prec(dtype):
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


_DUMMIES = {}


def _dummy_i32(dev):
    """A one-element int32 tensor per device for the unused chunk-table arguments (made once: a fresh
    torch.zeros per call cost a fill kernel and host time)."""
    t = _DUMMIES.get(dev)
    if t is None:
        t = _DUMMIES[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
    return t


_PLANS = {}


def _plan(x, B, cu_seqlens, chunk_size):
    """_Plan of a call, cached per (shapes, chunk, device) for fixed-length batches (no host work repeated by
    the many same-shape calls of the fixed-point iterations); packed documents build their chunk table."""
    if cu_seqlens is not None:
        return _Plan(x, B, cu_seqlens, chunk_size)
    key = (x.shape, B.shape, chunk_size, x.device)
    pl = _PLANS.get(key)
    if pl is None:
        if len(_PLANS) > 256:
            _PLANS.clear()
        pl = _PLANS[key] = _Plan(x, B, None, chunk_size)
    return pl


class _Plan:
    """Shapes, block sizes and the chunk table of one call (shared by forward and backward)."""

    def __init__(self, x, B, cu_seqlens, chunk_size):
        b, t, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        L = chunk_size
        self.b, self.T, self.H, self.P, self.G, self.N, self.L = b, t, h, p, g, n, L
        self.R = h // g
        self.BT = b * t
        self.varlen = cu_seqlens is not None
        dev = x.device
        if self.varlen:
            cu = cu_seqlens.to(device=dev, dtype=torch.int64)
            self.nseq = cu.numel() - 1
            lens = cu[1:] - cu[:-1]
            nch = (lens + L - 1) // L
            first = torch.cat([cu.new_zeros(1), torch.cumsum(nch, 0)])
            self.NCB = t // L + self.nseq  # upper bound on the number of chunks (no host sync)
            j = torch.arange(self.NCB, device=dev)
            s = torch.searchsorted(first[1:], j, right=True).clamp_max(self.nseq - 1)
            t0 = cu[s] + (j - first[s]) * L
            clen = torch.where(j < first[-1], torch.minimum(cu[s + 1] - t0, torch.full_like(t0, L)), 0)
            self.cu = cu.to(torch.int32)
            self.chunk_first = first.to(torch.int32)
            self.chunk_t0 = t0.to(torch.int32)
            self.chunk_len = clen.to(torch.int32)
            self.NC = 0
        else:
            self.nseq = b
            self.NC = max(1, -(-t // L))
            self.NCB = b * self.NC
            dummy = _dummy_i32(dev)
            self.cu = self.chunk_first = self.chunk_t0 = self.chunk_len = dummy
        self.BPF = _p2(p)
        self.BNF = _p2(n)
        self.BM = min(TILE_ROWS, L)
        self.BK = self.BM  # dcb_bwd needs square tiles (its diagonal tiles are the tiles with k0 == m0)
        self.BP = min(64, self.BPF)
        self.BN = min(64, self.BNF)
        self.BH = 16 if L <= 128 else 8
        self.BKS = min(L, STATE_STEP_ROWS)  # rows per step of the sequential state kernels
        self.npn = _cdiv(p, self.BP) * _cdiv(n, self.BN)


_SCAN_VARIANTS = ("flat", "grid", "flat2", "xs", "xs4")


def _scan_variant(plan, dtype=torch.bfloat16):
    """The forward scan kernel. "flat": one head per program, grid (chunk, head, row block); "grid": the
    same math on the grid (row block, head, chunk) (chunk_scan_fwd2_kernel); "flat2": "grid" plus the
    exponential-free factorised decay below the diagonal, on the C.B operand; "xs": "grid" with the decay
    below the diagonal on the x rows, so the raw C.B tile is the product's A operand; "xs4": "xs" with one
    program per (p block, head, chunk) for chunks of four row blocks (chunk == 4 * the tile rows, i.e. 256
    on a GPU), each decayed x tile built once (chunk_scan_fwd4_kernel; other chunk sizes run "xs").
    Default: "xs4" for 16-bit inputs, "xs" for float32 (xs4 with float32 operands compiles for sm_90 with
    spills and twice the shared memory, and was not timed). LM_SSD_SCAN overrides the default. Removed after
    losing in two H100 runs each (lm_kernels/ssd/PERF.md): "hb", "fact", "chunk" scans."""
    v = _switch("LM_SSD_SCAN", _SCAN_VARIANTS)
    # H100, B8 T2048 / B2 T8192 H64 P64 N128: scan kernel flat 0.436 ms, grid 0.326, flat2 0.321 - 0.325,
    # xs 0.303 (session 4); B8 T2048: xs 0.304, xs4 0.285 (session 5, bf16)
    return v or ("xs" if dtype == torch.float32 else "xs4")


_STATE_VARIANTS = ("old", "pnfast", "bn128")


def _state_variant():
    """state_fwd layout: "old" grid (sequence, head, p x n block) with 64-wide n blocks; "pnfast" grid
    (p x n block, head, sequence); "bn128": "pnfast" with n blocks up to 128 wide (x read once per head).
    LM_SSD_STATE overrides the default. Removed after losing in two H100 runs each: "hb2" (head pairs),
    "bn32" (32-wide n blocks)."""
    v = _switch("LM_SSD_STATE", _STATE_VARIANTS)
    # H100, B8 T2048: old 0.156 ms, pnfast 0.129 - 0.130, bn128 0.130; B2 T8192: 0.125 - 0.129
    return v or "pnfast"


def _nograd_variant(plan):
    """No-grad forward: "split" (state kernel, then the scan kernel) or "fused" (one pass per head walking
    the chunks with the state in registers; nothing stored but y; slower on an H100: 0.73 - 0.75 ms against
    0.47 ms for split at B8 T2048 / B2 T8192, too few programs for the chip). LM_SSD_NOGRAD overrides."""
    return _switch("LM_SSD_NOGRAD", ("split", "fused")) or "split"


_BWD_VARIANTS = ("slots", "fused")


def _bwd_variant():
    """Where the intra-chunk d(dt*A) shares are computed (both store them in per-row-block slots and
    per-tile totals that dt_bwd sums; no atomics): "slots" in dcb_bwd (per group, per head, next to Q);
    "fused" in dx_bwd, from the C.B and decay tiles it builds anyway (one more product per tile), with
    dcb_bwd summing Q alone. LM_SSD_BWD overrides the default. H100 B8 T2048 (session 4): dcb_bwd + dx_bwd
    0.722 + 0.716 ms (slots), 0.213 + 1.090 (fused); with atomics they were 1.075 + 0.803."""
    return _switch("LM_SSD_BWD", _BWD_VARIANTS) or "fused"


def _dx_fact():
    """dx_bwd's tiles below the diagonal: the decay factorised through the row before each k block (1, on the dy
    rows and the C.B columns) or through the l block's last row (2, on the dy rows and, once for all k blocks,
    the rows of dx), or e^{cs_m - cs_l} per element (0). No exponential per tile element with 1 or 2.
    LM_SSD_DXFACT overrides the default (1)."""
    return int(_switch("LM_SSD_DXFACT", ("0", "1", "2")) or 1)


def _dcs_in_dbdc():
    """Where each row's dcs = dy . y_off (the state part of y) is formed: "dbdc" in dbdc_bwd from the product
    e^{cs} dy S it forms for dC anyway (a partial sum per n block), "dx" in dx_bwd by its own C S^T product.
    LM_SSD_DCS overrides the default."""
    return (_switch("LM_SSD_DCS", ("dbdc", "dx")) or "dbdc") == "dbdc"


def _dbdc_bn(pl):
    """dbdc_bwd's n block: all of N up to 128 (one n block: x / dy rows read once per head), or 64 with
    LM_SSD_DBDC_BN=64 (twice the programs, each head's products and dcs partial sums within a warp)."""
    return min(pl.BNF, int(_switch("LM_SSD_DBDC_BN", ("64", "128")) or 128))


def _dtcb_fused():
    """dt/cs and C.B in one launch (dtcb_fwd_kernel) unless LM_SSD_DTCB=0 (two launches: dt_fwd, cb_fwd)."""
    return _switch("LM_SSD_DTCB", ("0", "1")) != "0"


def _limits(dt_limit):
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    has = lo > 0.0 or hi < math.inf
    return has, lo, (hi if hi < math.inf else 3.0e38)


def _tune_key(pl, x, dt, A, B, D, z, dt_bias, initial_state):
    """What fixes every autotuner's key of a call (its shape arguments and the dtypes of its tensors), for
    _launch (a superset: the launch flags are not in the autotuners' keys)."""
    return (pl.P, pl.N, pl.R, pl.L, pl.NC, pl.H, pl.G, pl.BN, pl.BM, x.dtype, dt.dtype, A.dtype, B.dtype,
            None if D is None else D.dtype, None if z is None else z.dtype, None if dt_bias is None else dt_bias.dtype,
            None if initial_state is None else initial_state.dtype)


def _forward(x, dt, A, B, C, D, z, dt_bias, initial_state, plan, dt_softplus, dt_limit, want_final, save):
    pl = plan
    dev = x.device
    H, P, N, L = pl.H, pl.P, pl.N, pl.L
    has_limit, lo, hi = _limits(dt_limit)
    dtp, cs = torch.empty(2, H, pl.BT, dtype=torch.float32, device=dev).unbind(0)
    final = torch.empty(pl.nseq, H, P, N, dtype=torch.float32, device=dev) if want_final else None
    prec = _dot_prec(x.dtype)
    cb_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    CB = torch.empty(pl.NCB, pl.G, L, L, dtype=cb_dtype, device=dev)
    tk = _tune_key(pl, x, dt, A, B, D, z, dt_bias, initial_state)
    if _dtcb_fused():  # one launch for dt/cs and C.B
        _launch(_dtcb_fwd, ("dtcb", tk), (pl.NCB, pl.G * (L // pl.BM) * (L // pl.BK) + _cdiv(H, pl.BH)), (
            dt, dt_bias if dt_bias is not None else dt, A, dtp, cs, B, C, CB, pl.chunk_t0, pl.chunk_len,
            pl.T, H, N, pl.NC, pl.BT, pl.G, dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), B.stride(2), lo, hi),
            dict(L=L, BH=pl.BH, BM=pl.BM, BK=pl.BK, BNF=pl.BNF, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
                 HAS_LIMIT=has_limit, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=_dot_dt(x.dtype)))
    else:
        _dt_fwd[(pl.NCB, _cdiv(H, pl.BH))](
            dt, dt_bias if dt_bias is not None else dt, A, dtp, cs, pl.chunk_t0, pl.chunk_len,
            pl.T, H, pl.NC, pl.BT, dt.stride(0), dt.stride(1), lo, hi,
            L=L, BH=pl.BH, HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit,
            IS_VARLEN=pl.varlen, num_warps=4)
        _launch(_cb_fwd, ("cb", tk), (pl.NCB, pl.G, (L // pl.BM) * (L // pl.BK)), (
            B, C, CB, pl.chunk_t0, pl.chunk_len, pl.T, N, pl.NC, pl.G, B.stride(0), B.stride(1), B.stride(2)),
            dict(L=L, BM=pl.BM, BK=pl.BK, BNF=pl.BNF, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=_dot_dt(x.dtype)))
    y = torch.empty(pl.b, pl.T, H, P, dtype=x.dtype, device=dev)
    zz = z if z is not None else x
    common = (pl.T, H, P, N, pl.NC, pl.BT, pl.R, pl.G,
              x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2),
              zz.stride(0), zz.stride(1), zz.stride(2))
    flags = dict(HAS_D=D is not None, D_HP=D is not None and D.dim() == 2, HAS_Z=z is not None,
                 IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=_dot_dt(x.dtype))
    if not save and _nograd_variant(pl) == "fused":
        _launch(_fused_fwd, ("fused", tk), lambda META: (_cdiv(P, META["BP"]), H, pl.nseq), (
            x, B, C, CB, dtp, cs, initial_state if initial_state is not None else dtp,
            final if final is not None else dtp, D if D is not None else dtp, zz, y, pl.cu, pl.chunk_first, *common),
            dict(L=L, BNF=pl.BNF, HAS_INIT=initial_state is not None, HAS_FINAL=want_final,
                 FACT=True, S_BF16=x.dtype == torch.bfloat16, **flags))
        return y, final, None
    state_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    states = torch.empty(pl.NCB, H, P, N, dtype=state_dtype, device=dev)  # (p, n) per (chunk, head)
    variant = _scan_variant(pl, x.dtype)
    st_strides = (N, 1)  # (s_sp, s_sn): the "PN" layout (the kernels also take "NP": (1, P))
    sv = _state_variant()
    fixed = _fixed_cfgs()
    bn = min(128, pl.BNF) if sv == "bn128" else pl.BN

    def grid(META):
        npn = _cdiv(P, META["BP"]) * _cdiv(N, bn)
        return (npn, H, pl.nseq) if sv != "old" else (pl.nseq, H, npn)
    _launch(_state_fwd, ("state", sv, bn, tk), grid, (
        x, B, dtp, cs, initial_state if initial_state is not None else dtp, states,
        final if final is not None else dtp, pl.cu, pl.chunk_first,
        pl.T, H, P, N, pl.NC, pl.BT, pl.R,
        x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2), *st_strides),
        dict(L=L, BN=bn, BK=pl.BKS, HAS_INIT=initial_state is not None, HAS_FINAL=want_final,
             IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=_dot_dt(x.dtype), PN_FAST=sv != "old"),
        fixed=fixed.get("state"))
    store_pre = save and z is not None
    ypre = torch.empty_like(y) if store_pre else None
    scan_args = (x, CB, C, dtp, cs, states, D if D is not None else dtp, zz, y, ypre if ypre is not None else y,
                 pl.chunk_t0, pl.chunk_len, *common)
    if variant == "xs4" and L != 4 * pl.BM:
        variant = "xs"  # chunk_scan_fwd4 is written for exactly four row blocks
    if variant == "xs4":
        _launch(_scan_fwd4, ("scan4", tk), lambda META: (_cdiv(P, META["BP"]), H, pl.NCB),
                (*scan_args, *st_strides), dict(L=L, BM=pl.BM, BNF=pl.BNF, STORE_PRE=store_pre, **flags),
                fixed=fixed.get("scan4"))
    elif variant in ("grid", "flat2", "xs"):
        _launch(_scan_fwd2, ("scan2", variant, tk),
                lambda META: (_cdiv(L, META["BM"]) * _cdiv(P, META["BP"]), H, pl.NCB),
                (*scan_args, *st_strides), dict(L=L, BNF=pl.BNF, STORE_PRE=store_pre, FACT=variant == "flat2",
                                                XS=variant == "xs", **flags))
    else:
        _launch(_scan_fwd, ("scan", tk), lambda META: (pl.NCB, H, _cdiv(L, META["BM"]) * _cdiv(P, pl.BP)),
                scan_args, dict(L=L, BP=pl.BP, BNF=pl.BNF, STORE_PRE=store_pre, **flags))
    return y, final, (dtp, cs, states, st_strides, CB, ypre if store_pre else y)


def _backward(dout, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_state, plan, dt_softplus, dt_limit, aux):
    pl = plan
    dev = x.device
    H, P, N, L, G, R = pl.H, pl.P, pl.N, pl.L, pl.G, pl.R
    dtp, cs, states, st_strides, CB, ypre = aux
    prec = _dot_prec(x.dtype)
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dz = None
    if z is not None:
        zc = z.contiguous()
        doc = dout.contiguous()
        dy = torch.empty_like(ypre)
        dz = torch.empty_like(zc)
        numel = dy.numel()
        _gate_bwd[(_cdiv(numel, 1024),)](doc, zc, ypre, dy, dz, numel, BLOCK=1024, num_warps=4)
    else:
        dy = dout
    # reverse state pass
    dstates = torch.empty_like(states)
    passing = torch.zeros(pl.NCB, H, pl.npn, dtype=torch.float32, device=dev)
    dinit = torch.empty(pl.nseq, H, P, N, dtype=torch.float32, device=dev) if initial_state is not None else None
    if dfinal is not None:
        dfinal = dfinal.float().contiguous()
    tk = _tune_key(pl, x, dt, A, B, D, z, dt_bias, initial_state) + (dy.dtype,)
    _launch(_dstate_bwd, ("dstate", tk), (pl.nseq, H, pl.npn), (
        dy, C, cs, states, dfinal if dfinal is not None else cs, dstates, dinit if dinit is not None else cs,
        passing, pl.cu, pl.chunk_first,
        pl.T, H, P, N, pl.NC, pl.BT, R,
        dy.stride(0), dy.stride(1), dy.stride(2), B.stride(0), B.stride(1), B.stride(2), *st_strides),
        dict(L=L, BP=pl.BP, BN=pl.BN, BK=pl.BKS, HAS_DFINAL=dfinal is not None, HAS_INIT=initial_state is not None,
             IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=_dot_dt(x.dtype)))
    # per-group dy.x^T (decayed), for dB and dC
    Q = torch.empty(pl.NCB, G, L, L, dtype=torch.float32, device=dev)
    fused = _bwd_variant() == "fused"
    nm = _cdiv(L, pl.BM)
    # every slot / total dt_bwd reads is written (it skips the slots of row blocks a chunk lacks): no zeroing
    dda = torch.empty(nm, H, pl.BT, dtype=torch.float32, device=dev)
    tot = torch.empty(pl.NCB, H, nm, nm, dtype=torch.float32, device=dev)
    _launch(_dcb_bwd, ("dcb", fused, tk), ((L // pl.BM) * (L // pl.BK), G, pl.NCB), (
        dy, x, dtp, cs, CB, Q, dda, tot, pl.chunk_t0, pl.chunk_len,
        pl.T, H, P, pl.NC, pl.BT, R, G,
        dy.stride(0), dy.stride(1), dy.stride(2), x.stride(0), x.stride(1), x.stride(2)),
        dict(L=L, BM=pl.BM, BK=pl.BK, BPF=pl.BPF, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=_dot_dt(x.dtype),
             QONLY=fused))
    # dx, direct ddt, per-row dcs
    dx = torch.empty(pl.b, pl.T, H, P, dtype=x.dtype, device=dev)
    ddt_dir = torch.empty(H, pl.BT, dtype=torch.float32, device=dev)
    dcs_dbdc = _dcs_in_dbdc()
    bn_dbdc = _dbdc_bn(pl)
    n_dcs = _cdiv(N, bn_dbdc) if dcs_dbdc else 1  # dcs partial sums, one per dbdc_bwd n block
    dcs = torch.empty(n_dcs, H, pl.BT, dtype=torch.float32, device=dev)
    qrow = torch.empty_like(ddt_dir)
    dD_part = (torch.zeros((pl.NCB * nm, H, P) if D.dim() == 2 else (pl.NCB * nm, H), dtype=torch.float32, device=dev)
               if D is not None else None)
    fact = _dx_fact()
    _launch(_dx_bwd, ("dx", fused, fact, dcs_dbdc, tk), (nm, H, pl.NCB), (
        dy, x, B, C, CB, dtp, cs, states, dstates, D if D is not None else cs,
        dx, ddt_dir, dcs, qrow, dD_part if dD_part is not None else cs, pl.chunk_t0, pl.chunk_len,
        pl.T, H, P, N, pl.NC, pl.BT, R, G,
        dy.stride(0), dy.stride(1), dy.stride(2), x.stride(0), x.stride(1), x.stride(2),
        B.stride(0), B.stride(1), B.stride(2), *st_strides),
        dict(L=L, BM=pl.BM, BK=pl.BK, BPF=pl.BPF, BNF=pl.BNF, HAS_D=D is not None,
             D_HP=D is not None and D.dim() == 2, IS_VARLEN=pl.varlen, DOT_PREC=prec, DOT_DT=_dot_dt(x.dtype),
             dda_ptr=dda, tot_ptr=tot, DDA=fused, FACT=fact, DCS=not dcs_dbdc), fixed=_fixed_cfgs().get("dx"))
    # dB, dC
    dB = torch.empty(pl.b, pl.T, G, N, dtype=B.dtype, device=dev)
    dC = torch.empty(pl.b, pl.T, G, N, dtype=C.dtype, device=dev)
    _launch(_dbdc_bwd, ("dbdc", dcs_dbdc, bn_dbdc, tk), (pl.NCB, G, nm * _cdiv(N, bn_dbdc)), (
        dy, x, B, C, dtp, cs, states, dstates, Q, dB, dC, pl.chunk_t0, pl.chunk_len,
        pl.T, H, P, N, pl.NC, pl.BT, R, G,
        dy.stride(0), dy.stride(1), dy.stride(2), x.stride(0), x.stride(1), x.stride(2),
        B.stride(0), B.stride(1), B.stride(2), *st_strides),
        dict(L=L, BM=pl.BM, BK=pl.BK, BPF=pl.BPF, BN=bn_dbdc, IS_VARLEN=pl.varlen, DOT_PREC=prec,
             DOT_DT=_dot_dt(x.dtype), dcs_ptr=dcs, DCS=dcs_dbdc))
    # dt, dA, dt_bias
    has_limit, lo, hi = _limits(dt_limit)
    ddt = torch.empty(dt.shape, dtype=dt.dtype, device=dev)
    dA_part = torch.zeros(pl.NCB, H, dtype=torch.float32, device=dev)
    dbias_part = torch.zeros(pl.NCB, H, dtype=torch.float32, device=dev) if dt_bias is not None else None
    _dt_bwd[(pl.NCB, _cdiv(H, pl.BH))](
        dt, dt_bias if dt_bias is not None else dt, A, dtp, ddt_dir, dcs, dda, tot, qrow, passing,
        ddt, dA_part, dbias_part if dbias_part is not None else dA_part, pl.chunk_t0, pl.chunk_len,
        pl.T, H, pl.NC, pl.BT, pl.npn, dt.stride(0), dt.stride(1), lo, hi,
        L=L, BH=pl.BH, NPN_B=_p2(pl.npn, 1), HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        HAS_LIMIT=has_limit, IS_VARLEN=pl.varlen, BMB=pl.BM, NDCS=n_dcs, num_warps=4)
    dA = dA_part.sum(0).to(A.dtype)
    ddt_bias = dbias_part.sum(0).to(dt_bias.dtype) if dt_bias is not None else None
    dD = None
    if D is not None:
        dD = dD_part.sum(0).to(D.dtype)  # (H, P) or (H,)
    dinit = dinit.to(initial_state.dtype) if dinit is not None else None
    return dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit


class SSDScanFn(torch.autograd.Function):
    """Autograd wrapper; inputs arrive already checked and laid out by ssd_scan_triton."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_softplus, dt_limit,
                return_final_state):
        plan = _plan(x, B, cu_seqlens, chunk_size)
        y, final, aux = _forward(x, dt, A, B, C, D, z, dt_bias, initial_state, plan, dt_softplus, dt_limit,
                                 return_final_state, save=True)
        dtp, cs, states, st_strides, CB, ypre = aux
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_state, dtp, cs, states, CB,
                              ypre if z is not None else None)  # the pre-gate output, for dz
        ctx.plan, ctx.dt_softplus, ctx.dt_limit, ctx.st_strides = plan, dt_softplus, dt_limit, st_strides
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, z, dt_bias, initial_state, dtp, cs, states, CB, ypre = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        grads = _backward(dy, dfinal, x, dt, A, B, C, D, z, dt_bias, initial_state, ctx.plan, ctx.dt_softplus,
                          ctx.dt_limit, (dtp, cs, states, ctx.st_strides, CB, ypre))
        dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit = grads
        return dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinit, None, None, None, None, None


def _prep(x, dt, B, C, z):
    if x.stride(-1) != 1:
        x = x.contiguous()
    dt = dt.contiguous()
    if B.stride(-1) != 1 or C.stride(-1) != 1 or B.stride() != C.stride():
        B, C = B.contiguous(), C.contiguous()
    if z is not None and z.stride(-1) != 1:
        z = z.contiguous()
    return x, dt, B, C, z


def ssd_scan_triton(x, dt, A, B, C, *, chunk_size=256, D=None, z=None, dt_bias=None, dt_softplus=True,
                    dt_limit=(0.0, float("inf")), initial_state=None, cu_seqlens=None, return_final_state=False):
    """Triton SSD scan; same contract as lm_kernels.ssd.ssd_scan. Returns (y, final_state or None)."""
    check_scan_args(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_limit)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"ssd (triton backend): chunk_size must be a power of two >= 16, got {chunk_size}")
    for name, v in (("x", x), ("B", B), ("C", C)):
        if v.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"ssd (triton backend): `{name}` must be float32/bfloat16/float16, got {v.dtype}; "
                             "use backend='reference' for float64")
    if x.shape[1] == 0:
        from .reference import ssd_scan_reference  # noqa: PLC0415
        return ssd_scan_reference(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias,
                                  dt_softplus=dt_softplus, dt_limit=dt_limit, initial_state=initial_state,
                                  cu_seqlens=cu_seqlens, return_final_state=return_final_state)
    x, dt, B, C, z = _prep(x, dt, B, C, z)
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    tensors = (x, dt, A, B, C, D, z, dt_bias, initial_state)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if needs_grad:
        return SSDScanFn.apply(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, chunk_size, dt_softplus,
                               tuple(dt_limit), return_final_state)
    plan = _plan(x, B, cu_seqlens, chunk_size)
    y, final, _ = _forward(x, dt, A, B, C, D, z, dt_bias, initial_state, plan, dt_softplus, dt_limit,
                           return_final_state, save=False)
    return y, final
