"""lm_kernels.mamba2 on a GPU at Mamba2-350M's widths (d_inner 2048, headdim 64, one group, d_state 128, chunk 128):
bf16 outputs and every gradient equal to the Triton conv, SSD and gated norm called one by one, packed documents and
the implicit models' injection included; float32 against the float64 references; the norm folded into the next
projection (fold_norm) against the references, float32 and bf16."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from test_mamba2_inner import F64, _composed, _fused, _inputs, _leaves, _projected, _rel, _run

pytestmark = pytest.mark.gpu

DIMS = (2048, 64, 1, 128, 2048, 128)  # d_inner, headdim, ngroups, dstate, norm group, chunk


def _cuda(d):
    return {k: v.cuda() for k, v in d.items()}


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_gpu_inner_bf16_equals_three_ops(packed, monkeypatch):
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "triton")
    di, p, g, n, ng, chunk = DIMS
    b, t = (1, 3000) if packed else (2, 1100)
    cu = torch.tensor([0, 700, 2101, 3000], dtype=torch.int32, device="cuda") if packed else None
    d = _cuda(_inputs(b, t, di, p, g, n, 4, adds=True, states=not packed, seed=0))
    final = True
    outs, grads = _run(_fused, _leaves(d, torch.bfloat16), DIMS, cu, final)
    ref_outs, ref_grads = _run(partial(_composed, backend="triton"), _leaves(d, torch.bfloat16), DIMS, cu, final)
    for a, r in zip(outs, ref_outs):
        torch.testing.assert_close(a, r, rtol=0, atol=0)
    for k in ref_grads:
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=0, atol=0, msg=k)


def test_gpu_inner_float32_vs_float64_references():
    di, p, g, n, ng, chunk = DIMS
    d = _inputs(1, 700, di, p, g, n, 4, adds=True, states=True, seed=1)
    d = {k: v.float().double().cuda() for k, v in d.items()}
    outs, grads = _run(_fused, _leaves(d, torch.float32), DIMS, None, True)
    ref_outs, ref_grads = _run(_composed, _leaves(d, F64), DIMS, None, True)
    errs = {**{f"out{i}": _rel(a, r) for i, (a, r) in enumerate(zip(outs, ref_outs))},
            **{k: _rel(grads[k], ref_grads[k]) for k in ref_grads}}
    print({k: f"{v:.1e}" for k, v in errs.items()})
    # tf32 products (float32 inputs): the SSD's GPU tests hold 5e-3
    assert all(v < 5e-3 for v in errs.values()), errs


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_gpu_inner_backward_side_stream_equals_one_stream(packed, monkeypatch):
    """The backward's second stream (the gated norm's weight sum, dcb_bwd, dbdc_bwd, the dt stage beside the conv
    backward) gives the one-stream gradients bit for bit, at Mamba2-350M's layer (16 x 2048 tokens), three times over
    with the memory it freed taken at once by other work (a buffer reused before the side stream was done with it
    would change them)."""
    import lm_kernels.mamba2.triton_inner as inner

    di, p, g, n, ng, chunk = DIMS
    b, t = (1, 16 * 2048) if packed else (16, 2048)
    cu = torch.tensor([0, 1000, 6161, 6200, 20000, 32768], dtype=torch.int32, device="cuda") if packed else None
    d = _cuda(_inputs(b, t, di, p, g, n, 4, adds=False, states=False, seed=3))
    d = {k: v.to(torch.bfloat16) if k == "zxbcdt" else v.float() for k, v in d.items()}  # float32 parameters

    def grads():
        leaves = {k: v.clone().requires_grad_() for k, v in d.items()}
        y, _, _ = _fused(leaves, DIMS, cu, False)
        gy = torch.randn(y.shape, generator=torch.Generator("cuda").manual_seed(5), device="cuda", dtype=y.dtype)
        y.backward(gy)
        churn = [torch.randn(8192, 8192, device="cuda") for _ in range(3)]  # takes the freed memory right away
        churn = [c @ c for c in churn]
        torch.cuda.synchronize()
        return {k: v.grad for k, v in leaves.items()}

    two = [grads() for _ in range(3)]
    monkeypatch.setattr(inner, "side_stream", lambda device: None)
    one = grads()
    for g2 in two:
        for k in one:
            assert torch.equal(g2[k], one[k]), k


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_gpu_folded_norm_vs_float64_references(packed):
    """fold_norm at Mamba2-350M's layer: (u @ (W * w)^T) * rstd against RMSNorm(...) @ W^T from the float64
    references, outputs and every gradient; float32 (tf32 products, as the other float32 test) and bf16 (the
    unfolded operator's own bf16 error beside it: the fold must not be less accurate); the projection's rows padded
    and the injection's not, as inductor lays them out."""
    di, p, g, n, ng, chunk = DIMS
    b, t = (1, 3000) if packed else (2, 1100)
    cu = torch.tensor([0, 700, 2101, 3000], dtype=torch.int32, device="cuda") if packed else None
    d = _inputs(b, t, di, p, g, n, 4, adds=True, states=not packed, seed=2)
    d["out_weight"] = torch.randn(1024, di, generator=torch.Generator().manual_seed(2), dtype=F64) * 0.02
    d = {k: v.float().double().cuda() for k, v in d.items()}
    ref_outs, ref_grads = _run(partial(_projected, False), _leaves(d, F64), DIMS, cu, True)
    outs, grads = _run(partial(_projected, True, pad=32), _leaves(d, torch.float32), DIMS, cu, True)
    errs = {**{f"out{i}": _rel(a, r) for i, (a, r) in enumerate(zip(outs, ref_outs))},
            **{k: _rel(grads[k], ref_grads[k]) for k in ref_grads}}
    print("float32", {k: f"{v:.1e}" for k, v in errs.items()})
    assert all(v < 5e-3 for v in errs.values()), errs
    outs, grads = _run(partial(_projected, True, pad=32), _leaves(d, torch.bfloat16), DIMS, cu, True)
    un_outs, un_grads = _run(partial(_projected, False, inner=_fused), _leaves(d, torch.bfloat16), DIMS, cu, True)
    for i, (a, u, r) in enumerate(zip(outs, un_outs, ref_outs)):
        assert _rel(a, r) < max(2 * _rel(u, r), 1e-2), (i, _rel(a, r), _rel(u, r))
    for k in ref_grads:
        assert _rel(grads[k], ref_grads[k]) < max(2 * _rel(un_grads[k], ref_grads[k]), 2e-2), (
            k, _rel(grads[k], ref_grads[k]), _rel(un_grads[k], ref_grads[k]))
