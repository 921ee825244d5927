"""lm_kernels.mamba2 on a GPU at Mamba2-350M's widths (d_inner 2048, headdim 64, one group, d_state 128, chunk 128):
bf16 outputs and every gradient equal to the Triton conv, SSD and gated norm called one by one, packed documents and
the implicit models' injection included; float32 against the float64 references."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from test_mamba2_inner import F64, _composed, _fused, _inputs, _leaves, _rel, _run

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
