"""Shape matrix of the (Gated) DeltaProduct Triton op (lm_kernels.deltaproduct.chunk_deltaproduct) against its float64
chunkwise PyTorch reference, forward and backward (q, k, v, beta, the gate, the initial state), on fresh random
inputs: T in {1, 2, chunk - 1, chunk, chunk + 1, 3 chunks + 5} tokens at a 16-row chunk (n_h = 1; at n_h = 2 the
interleaved rows cross the chunks at other tokens), batch 1 and 3 (T = 1 at batch 3 contiguous and strided),
contiguous inputs and non-contiguous views (time-strided column windows of wider tensors), with and without the
gate and the in-op L2 norm, and packed documents with length-1 ones. CUDA when available (its float32 products at
3xTF32), else the Triton interpreter on CPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lm_kernels.deltaproduct import chunk_deltaproduct  # noqa: E402
from shape_matrix import (  # noqa: E402,F401  (full_fp32: a fixture)
    CHUNK,
    DEV,
    F64,
    PACKED,
    TS,
    compare,
    cu_offsets,
    full_fp32,
    rel,
    strided,
    transposed,
    weights,
)

pytestmark = pytest.mark.usefixtures("fast_interpreter", "full_fp32")
H, K, V = 2, 16, 8
TOL = 1e-4
# (batch, T, n_h, layout, gate, l2norm)
CASES = [(3, 1, 1, "contiguous", True, False), (3, 1, 2, "strided", False, True), (1, 1, 1, "strided", True, False),
         (3, 2, 2, "contiguous", True, False), (1, 15, 1, "strided", True, True), (3, 16, 1, "strided", True, False),
         (1, 17, 2, "contiguous", False, False), (3, 53, 1, "strided", True, False),
         (1, 53, 2, "strided", True, True)]
IDS = [f"b{b}-T{t}-nh{nh}-{lay}{'-gate' if g else ''}{'-l2' if l2 else ''}" for b, t, nh, lay, g, l2 in CASES]
assert {c[1] for c in CASES} == set(TS)


def _data(b, t, nh, nseq, gate, l2):
    k = torch.randn(b, t * nh, H, K, dtype=F64)
    d = dict(q=torch.randn(b, t, H, K, dtype=F64), k=k if l2 else torch.nn.functional.normalize(k, dim=-1),
             v=torch.randn(b, t * nh, H, V, dtype=F64), beta=torch.rand(b, t * nh, H, dtype=F64) * 2,
             h0=torch.randn(nseq, H, K, V, dtype=F64))
    if gate:
        d["g"] = -torch.rand(b, t, H, dtype=F64) * 0.5
    return d


def _run(nh, layout, l2, cu):
    def run(v, backend):
        lay = dict(v)
        if backend == "triton" and layout == "strided":
            for name in ("q", "k", "v", "beta", "g", "h0"):
                if name in lay:
                    lay[name] = strided(lay[name])
        o, s = chunk_deltaproduct(lay["q"], lay["k"], lay["v"], lay["beta"], lay.get("g"), num_householder=nh,
                                  initial_state=lay["h0"], output_final_state=True, use_qk_l2norm=l2, cu_seqlens=cu,
                                  chunk_size=CHUNK, backend=backend)
        return o, s
    return run


@pytest.mark.parametrize("b,t,nh,layout,gate,l2", CASES, ids=IDS)
def test_chunk_deltaproduct(b, t, nh, layout, gate, l2):
    compare(_run(nh, layout, l2, None), _data(b, t, nh, b, gate, l2), weights((b, t, H, V), (b, H, K, V)), TOL)


@pytest.mark.parametrize("lens", PACKED, ids=["-".join(map(str, v)) for v in PACKED])
@pytest.mark.parametrize("nh", [1, 2])
def test_chunk_deltaproduct_packed(lens, nh):
    t = sum(lens)
    compare(_run(nh, "strided", False, cu_offsets(lens)), _data(1, t, nh, len(lens), True, False),
            weights((1, t, H, V), (len(lens), H, K, V)), TOL)


@pytest.mark.parametrize("b,nh,layout,gate,l2", [(3, 2, "contiguous", True, False), (3, 1, "strided", True, True),
                                                 (1, 2, "strided", False, False)])
def test_deltaproduct_step(b, nh, layout, gate, l2):
    """The one-token decode step (no backward on the Triton path) against its float64 reference; strided: every
    input a column window of a wider tensor with a doubled second axis, the state with its (K, V) dims stored
    swapped."""
    from lm_kernels.deltaproduct import deltaproduct_step  # noqa: PLC0415

    k = torch.randn(b, nh, H, K, dtype=F64, device=DEV)
    d = dict(state=torch.randn(b, H, K, V, dtype=F64, device=DEV), q=torch.randn(b, H, K, dtype=F64, device=DEV),
             k=k if l2 else torch.nn.functional.normalize(k, dim=-1), v=torch.randn(b, nh, H, V, dtype=F64, device=DEV),
             beta=torch.rand(b, nh, H, dtype=F64, device=DEV) * 2,
             g=-torch.rand(b, H, dtype=F64, device=DEV) * 0.5 if gate else None)
    o_r, s_r = deltaproduct_step(**d, use_qk_l2norm=l2, backend="reference")
    f = {n: v.float() if v is not None else None for n, v in d.items()}
    if layout == "strided":
        f = {n: strided(v) if v is not None and n != "state" else v for n, v in f.items()}
        f["state"] = transposed(f["state"])
    o, s = deltaproduct_step(**f, use_qk_l2norm=l2, backend="triton")
    assert rel(o, o_r) < TOL and rel(s, s_r) < TOL
