"""lm_kernels.mamba2 (Mamba2's conv -> SSD -> gated norm as one operator, its gradients written into one tensor of the
projection's shape) against the composition of the float64 PyTorch references, forward and backward, every input
with a gradient (the injection and both states included), packed documents included; without autograd; and a
tiny Mamba2 (explicit, implicit, packed) through it against the same model through the three ops one by one."""
from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("triton")

import lm  # noqa: F401,E402  (registration)
import lm.models.mamba2 as mamba2_model  # noqa: E402
from lm.models import LMMamba2Config  # noqa: E402
from lm.models.layers import rms_norm  # noqa: E402
from lm.models.mamba2 import LMMamba2ForCausalLM  # noqa: E402
from lm_kernels.conv1d import causal_conv1d, causal_conv1d_reference  # noqa: E402
from lm_kernels.mamba2 import fits, mamba2_inner  # noqa: E402
from lm_kernels.ssd import ssd_scan_xbc  # noqa: E402
from model_checks import assert_same_step_after  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_interpreter")
F64 = torch.float64


def _inputs(b, t, di, p, g, n, w, *, adds, states, seed):
    gen = torch.Generator().manual_seed(seed)
    h, cd = di // p, di + 2 * g * n

    def r(*s, scale=1.0, shift=0.0):
        return torch.randn(*s, generator=gen, dtype=F64) * scale + shift

    d = dict(zxbcdt=r(b, t, di + cd + h), conv_weight=r(cd, w, scale=0.5), conv_bias=r(cd),
             A=-(torch.rand(h, generator=gen, dtype=F64) * 2 + 0.3), D=r(h), dt_bias=r(h, scale=0.5),
             norm_weight=r(di, scale=0.2, shift=1.0))
    if adds:
        d.update(add=torch.cat([r(b, t, di), r(b, t, cd), r(b, t, h, scale=0.5)], dim=-1))  # z | xBC | dt
    if states:
        d.update(conv_state=r(b, cd, w - 1), initial_state=r(b, h, p, n))
    return d


