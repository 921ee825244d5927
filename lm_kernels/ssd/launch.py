"""Launch machinery of the Triton SSD scan: the autotuned kernels (launched through lm_kernels.autotune.launch, the
autotuner's chosen config kept per call shape), and the Plan of a call (shapes, block sizes, the chunk table of packed documents).

Autotuning runs on the GPU only; under the interpreter or with LM_SSD_AUTOTUNE=0 every kernel launches the first
config of its list (saves compile time, e.g. in tests; the two scans: their small last one in the interpreter). These
settings are read per call (`tuners()`: the autotuners built for them on first use). The autotuners keep their
choices on disk (lm_kernels.autotune; LM_TRITON_AUTOTUNE_CACHE=0 turns that off). Why each list holds what it holds,
with the timings: docs/performance.md.
"""
from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from ..autotune import autotune, launch, tuning  # noqa: F401  (launch: the SSD launches call ln.launch)
from ..backend import cdiv, interpreted, next_pow2
from .backward import dbdc_bwd_kernel, dcb_bwd_kernel, dstate_bwd_kernel
from .backward_dx import dx_bwd_kernel
from .chunk_scan import chunk_scan_fwd2_kernel, chunk_scan_fwd4_kernel
from .chunk_state import state_fwd_kernel
from .dt_cb import dtcb_fwd_kernel

STATE_STEP_ROWS = 256  # the state kernels take a whole chunk per step up to this many rows
TILE_ROWS = 64  # row / k blocks of C.B, the scan and the backward kernels: min(TILE_ROWS, chunk) (tests use 16)
MAX_GRID_YZ = 65535  # CUDA's limit on a launch grid's second and third axes (chunks and sequences run on the third)


def _cfgs(*pairs):
    return [triton.Config({}, num_warps=w, num_stages=s) for w, s in pairs]


def _prune_fwd2(configs, named_args, **kwargs):
    """Row blocks inside the chunk, k-blocks dividing the row block (BK <= BM, both powers of two)."""
    L = kwargs.get("L", named_args.get("L"))
    keep = [c for c in configs if c.kwargs["BM"] <= L and c.kwargs["BK"] <= c.kwargs["BM"]]
    return keep or [c for c in configs if c.kwargs["BK"] <= c.kwargs["BM"]][-1:]


# The config lists (the first of each: the one launched without autotuning) and keys of the autotuned kernels.
_DTCB_FWD = (_cfgs((4, 2), (8, 2)), ["N", "H"])
# 32-row p blocks: more programs for long sequences. The state walks and dcb_bwd also get a 4-warp config capped at
# 128 registers (4 programs per SM instead of 3 (state, dstate) or 2 (dcb); no spills in the state walks, 12 bytes in
# dcb_bwd on sm_90): the Mamba2-350M step's tuner picks them (H100)
_CAP128 = dict(num_warps=4, num_stages=2, maxnreg=128)
_STATE_FWD = ([triton.Config(dict(BP=bp), num_warps=w, num_stages=2) for bp, w in ((64, 8), (64, 4), (32, 4), (32, 8))]
              + [triton.Config(dict(BP=64), **_CAP128)], ["P", "N", "R", "BN", "NC"])
_SCAN_FWD2_CFGS = [triton.Config(dict(BM=bm, BK=bk, BP=bp), num_warps=w, num_stages=st)
                   for bm, bk, bp, w, st in ((64, 64, 64, 4, 2), (64, 32, 64, 4, 2), (64, 32, 64, 4, 3),
                                             (128, 64, 64, 8, 2), (128, 32, 64, 8, 3), (64, 32, 32, 4, 2),
                                             (64, 64, 64, 8, 2), (32, 32, 64, 4, 2), (128, 128, 64, 8, 2),
                                             (64, 64, 64, 4, 3), (128, 64, 64, 8, 3),
                                             (32, 16, 16, 4, 2))]  # the last: interpreter tests (small chunks)
