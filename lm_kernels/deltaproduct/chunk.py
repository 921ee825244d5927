"""Triton chunkwise (WY/UT) path of the (Gated) DeltaProduct op: the launches and the autograd Function.

The op is a gated delta rule over the interleaved sequence of L = nh*T rows (reference.py has the chunk equations in
PyTorch). Queries exist only on each token's last sub-step, so outputs and query gradients are computed on a tile of
the BQ ~ BT/nh tokens whose last row lies in a chunk. A batch of B sequences runs as B packed documents, so fixed
length and varlen share every kernel. Phases, one module each:

    prep.py       parallel over chunks: gate cumsum, T = (I + A)^-1, W (and Aqk for nh >= 2)
    fwd.py        sequential over chunks: U, Vn = U - W S, the output, the state
    bwd_state.py  sequential over chunks in reverse: dVn and each chunk's state gradient
    bwd.py        parallel over chunks: dq, dk, dv, dbeta, dg

What the backward keeps: the inputs, the gate cumsum gc and T (n_h H chunk per token, in k's dtype). It does not
keep W, Vn (each the size of k / v) or the state entering each chunk (n_h H K V / chunk per token: at
DeltaProduct-392M n_h = 2 four hidden vectors, with W and Vn ~12.9 GB at micro-batch 16 x 2048 tokens): the
backward recomputes them (`_recompute`) with one launch of the prep that forms W alone from the saved T and gc
(W_ONLY: reads T, K, beta, writes W) and one of the sequential forward that stores the states and Vn without
forming the output (SAVE without OUT), both the forward's code at the forward's launch configs, so they are the
values the forward had. T stays saved: forming it again is the prep's costly part (the A blocks, the inversions).
The forward runs the same launches with and without grad.

Each kernel runs one measured launch config (configs.py; the measurements are in docs/performance.md).
"""
from __future__ import annotations

import warnings

import torch
from triton.runtime.errors import OutOfResources

from ..backend import cdiv, interpreted, next_pow2
from ._common import check_inputs
from .bwd import _bwd_main_kernel, _bwd_qk_kernel, _bwd_wy_kernel
from .bwd_state import _bwd_state_kernel
from .configs import BASE, INTERPRETER, MAIN_NH1, WY_WIDE_K
from .fwd import _fwd_kernel
from .l2norm import l2norm_triton
from .prep import _prep_kernel

SUPPORTED_CHUNKS = (16, 32, 64)
# The backward runs as two kernels on K slices of this width for key heads of two or more slices, else as one.
SPLIT_BK = 64
_SEQUENTIAL = ("fwd", "bwd_state")  # the chunk-sequential kernels
_FIT: dict = {}  # (name, config, dtype, constexprs) -> the config that fit in shared memory


def _refused(name, bv, nw, ns):
    """32-wide (or narrower) V blocks of a sequential kernel at 4 warps and 1 stage gave wrong results or illegal
    addresses on an H100 (triton 3.6)."""
    return name in _SEQUENTIAL and bv is not None and bv < 64 and nw >= 4 and ns == 1