def _cu(lens):
    """Packed documents' offsets (int32, from 0) for lengths `lens`, or None."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) if lens else None


def _leaves(d, dtype):
    """The inputs in `dtype` as fresh leaves (whatever ran on `d` before); A stays float32 like the model's
    -exp(A_log.float())."""
    return {k: v.detach().to(F64 if dtype == F64 else (torch.float32 if k == "A" else dtype)).requires_grad_()
            for k, v in d.items()}


def _fused(d, dims, cu, final):
    di, p, g, n, ng, chunk = dims
    return mamba2_inner(d["zxbcdt"], d["conv_weight"], d["conv_bias"], d["A"], d_inner=di, headdim=p, ngroups=g,
                        dstate=n, chunk_size=chunk, D=d["D"], dt_bias=d["dt_bias"], dt_limit=(0.0, 2.0),
                        norm_weight=d["norm_weight"], norm_group=ng, eps=1e-5, add=d.get("add"),
                        conv_state=d.get("conv_state"),
                        initial_state=d.get("initial_state"), cu_seqlens=cu, return_final_state=final)


def _composed(d, dims, cu, final, backend="reference"):
    """The reference: the three PyTorch ops (float64 inputs) on views of the projection; backend "triton": the three
    Triton ops one by one."""
    di, p, g, n, ng, chunk = dims
    h = di // p
    z, xbc, dt = d["zxbcdt"].split([di, di + 2 * g * n, h], dim=-1)
    z_add = x_add = None
    if "add" in d:  # the injection's column views, as the model's reference path reads it
        z_add, x_add, dt_add = d["add"].split([di, di + 2 * g * n, h], dim=-1)
        dt = dt + dt_add
    conv = causal_conv1d_reference if backend == "reference" else partial(causal_conv1d, backend="triton")
    xo, ncs = conv(xbc, d["conv_weight"], d["conv_bias"], x_add=x_add, conv_state=d.get("conv_state"),
                   cu_seqlens=cu, activation="silu")
    y, fin = ssd_scan_xbc(xo, dt, d["A"], headdim=p, ngroups=g, dstate=n, chunk_size=chunk, D=d["D"],
                          dt_bias=d["dt_bias"], dt_limit=(0.0, 2.0), initial_state=d.get("initial_state"),
                          cu_seqlens=cu, return_final_state=final, backend=backend)
    b, t = y.shape[:2]
    return rms_norm(y.reshape(b, t, di), d["norm_weight"], 1e-5, z=z, group_size=ng, z_add=z_add), ncs, fin


def _run(fn, d, dims, cu, final):
    y, ncs, fin = fn(d, dims, cu, final)
    gen = torch.Generator().manual_seed(7)
    outs = [y, ncs] + ([fin] if final else [])
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=F64).to(o.device)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], {k: v.grad for k, v in d.items()}


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


CASES = {
    # b, t, d_inner, headdim, ngroups, dstate, width, norm group, chunk; injection adds; states; packed lengths
    "plain": ((2, 40, 32, 8, 2, 8, 4, 16, 16), False, False, None),
    "adds_states": ((2, 37, 32, 8, 2, 8, 4, 16, 16), True, True, None),
    "one_group_w3": ((1, 50, 48, 16, 1, 16, 3, 48, 32), True, False, None),
    "packed": ((1, 45, 32, 8, 2, 8, 4, 16, 16), True, False, [3, 29, 13]),
}


# opcheck runs each operator about eight times (eager, fakes, AOT static and dynamic): CASES' two at smaller sizes,
# still two chunks (the second partial), two groups and two norm groups
OPCHECK = {"adds_states": ((2, 20, 16, 8, 2, 8, 4, 8, 16), True, True, None),
           "packed": ((1, 24, 16, 8, 2, 8, 4, 8, 16), True, False, [3, 14, 7])}


def _case(case, fold=False):
    """A CASES entry as (shape (b, t, d_inner, headdim, ngroups, dstate, width), adds, states, packed offsets or None,
    dims, final state wanted); fold: one norm group (fold_norm's)."""
    (b, t, di, p, g, n, w, ng, chunk), adds, states, lens = CASES[case]
    return (b, t, di, p, g, n, w), adds, states, _cu(lens), (di, p, g, n, di if fold else ng, chunk), \
        states or lens is not None


@pytest.mark.parametrize("case", list(CASES))
def test_inner_matches_composed_references(case):
    """float32 against the float64 references, two fresh draws."""
    shape, adds, states, cu, dims, final = _case(case)
    for seed in (0, 1):
        d = _inputs(*shape, adds=adds, states=states, seed=seed)
        d = {k: v.float().double() for k, v in d.items()}  # the reference sees the rounded inputs
        outs, grads = _run(_fused, _leaves(d, torch.float32), dims, cu, final)
        ref_outs, ref_grads = _run(_composed, _leaves(d, F64), dims, cu, final)
        assert outs[0].dtype == torch.float32
        for name, a, r in zip(("y", "new conv state", "final state"), outs, ref_outs):
            assert _rel(a, r) < 2e-5, (name, _rel(a, r))
        assert grads.keys() == ref_grads.keys()
        for k in grads:
            assert grads[k] is not None and grads[k].dtype == d[k].float().dtype, k
            assert _rel(grads[k], ref_grads[k]) < 2e-5, (k, _rel(grads[k], ref_grads[k]))


@pytest.mark.parametrize("case", ["adds_states", "packed"])
def test_inner_bf16_equals_the_three_triton_ops(case, monkeypatch):
    """bfloat16: the same numbers as the Triton conv, SSD and gated norm called one by one (the same kernels in the
    same order; bf16 against float64 is the kernels' own tests' business)."""
    shape, adds, states, cu, dims, final = _case(case)
    d = _inputs(*shape, adds=adds, states=states, seed=2)
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "triton")  # the gated norm's kernels in rms_norm
    outs, grads = _run(_fused, _leaves(d, torch.bfloat16), dims, cu, final)
    ref_outs, ref_grads = _run(partial(_composed, backend="triton"), _leaves(d, torch.bfloat16), dims, cu, final)
    assert outs[0].dtype == torch.bfloat16
    for a, r in zip(outs, ref_outs):
        torch.testing.assert_close(a, r, rtol=0, atol=0)
    for k in grads:
        assert grads[k].dtype == ref_grads[k].dtype, k
        torch.testing.assert_close(grads[k], ref_grads[k], rtol=0, atol=0, msg=k)