# first: capped at 168 registers (3 programs per SM instead of 2; the config without autotuning); with the gate z
# (HAS_Z) the cap spills more and the autotuner picks between capped and uncapped. Capped at 128: 4 programs per SM
# with 16 bytes of spills (triton 3.6); the Mamba2-350M step's tuner takes it (0.223 -> 0.216 ms per call, H100)
_SCAN_FWD4_CFGS = [triton.Config(dict(BP=64), num_warps=4, num_stages=1, maxnreg=168),
                   triton.Config(dict(BP=64), num_warps=4, num_stages=1, maxnreg=128)] + [
    triton.Config(dict(BP=bp), num_warps=w, num_stages=1)
    for bp, w in ((64, 4), (32, 4), (64, 8),
                  (16, 4))]  # the last: interpreter tests (small chunks)
_DSTATE_BWD = (_cfgs((8, 2), (4, 2)) + [triton.Config({}, **_CAP128)], ["P", "N", "R"])
_DCB_BWD = (_cfgs((4, 2), (8, 2)) + [triton.Config({}, **_CAP128)], ["P", "R"])
# (8, 4) is not first: float32 / float16 tiles need more shared memory than an H100 has at 4 stages (the
# autotuner skips such configs; without autotuning the first one launches)
_DBDC_BWD = (_cfgs((8, 2), (8, 4), (4, 2), (8, 3)) + [triton.Config({}, num_warps=8, num_stages=2, maxnreg=128)],
             ["P", "N", "R", "BN"])
_DX_BWD = ([triton.Config({}, num_warps=4, num_stages=1, maxnreg=168)] + _cfgs((4, 1)), ["P", "N", "R"])


@functools.lru_cache(maxsize=None)
def _build(interpret: bool, tune: bool, cache: bool) -> SimpleNamespace:
    """The SSD's autotuned kernels for these settings (lm_kernels.autotune.tuning): each over its whole list when
    `tune`, else its first config; in the interpreter the two scans take their small last config (16-row chunks
    of the tests). `ss`: the STORE_SS scan tuners (scan_fwd_ss), made on first use."""
    def tuned(fn, configs, key, **kw):
        return autotune(configs=configs if tune else configs[:1], key=key, cache=cache, **kw)(fn)

    fwd2 = _SCAN_FWD2_CFGS if tune else _SCAN_FWD2_CFGS[-1:] if interpret else _SCAN_FWD2_CFGS[:1]
    fwd4 = _SCAN_FWD4_CFGS[:-1] if tune else _SCAN_FWD4_CFGS[-1:] if interpret else _SCAN_FWD4_CFGS[:1]
    return SimpleNamespace(
        cache=cache, ss={},
        dtcb_fwd=tuned(dtcb_fwd_kernel, *_DTCB_FWD),
        state_fwd=tuned(state_fwd_kernel, *_STATE_FWD),
        scan_fwd2=autotune(configs=fwd2, key=["P", "N", "R", "L"], cache=cache,
                           prune_configs_by={"early_config_prune": _prune_fwd2})(chunk_scan_fwd2_kernel),
        scan_fwd4=autotune(configs=fwd4, key=["P", "N", "R", "L", "HAS_Z"], cache=cache)(chunk_scan_fwd4_kernel),
        dstate_bwd=tuned(dstate_bwd_kernel, *_DSTATE_BWD),
        dcb_bwd=tuned(dcb_bwd_kernel, *_DCB_BWD),
        dbdc_bwd=tuned(dbdc_bwd_kernel, *_DBDC_BWD),
        dx_bwd=tuned(dx_bwd_kernel, *_DX_BWD))


def tuners() -> SimpleNamespace:
    """The SSD's autotuned kernels (dtcb_fwd, state_fwd, scan_fwd2, scan_fwd4, dstate_bwd, dcb_bwd, dbdc_bwd, dx_bwd)
    for the settings read now: TRITON_INTERPRET, LM_SSD_AUTOTUNE, LM_TRITON_AUTOTUNE_CACHE."""
    return _build(*tuning("ssd"))