def _smaller(name, meta, nw, ns, kw, vary_bv=True):
    """Configs to try after an out-of-shared-memory launch, in order: fewer pipeline stages, then (vary_bv: where the
    grid follows BV or does not depend on it) narrower V blocks, at 2 warps where 4 would hit a refused config. Same
    results, less shared memory."""
    bv0 = meta.get("BV", kw.get("BV"))
    for bv in ([bv0] if bv0 is None or not vary_bv else [b for b in (bv0, bv0 // 2, bv0 // 4) if b >= 16]):
        for st in range(ns, 0, -1):
            if (bv, st) != (bv0, ns):
                yield ({**meta, "BV": bv} if bv is not None else dict(meta)), \
                    (2 if _refused(name, bv, nw, st) else nw), st


def _launch(kern, name, grid, args, kw, config=None):
    """kern[grid](*args, **kw) at `config` (meta, num_warps, num_stages), default BASE[name], on the GPU; in the
    interpreter at INTERPRETER[name]. grid is a tuple or a function of the meta-parameters. A config that needs more
    shared memory than the GPU has (wide key heads, float32 inputs) is retried with fewer stages, then narrower V
    blocks (_smaller), with a warning; the config that fit is remembered for these constexprs and dtype."""
    if interpreted():
        meta, nw, ns = INTERPRETER[name]
        kwm = {**kw, **meta}
        kern[grid(kwm) if callable(grid) else grid](*args, **kwm, num_warps=nw, num_stages=ns)
        return
    meta, nw, ns = config or BASE[name]
    key = (name, repr((meta, nw, ns)), str(args[0].dtype),
           tuple(sorted((k, v) for k, v in kw.items() if isinstance(v, (bool, int, float, str)))))
    tries = [_FIT[key]] if key in _FIT else \
        [(meta, nw, ns), *_smaller(name, meta, nw, ns, kw, vary_bv=callable(grid) or "BV" in meta)]
    err = None
    for m, w, st in tries:
        kwm = {**kw, **m}
        try:
            kern[grid(kwm) if callable(grid) else grid](*args, **kwm, num_warps=w, num_stages=st)
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


def _chunk_tables(cu_rows_list, BT):
    """Per chunk: its sequence and first row; per sequence: index of its first chunk (lists of ints)."""
    seq, row, off = [], [], []
    for n, (a, b) in enumerate(zip(cu_rows_list[:-1], cu_rows_list[1:])):
        off.append(len(seq))
        for r in range(a, b, BT):
            seq.append(n)
            row.append(r)
    return seq, row, off


def _int32_on(parts, device):
    """The lists of ints `parts` as int32 tensors on `device` (an empty one as [0]): views of one buffer, each
    starting at a multiple of 4 elements (16-byte aligned pointers, as the kernels are specialised for), copied in one
    piece; to a GPU from pinned memory without waiting (a copy from pageable memory waits for the whole stream, all
    the work queued before it)."""
    parts = [p if p else [0] for p in parts]
    flat, starts = [], []
    for p in parts:
        starts.append(len(flat))
        flat.extend(p)
        flat.extend([0] * (-len(p) % 4))
    host = torch.tensor(flat, dtype=torch.int32)
    if device.type == "cuda":
        buf = host.pin_memory().to(device, non_blocking=True)
    else:
        buf = host.to(device)
    return [buf[s:s + len(p)] for s, p in zip(starts, parts)]


_TABLES: dict = {}


def _tables(cu_tok, nh, BT, device):
    """Chunk tables (cseq, crow, coff, NT, cu_rows) for these token offsets (a tuple of ints), cached: the layers of a
    forward, the fixed-point iterations and fixed-length batches repeat the same key, so the tables are built and
    copied to the device once, not on every call."""
    key = (cu_tok, nh, BT, str(device))
    hit = _TABLES.get(key)
    if hit is None:
        cu_rows_list = [c * nh for c in cu_tok]
        seq, row, off = _chunk_tables(cu_rows_list, BT)
        cseq, crow, coff, cu_rows = _int32_on((seq, row, off, cu_rows_list), device)
        hit = (cseq, crow, coff, len(seq), cu_rows)
        if len(_TABLES) > 64:
            _TABLES.clear()
        _TABLES[key] = hit
    return hit


def _bq(BT: int, nh: int) -> int:
    """Token-tile rows: the tokens whose last sub-step lies in a chunk (~BT/nh), at least 32 (16-row tiles crashed an
    H100 with illegal addresses at nh = 4, a Hopper code-generation fault). The extra rows are masked."""
    return max(32, next_pow2(cdiv(BT, nh)))


def _sizes(k, v, meta):
    """(L, H, K, V, BK, BV, BQ, prec) of a launch: k's rows, heads and head size, v's head size, the K / V blocks,
    the query tile and the dot precision (float32 inputs: 3xTF32 on the GPU, about float32 accuracy on the tensor
    cores)."""
    _, L, H, K = k.shape
    V = v.shape[-1]
    BK = max(16, next_pow2(K))
    BV = min(64, max(16, next_pow2(V)))
    prec = "tf32x3" if k.dtype == torch.float32 else "tf32"
    return L, H, K, V, BK, BV, _bq(meta["BT"], meta["nh"]), prec


def _fwd(q, k, v, beta, g, h0, meta):
    """q (1,T,H,K), k,v,beta rows (1,L,..), g (1,T,H) or None. Returns o, the final state (or None) and what the
    backward keeps besides the inputs: gc and T (it recomputes the rest, `_recompute`). The same launches with and
    without grad."""
    L, H, K, V, BK, BV, BQ, prec = _sizes(k, v, meta)
    dev = k.device
    gc = torch.empty(1, L, H, dtype=torch.float32, device=dev)
    Tm = torch.empty(1, L, H, meta["BT"], dtype=k.dtype, device=dev)  # only ever a tensor-core operand in k's dtype
    # nh >= 2: the prep forms Aqk (for nh = 1 its 64-token query tile overloads the prep; the sequential forward forms
    # it there)
    aqk = torch.empty(meta["NT"], H, BQ, meta["BT"], dtype=k.dtype, device=dev) if meta["nh"] >= 2 else None
    w = _prep(q, k, beta, g, gc, Tm, aqk, meta, w_only=False)
    o, ht, *_ = _sequential(q, k, v, beta, h0, gc, Tm, w, aqk, meta, out=True, save=False, final=meta["output_final"])
    return o, ht, (gc, Tm)


def _prep(q, k, beta, g, gc, Tm, aqk, meta, *, w_only):
    """One launch of the prep (prep.py); returns W. Without `w_only` it also writes gc, T and (nh >= 2) aqk; with it,
    W is formed from the gc and T already there (g and aqk are not read)."""
    L, H, K, V, BK, BV, BQ, prec = _sizes(k, k, meta)
    w = torch.empty_like(k)
    _launch(_prep_kernel, "prep", (meta["NT"], H),
            (k, beta, g if g is not None else gc, gc, Tm, meta["cseq"], meta["crow"], meta["cu_rows"], q, w,
             aqk if aqk is not None else gc, meta["scale"]),
            dict(NH=meta["nh"], H=H, K=K, BT=meta["BT"], BK=BK, BQ=BQ, USE_G=g is not None, PREC=prec,
                 MP="tf32" if prec == "tf32" else "ieee", INTRA=meta["nh"] >= 2, W_ONLY=w_only))
    return w


def _sequential(q, k, v, beta, h0, gc, Tm, w, aqk, meta, *, out, save, final):
    """One launch of the sequential forward (fwd.py): with `out` the output o (and with `final` the final state),
    with `save` the chunk states, Vn and (nh = 1) Aqk^T. Returns (o, ht, hs, vn, aqkt), None for what it did not
    form. aqk: the prep's (nh >= 2, read with `out`)."""
    nh, BT, scale = meta["nh"], meta["BT"], meta["scale"]
    L, H, K, V, BK, BV, BQ, prec = _sizes(k, v, meta)
    dev = k.device
    coff, NT, cu_rows, N = meta["coff"], meta["NT"], meta["cu_rows"], meta["N"]
    intra = nh >= 2
    o = torch.empty(*q.shape[:3], V, dtype=v.dtype, device=dev) if out else None
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if final else None
    hs = torch.empty(NT, H, K, V, dtype=k.dtype, device=dev) if save else None
    vn = torch.empty_like(v) if save else None
    aqkt = torch.empty(NT, H, BT, BQ, dtype=k.dtype, device=dev) if save and not intra else None
    x = lambda t: t if t is not None else gc  # noqa: E731  (an unused pointer argument)
    args = (q, k, w, gc, x(h0), x(o), x(ht), x(hs), x(vn), x(aqk), x(aqkt), v, Tm, beta, cu_rows, coff, scale)
    kw = dict(NH=nh, H=H, K=K, V=V, BT=BT, BK=BK, BQ=BQ, BQP=max(BQ, 64), USE_H0=h0 is not None, STORE_FINAL=final,
              OUT=out, SAVE=save, INTRA=intra, PREC=prec)
    _launch(_fwd_kernel, "fwd", lambda m: (cdiv(V, m["BV"]), N, H), args, kw)
    return o, ht, hs, vn, aqkt


def _recompute(q, k, v, beta, h0, gc, Tm, meta):
    """What the backward kernels read besides the inputs, gc and T: W (the prep again with W_ONLY: W from T, gc, K
    and beta), then the chunk states hs (NT, H, K, V), Vn and, at nh = 1, Aqk^T (the sequential forward again with
    SAVE and without the output). Both run the forward's code at the forward's launch configs on the forward's
    inputs, so they reproduce its W, states and Vn bit for bit. Saving them instead would keep W and Vn (2 x k's
    size) and n_h H K V / BT values per token (4 hidden vectors at DeltaProduct-392M) per layer until the backward."""
    w = _prep(q, k, beta, None, gc, Tm, None, meta, w_only=True)
    *_, hs, vn, aqkt = _sequential(q, k, v, beta, h0, gc, Tm, w, None, meta, out=False, save=True, final=False)
    return w, hs, vn, aqkt


def _bwd(q, k, v, beta, g, h0, gc, Tm, do, dht, meta):
    w, hs, vn, aqkt = _recompute(q, k, v, beta, h0, gc, Tm, meta)
    nh, BT, scale = meta["nh"], meta["BT"], meta["scale"]
    L, H, K, V, BK, BV, BQ, prec = _sizes(k, v, meta)
    dev = k.device
    cseq, crow, coff, NT, cu_rows, N = meta["cseq"], meta["crow"], meta["coff"], meta["NT"], meta["cu_rows"], meta["N"]
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None  # autograd may hand over expanded (stride-0) grads
    dh = torch.empty(NT, H, K, V, dtype=k.dtype, device=dev)
    dvn = torch.empty_like(v)
    dh0 = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if h0 is not None else None
    _launch(_bwd_state_kernel, "bwd_state", lambda m: (cdiv(V, m["BV"]), N, H),
            (q, k, w, gc, do, dht if dht is not None else gc, dh0 if dh0 is not None else gc, dh, dvn,
             aqkt if aqkt is not None else gc, cu_rows, coff, scale),
            dict(NH=nh, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, BQ=BQ, USE_DHT=dht is not None, STORE_DH0=h0 is not None,
                 PREC=prec, LOAD_AQ=aqkt is not None))
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty(g.shape, dtype=torch.float32, device=dev) if g is not None else None
    if K >= 2 * SPLIT_BK:
        db = torch.empty_like(beta)
        BK1 = min(BK, SPLIT_BK)
        NK = cdiv(K, BK1)
        dkp, dwp = torch.empty_like(k), torch.empty_like(k)
        dgp = torch.empty(NK, L, H, dtype=torch.float32, device=dev)
        _launch(_bwd_qk_kernel, "qk", (NK, NT, H),
                (q, k, gc, hs, vn, do, dh, dvn, dq, dkp, dwp, dgp, cseq, crow, cu_rows, coff, scale, L * H),
                dict(NH=nh, H=H, K=K, V=V, BT=BT, BK=BK1, BQ=BQ, PREC=prec))
        _launch(_bwd_wy_kernel, "wy", (NT, H),
                (k, v, beta, gc, Tm, dvn, dwp, dkp, dgp, dk, dv, db, dg if dg is not None else gc, cseq, crow,
                 cu_rows, L * H),
                dict(NH=nh, H=H, K=K, V=V, BT=BT, BK=BK, NK=NK, USE_G=g is not None, PREC=prec),
                config=WY_WIDE_K if K > 128 else None)
    else:
        # one writer per row; at nh = 1 a store in beta's dtype costs the kernel spills, so float32 and a cast after
        db = torch.empty(beta.shape, dtype=torch.float32 if nh == 1 else beta.dtype, device=dev)
        _launch(_bwd_main_kernel, "main", (NT, H),
                (q, k, v, beta, gc, Tm, hs, vn, do, dh, dvn, dq, dk, dv, db, dg if dg is not None else gc,
                 cseq, crow, cu_rows, coff, scale),
                dict(NH=nh, H=H, K=K, V=V, BT=BT, BK=BK, BQ=BQ, USE_G=g is not None, PREC=prec),
                config=MAIN_NH1 if nh == 1 else None)
    return dq, dk, dv, db.to(beta.dtype), (dg.to(g.dtype) if g is not None else None), \
        (dh0.to(h0.dtype) if h0 is not None else None)


class _ChunkDeltaProductFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, g, h0, meta):
        o, ht, saved = _fwd(q, k, v, beta, g, h0, meta)
        ctx.save_for_backward(q, k, v, beta, g, h0, *saved)
        ctx.meta = meta
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, g, h0, gc, Tm = ctx.saved_tensors
        dq, dk, dv, db, dg, dh0 = _bwd(q, k, v, beta, g, h0, gc, Tm, do, dht, ctx.meta)
        return dq, dk, dv, db, dg, dh0, None


def _fitting_chunk(chunk_size: int, dtype, K: int, on_gpu: bool) -> int:
    """The chunk length the GPU kernels run: float32 inputs with key heads over 64 at 64-row chunks need more shared
    memory than an H100 has in the backward (360 KB at K = 128, nh = 1), so they run 32-row chunks (the same chunkwise
    algebra, 65-131 KB), with a warning."""
    if on_gpu and dtype == torch.float32 and K > 64 and chunk_size > 32:
        warnings.warn(f"chunk_deltaproduct: float32 inputs with head_k_dim {K} run 32-row chunks instead of "
                      f"{chunk_size} on the GPU (the 64-row backward needs more shared memory than the GPU has); "
                      "bf16 / fp16 inputs (torch.autocast) keep 64", stacklevel=3)
        return 32
    return chunk_size


def chunk_deltaproduct_triton(q, k, v, beta, g=None, *, num_householder, scale=None, initial_state=None,
                              output_final_state=False, use_qk_l2norm=False, cu_seqlens=None, chunk_size=64,
                              cu_seqlens_cpu=None):
    """Triton path of `chunk_deltaproduct` (same contract). Computes in float32 inside the kernels;
    float64 inputs are not supported here (use the reference). The kernels read the offsets only through the chunk
    tables, built on the host from their values (`cu_seqlens_cpu` where given: then nothing is read back)."""
    B, T, H, K, V, N, offsets = check_inputs(q, k, v, beta, g, num_householder, initial_state, cu_seqlens,
                                             cu_seqlens_cpu)
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
    if interpreted() and dt == torch.bfloat16:
        # the interpreter's bf16 tl.dot returns garbage (triton 3.6 - 3.9; float16 is right): compute in float32 there,
        # as the SSD kernels do; autograd casts the gradients back to bf16
        o, ht = chunk_deltaproduct_triton(
            q.float(), k.float(), v.float(), beta.float(), g, num_householder=nh, scale=scale,
            initial_state=initial_state, output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
            cu_seqlens=cu_seqlens, chunk_size=chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
        return o.to(dt), ht
    chunk_size = _fitting_chunk(chunk_size, q.dtype, K, q.is_cuda and not interpreted())
    scale = K ** -0.5 if scale is None else float(scale)
    if use_qk_l2norm:  # one Triton kernel each way per tensor (l2norm.py), contiguous outputs
        q, k = l2norm_triton(q), l2norm_triton(k)
    # a batch of B sequences is B packed documents
    q, k, v = (x.reshape(1, -1, H, x.shape[-1]).contiguous() for x in (q, k, v))
    beta = beta.reshape(1, -1, H).contiguous()
    g = g.reshape(1, -1, H).contiguous() if g is not None else None
    cu_tok = tuple(b * T for b in range(B + 1)) if offsets is None else tuple(offsets)
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
        o, ht, _ = _fwd(q, k, v, beta, g, h0, meta)
    return o.reshape(B, T, H, V), ht