def _projected(fold, d, dims, cu, final, pad=0, inner=None):
    """out = RMSNorm(...) @ W^T, the gated norm folded into the projection (fold: u from the operator with fold_norm,
    out = (u @ (W * norm_weight)^T) * rstd, rstd outside autograd) or not (`inner`'s normalized output, the float64
    references by default). pad: the projection read as the first columns of a wider tensor (inductor pads a GEMM's
    rows), the injection not."""
    di = dims[0]
    if fold:
        zx = d["zxbcdt"]
        if pad:
            zx = torch.nn.functional.pad(zx, (0, pad))[..., :zx.shape[-1]]
            assert zx.stride(1) != zx.shape[-1]
        u, ncs, fin, rstd = mamba2_inner(
            zx, d["conv_weight"], d["conv_bias"], d["A"], d_inner=di, headdim=dims[1], ngroups=dims[2],
            dstate=dims[3], chunk_size=dims[5], D=d["D"], dt_bias=d["dt_bias"], dt_limit=(0.0, 2.0), eps=1e-5,
            add=d.get("add"), conv_state=d.get("conv_state"), initial_state=d.get("initial_state"), cu_seqlens=cu,
            return_final_state=final, fold_norm=True)
        assert not rstd.requires_grad and rstd.shape == (*u.shape[:2], 1)
        return (u @ (d["out_weight"] * d["norm_weight"]).t()) * rstd, ncs, fin
    y, ncs, fin = (inner or _composed)(d, dims, cu, final)
    return y @ d["out_weight"].t(), ncs, fin


@pytest.mark.parametrize("case", ["adds_states", "one_group_w3", "packed"])
def test_folded_norm_matches_the_references(case):
    """fold_norm (one norm group): the operator's u and rstd through the caller's projection, (u @ (W * w)^T) * rstd,
    against RMSNorm(...) @ W^T composed from the float64 references, outputs and every gradient (the projection's and
    the norm weight's included), two fresh draws (the second with the projection's rows padded, the injection's
    not: their strides differ); without autograd the same outputs."""
    shape, adds, states, cu, dims, final = _case(case, fold=True)
    for seed in (4, 5):
        d = _inputs(*shape, adds=adds, states=states, seed=seed)
        d["out_weight"] = torch.randn(24, dims[0], generator=torch.Generator().manual_seed(seed), dtype=F64) * 0.2
        d = {k: v.float().double() for k, v in d.items()}
        pad = 8 if seed == 5 else 0  # the second draw: the projection with padded rows
        outs, grads = _run(partial(_projected, True, pad=pad), _leaves(d, torch.float32), dims, cu, final)
        ref_outs, ref_grads = _run(partial(_projected, False), _leaves(d, F64), dims, cu, final)
        for name, a, r in zip(("out", "new conv state", "final state"), outs, ref_outs):
            assert _rel(a, r) < 2e-5, (name, _rel(a, r))
        assert grads.keys() == ref_grads.keys()
        for k in grads:
            assert grads[k] is not None, k
            assert _rel(grads[k], ref_grads[k]) < 2e-5, (k, _rel(grads[k], ref_grads[k]))
        with torch.no_grad():
            out0 = _projected(True, _leaves(d, torch.float32), dims, cu, final)[0]
        assert _rel(out0, ref_outs[0]) < 2e-5


def test_folded_norm_refuses_groups_and_a_weight():
    (b, t, di, p, g, n, w, ng, chunk), *_ = CASES["plain"]
    d = _leaves(_inputs(b, t, di, p, g, n, w, adds=False, states=False, seed=6), torch.float32)
    kw = dict(d_inner=di, headdim=p, ngroups=g, dstate=n, chunk_size=chunk, fold_norm=True)
    for bad in (dict(norm_group=ng), dict(norm_weight=d["norm_weight"])):
        with pytest.raises(ValueError, match="fold_norm"):
            mamba2_inner(d["zxbcdt"], d["conv_weight"], d["conv_bias"], d["A"], **kw, **bad)


def test_no_grad_forward_equals_grad_forward_and_saves_nothing():
    (b, t, di, p, g, n, w, ng, chunk), *_ = CASES["adds_states"]
    d = _leaves(_inputs(b, t, di, p, g, n, w, adds=True, states=True, seed=3), torch.float32)
    dims = (di, p, g, n, ng, chunk)
    y, ncs, fin = _fused(d, dims, None, True)
    with torch.no_grad():
        y0, ncs0, fin0 = _fused(d, dims, None, True)
    assert y.grad_fn is not None and y0.grad_fn is None and not y0.requires_grad
    for a, b_ in ((y, y0), (ncs, ncs0), (fin, fin0)):
        torch.testing.assert_close(a.detach(), b_, rtol=0, atol=0)