def _widen(configs, P):
    """The configs with a p block of at least P (next power of two), duplicates dropped: for the scan launches that
    store each row's sum of squares over the head's columns (one program per row and head)."""
    out, seen = [], set()
    for c in configs:
        kw = dict(c.kwargs, BP=max(c.kwargs["BP"], p2(P)))
        key = (tuple(sorted(kw.items())), c.num_warps, c.num_stages, getattr(c, "maxnreg", None))
        if key not in seen:
            seen.add(key)
            out.append(triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages,
                                     maxnreg=getattr(c, "maxnreg", None)))
    return out


def scan_fwd_ss(tn: SimpleNamespace, four: bool, P: int):
    """The chunk_scan_fwd4 (four) / fwd2 autotuner of `tn` (tuners()) for launches with STORE_SS (the folded gated
    norm, lm_kernels.mamba2): its config list with the p block widened to hold all P columns."""
    key = (four, P)
    t = tn.ss.get(key)
    if t is None:
        base = tn.scan_fwd4 if four else tn.scan_fwd2
        kw = dict(prune_configs_by={"early_config_prune": _prune_fwd2}) if not four else {}
        t = tn.ss[key] = autotune(configs=_widen(base.configs, P), key=list(base.keys), cache=tn.cache, **kw)(base.fn)
    return t


def p2(v, lo=16):
    return max(lo, next_pow2(v))