def test_fits_follows_the_backends(monkeypatch):
    z = torch.zeros(1, 4, 8)
    for var in ("LM_SSD_BACKEND", "LM_CONV1D_BACKEND", "LM_RMSNORM_BACKEND"):
        monkeypatch.setenv(var, "triton")
    assert fits(z, 4) and not fits(z, 9) and not fits(z.double(), 4) and not fits(z[:, :0], 4)
    monkeypatch.setenv("LM_SSD_BACKEND", "reference")
    assert not fits(z, 4)
    monkeypatch.delenv("LM_SSD_BACKEND")
    monkeypatch.delenv("LM_CONV1D_BACKEND")
    monkeypatch.delenv("LM_RMSNORM_BACKEND")
    assert not fits(z, 4)  # automatic on CPU: the references


@pytest.mark.parametrize("implicit,packed", [(False, False), (True, True)], ids=["explicit-batch", "implicit-packed"])
def test_model_through_the_operator_equals_three_ops(implicit, packed, monkeypatch):
    """The model's loss and parameter gradients through lm_kernels.mamba2 equal those through the Triton conv, SSD and
    gated norm called one by one (the same kernels; only the sums of the projection's gradients differ in order).
    One layer (the layers are alike), each case crossing a chunk: explicit on a batch (the call without injection), and
    implicit on packed documents (the injection and the offsets; the mixer hands the offsets over alike either way)."""
    for var in ("LM_SSD_BACKEND", "LM_CONV1D_BACKEND", "LM_RMSNORM_BACKEND"):
        monkeypatch.setenv(var, "triton")
    torch.manual_seed(0)
    cfg = LMMamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, d_state=8, headdim=8, ngroups=2,
                         chunk_size=16,
                         implicit=dict(max_iter=2, tol=None, phantom_steps=1, damping=1.0) if implicit else None)
    model = LMMamba2ForCausalLM(cfg).train()
    if packed:
        ids, cu = torch.randint(0, 64, (1, 24)), torch.tensor([0, 5, 20, 24], dtype=torch.int32)
    else:
        ids, cu = torch.randint(0, 64, (2, 18)), None
    calls = []
    inner = mamba2_model.mamba2_inner
    monkeypatch.setattr(mamba2_model, "mamba2_inner", lambda *a, **k: calls.append(1) or inner(*a, **k))
    assert_same_step_after(model, ids, cu, lambda: monkeypatch.setattr(mamba2_model, "mamba2_inner_fits",
                                                                       lambda *a: False))
    assert len(calls) >= cfg.num_hidden_layers  # the first pass ran the operator in every layer


@pytest.mark.parametrize("case,fold", [("adds_states", False), ("packed", True)])
def test_opcheck(case, fold):
    """torch.library.opcheck (schema, autograd registration, fakes, AOT dispatch) on both operators: the norm applied,
    with the injection and states, AOT dispatch over dynamic shapes included (slow tier); and packed with the norm
    folded (one group, no weight), without the AOT comparison (chunk slots the table leaves unused are uninitialised
    outputs, as for lm::ssd_scan_fwd). The operators' fake kernels and autograd treat packing and folding apart, so
    the two cases cover each; the folded operator through AOTAutograd against eager is also
    test_kernel_ops_compile.py::test_mamba2_block_compiles_as_one_graph."""
    from torch.library import opcheck

    import lm_kernels.mamba2.triton_inner  # noqa: F401  (registers the ops)

    ops = torch.ops.lm
    no_aot = ("test_schema", "test_autograd_registration", "test_faketensor")
    (b, t, di, p, g, n, w, ng, chunk), adds, states, lens = OPCHECK[case]
    ng = di if fold else ng
    cu = _cu(lens)
    d = {k: v.float() for k, v in _inputs(b, t, di, p, g, n, w, adds=adds, states=states, seed=4).items()}
    if fold:
        del d["norm_weight"]
    names = ("zxbcdt", "add", "conv_weight", "conv_bias", "conv_state", "A", "D", "dt_bias",
             "initial_state", "norm_weight")
    args = [d[k].requires_grad_() if k in d else None for k in names]
    rest = [cu, [di, p, g, n, ng], chunk, 0.0, 2.0, 1e-5, True]
    kw = dict(test_utils=no_aot) if lens else {}
    opcheck(ops.mamba2_inner_fwd.default, (*args, *rest, True, fold), **kw)
    plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    out = ops.mamba2_inner_fwd(*plain, *rest, True, fold)
    y, ncs, fin = out[:3]
    saved = list(out[3:])
    if cu is None:
        saved[4] = None  # the chunk table: only with packed documents
    opcheck(ops.mamba2_inner_bwd.default,
            (torch.randn_like(y), torch.randn_like(ncs), torch.randn_like(fin), *plain, cu, *saved,
             [di, p, g, n, ng], chunk, 0.0, 2.0, states, fold), **kw)


def test_bad_arguments_name_what_is_wrong():
    (b, t, di, p, g, n, w, ng, chunk), *_ = CASES["adds_states"]
    d = {k: v.float() for k, v in _inputs(b, t, di, p, g, n, w, adds=True, states=False, seed=5).items()}
    dims = (di, p, g, n, ng, chunk)
    _fused(d, dims, None, False)  # as given: runs
    bad = [
        (dict(zxbcdt=d["zxbcdt"][..., 1:]), r"zxbcdt must be \(batch, seqlen, 100\)"),
        (dict(add=d["add"][..., 1:]), r"add \(the injection\) must have zxbcdt's shape"),
        (dict(add=d["add"].double()), r"add \(the injection\) must have zxbcdt's shape .* and dtype"),
        (dict(conv_weight=d["conv_weight"][:-1]), "weight"),
        (dict(D=d["D"][:-1]), "`D`"),
        (dict(norm_weight=d["norm_weight"][:-1]), "weight"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            _fused({**d, **change}, dims, None, False)
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        _fused(d, (di, p, g, n, ng, 24), None, False)
    with pytest.raises(ValueError, match="cu_seqlens"):
        _fused(d, dims, torch.tensor([0, 5, t], dtype=torch.int32), False)  # packed documents need batch 1


def test_repeat_calls_skip_the_autotuners(autotuner_runs):
    """The op's autotuned launches (conv forward / backward, the SSD kernels, the gated norm's backward) go through
    triton's Autotuner once per shape (lm_kernels.autotune.launch); a second call launches the kept configs directly
    and gives the same outputs and gradients."""
    runs = autotuner_runs
    (b, t, di, p, g, n, w, ng, chunk), adds, states, lens = CASES["adds_states"]
    dims = (di, p, g, n, ng, chunk)
    d = _inputs(b, t, di, p, g, n, w, adds=adds, states=states, seed=4)
    outs1, grads1 = _run(_fused, _leaves(d, torch.float32), dims, None, True)
    tuned = sorted(runs)
    assert {"conv_fwd_kernel", "conv_bwd_kernel", "_gated_rmsnorm_bwd_kernel", "dx_bwd_kernel"} <= set(tuned), tuned
    outs2, grads2 = _run(_fused, _leaves(d, torch.float32), dims, None, True)
    assert sorted(runs) == tuned  # nothing tuned the second time
    assert all(torch.equal(a, r) for a, r in zip(outs1, outs2))
    assert all(torch.equal(grads1[k], grads2[k]) for k in grads1)


def test_too_many_chunks_for_the_launch_grid_is_a_clear_error():
    """The fused layer checks the scan's chunk count against the launch grid before any work, as the scan does:
    packed one-token documents that make 65536 chunk slots at chunk 16 are refused with what to change."""
    from lm_kernels.ssd import launch as ln

    di, p, g, n, w, t = 16, 16, 1, 16, 4, 65536
    n_docs = ln.MAX_GRID_YZ + 1 - t // 16
    d = {k: v.float() for k, v in _inputs(1, t, di, p, g, n, w, adds=False, states=False, seed=0).items()}
    cu = torch.arange(n_docs + 1, dtype=torch.int32)
    cu[-1] = t
    with pytest.raises(ValueError, match=rf"^mamba2_inner: 1 x {t} tokens, {n_docs} documents at chunk_size 16 make "
                                         r"65536 chunks in one call.*larger chunk_size or fewer tokens per call"):
        _fused(d, (di, p, g, n, di, 16), cu, False)