def dot_dt(dtype):
    """Operand dtype of tl.dot: the input dtype; float32 under the interpreter (its bf16 dot is wrong)."""
    if interpreted():
        return tl.float32
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def dot_prec(dtype):
    """tf32 products for float32 inputs unless torch.get_float32_matmul_precision() == "highest"."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def limits(dt_limit):
    """(clamp at all, low, high) of dt_limit, with a finite high for the kernels."""
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    has = lo > 0.0 or hi < math.inf
    return has, lo, (hi if hi < math.inf else 3.0e38)


def tune_key(pl, x, dt, A, B, D, z, dt_bias, initial_state):
    """What fixes every autotuner's key of a call (its shape arguments and the dtypes of its tensors), for
    launch (a superset: the launch flags are not in the autotuners' keys)."""
    return (pl.P, pl.N, pl.R, pl.L, pl.NC, pl.H, pl.G, pl.BN, pl.BM, x.dtype, dt.dtype, A.dtype, B.dtype,
            None if D is None else D.dtype, None if z is None else z.dtype, None if dt_bias is None else dt_bias.dtype,
            None if initial_state is None else initial_state.dtype)


_PLANS = {}


def plan(x, B, cu_seqlens, chunk_size, table=None):
    """Plan of a call, cached per (shapes, chunk, device) for fixed-length batches (no host work repeated by
    the many same-shape calls of the fixed-point iterations); packed documents build their chunk table, or take
    `table` (Plan.table of the forward's plan: the backward reuses it instead of rebuilding it)."""
    if cu_seqlens is not None:
        return Plan(x, B, cu_seqlens, chunk_size, table)
    key = (x.shape, B.shape, chunk_size, x.device)
    pl = _PLANS.get(key)
    if pl is None:
        if len(_PLANS) > 256:
            _PLANS.clear()
        pl = _PLANS[key] = Plan(x, B, None, chunk_size)
    return pl


def num_chunk_blocks(b, t, nseq, chunk_size, varlen):
    """Plan.NCB from the shapes alone (ints or SymInts, for the custom op's fake): chunk slots of the call."""
    return t // chunk_size + nseq if varlen else b * max(1, -(-t // chunk_size))


def check_chunk_grid(b, t, nseq, chunk_size, varlen, op):
    """The kernels launch one program row per chunk (and per sequence) on the grid's third axis: a call with more
    chunk slots than that axis holds is a ValueError that says what to change (before any launch)."""
    ncb = num_chunk_blocks(b, t, nseq, chunk_size, varlen)
    if ncb > MAX_GRID_YZ:
        docs = f", {nseq} documents" if varlen else ""
        raise ValueError(f"{op}: {b} x {t} tokens{docs} at chunk_size {chunk_size} make {ncb} chunks in one call, more "
                         f"than the GPU launch grid's {MAX_GRID_YZ}; use a larger chunk_size or fewer tokens per call "
                         "(a smaller micro-batch or sequence length)")


def table_layout(nseq, ncb):
    """(offsets of cu, chunk_first, chunk_t0, chunk_len in the int32 chunk table, its length) for packed documents;
    each part starts at a multiple of 4 elements: 16-byte aligned pointers, as the kernels were compiled for (an
    unaligned one would compile another variant of each kernel)."""
    offs, n = [], 0
    for size in (nseq + 1, nseq + 1, ncb, ncb):
        offs.append(n)
        n = n + -(-size // 4) * 4
    return offs, n


class Plan:
    """Shapes, block sizes and the chunk table of one call (shared by forward and backward)."""

    def __init__(self, x, B, cu_seqlens, chunk_size, table=None):
        b, t, h, p = x.shape
        g, n = B.shape[2], B.shape[3]
        L = chunk_size
        self.b, self.T, self.H, self.P, self.G, self.N, self.L = b, t, h, p, g, n, L
        self.R = h // g
        self.BT = b * t
        self.varlen = cu_seqlens is not None
        dev = x.device
        self.table = None  # packed documents: the int32 chunk table, one buffer (see below)
        if self.varlen:
            self.nseq = cu_seqlens.numel() - 1
            self.NCB = num_chunk_blocks(b, t, self.nseq, L, True)  # upper bound on the chunks (no host sync)
            # cu | chunk_first | chunk_t0 | chunk_len in one int32 buffer: one tensor for the backward to reuse
            offs, total = table_layout(self.nseq, self.NCB)
            sizes = (self.nseq + 1, self.nseq + 1, self.NCB, self.NCB)
            if table is None:
                cu = cu_seqlens.to(device=dev, dtype=torch.int64)
                lens = cu[1:] - cu[:-1]
                nch = (lens + L - 1) // L
                first = torch.cat([cu.new_zeros(1), torch.cumsum(nch, 0)])
                j = torch.arange(self.NCB, device=dev)
                s = torch.searchsorted(first[1:], j, right=True).clamp_max(self.nseq - 1)
                t0 = cu[s] + (j - first[s]) * L
                clen = torch.where(j < first[-1], torch.minimum(cu[s + 1] - t0, torch.full_like(t0, L)), 0)
                table = torch.empty(total, dtype=torch.int32, device=dev)
                for o, size, v in zip(offs, sizes, (cu, first, t0, clen)):
                    table[o:o + size].copy_(v)
            self.table = table
            self.cu, self.chunk_first, self.chunk_t0, self.chunk_len = (table[o:o + size] for o, size in zip(offs, sizes))
            self.NC = 0
        else:
            self.nseq = b
            self.NC = max(1, -(-t // L))
            self.NCB = num_chunk_blocks(b, t, b, L, False)
            # the kernels read the chunk table only for packed documents: a 0-element tensor (a null pointer, no
            # storage) stands in for it, so a cached plan holds no device memory (under torch.compile's CUDA graphs
            # a tensor kept from the first call sits in the graphs' memory pool as a leak)
            none = torch.empty(0, dtype=torch.int32, device=dev)
            self.cu = self.chunk_first = self.chunk_t0 = self.chunk_len = none
        self.BPF = p2(p)
        self.BNF = p2(n)
        self.BM = min(TILE_ROWS, L)
        self.BK = self.BM  # dcb_bwd needs square tiles (its diagonal tiles are the tiles with k0 == m0)
        self.BP = min(64, self.BPF)
        self.BN = min(64, self.BNF)
        self.BN_DBDC = min(128, self.BNF)  # dbdc_bwd's n block: one up to N = 128 (x / dy rows read once per head)
        self.BH = 16 if L <= 128 else 8
        self.BKS = min(L, STATE_STEP_ROWS)  # rows per step of the sequential state kernels
        self.npn = cdiv(p, self.BP) * cdiv(n, self.BN)
