"""The Triton SSD scan and causal conv1d as custom operators (lm::ssd_scan_fwd/_bwd, lm::causal_conv1d_fwd/_bwd),
under the interpreter on CPU: eager and torch.compile'd calls give the float64 reference's outputs and gradients
(compiled equal to eager), torch.library.opcheck passes, and a Mamba2 block with both Triton backends compiles as
one graph (explicit, implicit with the injection, packed documents): a graph break at the conv or the scan split
each block into three graphs, with eager gradient adds and casts between them (issue #25)."""
import pytest
import torch

from lm_kernels.conv1d import causal_conv1d, causal_conv1d_reference
from lm_kernels.ssd import ssd_scan

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("fast_interpreter")

F64 = torch.float64
INF = float("inf")


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def ssd_inputs(b, t, h, p, g, n, *, D="h", z=True, bias=True, init=None):
    d = dict(x=torch.randn(b, t, h, p), dt=torch.randn(b, t, h) - 1.0, A=-(torch.rand(h) * 2 + 0.3),
             B=torch.randn(b, t, g, n), C=torch.randn(b, t, g, n))
    if D:
        d["D"] = torch.randn(h) if D == "h" else torch.randn(h, p)
    if z:
        d["z"] = torch.randn(b, t, h, p)
    if bias:
        d["dt_bias"] = torch.randn(h) * 0.5
    if init:
        d["initial_state"] = torch.randn(init, h, p, n)
    return d


def outputs_and_grads(fn, inputs, dtype, *args):
    """fn(**leaves, *args) -> (y, final or None); its outputs and the gradients of every input for fixed random
    cotangents (float64 drawn, so every dtype sees the same ones)."""
    leaves = {k: v.to(dtype).requires_grad_() for k, v in inputs.items()}
    outs = [o for o in fn(*args, **leaves) if o is not None]
    gen = torch.Generator().manual_seed(1)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=F64)).sum() for o in outs)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return [o.detach() for o in outs], dict(zip(leaves, grads))


def assert_close_rel(ours, ref, tol, what):
    err = ((ours.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    assert err < tol, f"{what}: relative error {err:.2e}"


def check_eager_compiled_reference(fn, ref_fn, inputs, *args):
    """The custom-op path eager vs the float64 reference (2e-5), and compiled (fullgraph: no break allowed) vs eager."""
    eager = outputs_and_grads(fn, inputs, torch.float32, *args)
    ref = outputs_and_grads(ref_fn, inputs, F64, *args)
    compiled = outputs_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), inputs, torch.float32, *args)
    assert len(eager[0]) == len(ref[0]) == len(compiled[0])
    for i, (o, r, c) in enumerate(zip(eager[0], ref[0], compiled[0])):
        assert o.shape == r.shape and o.dtype == c.dtype
        assert_close_rel(o, r, 2e-5, f"output {i}")
        torch.testing.assert_close(c, o, rtol=1e-6, atol=1e-6)
    assert eager[1].keys() == ref[1].keys()
    for k in ref[1]:
        assert_close_rel(eager[1][k], ref[1][k], 2e-5, f"grad {k}")
        torch.testing.assert_close(compiled[1][k], eager[1][k], rtol=1e-6, atol=1e-6)


def _ssd(backend, cu=None, **kw):
    def fn(cu_seqlens=cu, **inputs):
        return ssd_scan(**inputs, chunk_size=16, cu_seqlens=cu_seqlens, return_final_state=True, backend=backend, **kw)
    return fn


SSD_CASES = {
    # several chunks with a partial last one, 2 groups, D per head, gate, dt bias and clamp, initial state
    "fixed_state": (dict(b=2, t=37, h=4, p=8, g=2, n=16, init=2), None, dict(dt_limit=(0.01, 2.0))),
    # headdim / dstate not powers of two, D per (head, p), no gate / bias / state, dt limit (0, inf)
    "fixed_plain": (dict(b=1, t=30, h=2, p=12, g=1, n=10, D="hp", z=False, bias=False), None, {}),
    # packed documents (one empty, one inside a chunk), a state per document
    "packed_state": (dict(b=1, t=32, h=2, p=8, g=1, n=8, init=4), [5, 0, 19, 8], dict(dt_limit=(0.0, 3.0))),
}


@pytest.mark.parametrize("case", list(SSD_CASES))
def test_ssd_op_eager_and_compiled_match_reference(case):
    shape, lens, kw = SSD_CASES[case]
    cu = _cu(lens) if lens else None
    check_eager_compiled_reference(_ssd("triton", cu, **kw), _ssd("reference", cu, **kw), ssd_inputs(**shape))


def test_ssd_op_compiled_packed_recompile_dynamic():
    """Another number of documents recompiles with a dynamic cu_seqlens length (the fake's chunk count is symbolic)
    and gives the eager result; then no final state asked for (its output is empty, its gradient None)."""
    fn = _ssd("triton")
    cfn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for lens in ([10, 22], [3, 9, 20], [7, 7, 7, 11]):
        d = ssd_inputs(1, sum(lens), 2, 8, 1, 8, init=len(lens))
        eager = outputs_and_grads(fn, d, torch.float32, _cu(lens))
        comp = outputs_and_grads(cfn, d, torch.float32, _cu(lens))
        for a, b in zip(eager[0] + list(eager[1].values()), comp[0] + list(comp[1].values())):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)

    def no_final(**a):
        return ssd_scan(**a, chunk_size=16, backend="triton")
    d = ssd_inputs(2, 20, 2, 8, 1, 8)
    eager = outputs_and_grads(no_final, d, torch.float32)
    comp = outputs_and_grads(torch.compile(no_final, backend="aot_eager", fullgraph=True), d, torch.float32)
    assert eager[0][0].shape == (2, 20, 2, 8) and len(eager[0]) == 1
    for k in eager[1]:
        torch.testing.assert_close(comp[1][k], eager[1][k], rtol=1e-6, atol=1e-6)


def _conv(backend, width, cu=None, *, act="silu", split=None):
    """causal_conv1d of `x` — with `split`, of the view x[..., :split] (channels contiguous, time stride > C)."""
    def fn(x, weight, bias=None, conv_state=None):
        xs = x[..., :split] if split else x
        kw = {} if backend == "reference" else dict(backend=backend)
        f = causal_conv1d_reference if backend == "reference" else causal_conv1d
        return f(xs, weight[:, :width], bias, cu_seqlens=cu, conv_state=conv_state, activation=act, **kw)
    return fn


def conv_inputs(b, t, c, w, *, bias=True, state=True, extra=0):
    """x (b, t, c + extra); weight one column wider than w: _conv passes the strided view weight[:, :w] (the kernels
    read the weight through its strides)."""
    d = dict(x=torch.randn(b, t, c + extra), weight=torch.randn(c, w + 1) * 0.5)
    if bias:
        d["bias"] = torch.randn(c)
    if state:
        d["conv_state"] = torch.randn(b, c, w - 1)
    return d


@pytest.mark.parametrize("case", ["split_view_state", "packed_no_act", "packed_state_width2"])
def test_conv_op_eager_and_compiled_match_reference(case):
    if case == "split_view_state":  # x a split view of a wider projection (read through its strides)
        d, fn, ref = conv_inputs(2, 21, 24, 4, extra=8), _conv("triton", 4, split=24), _conv("reference", 4, split=24)
    elif case == "packed_no_act":  # packed documents, one shorter than the width; no bias, no state, no activation
        cu = _cu([2, 19, 9])
        d = conv_inputs(1, 30, 16, 4, bias=False, state=False)
        fn, ref = _conv("triton", 4, cu, act=None), _conv("reference", 4, cu, act=None)
    else:
        cu = _cu([12, 1, 7])
        d = conv_inputs(1, 20, 16, 2)
        fn, ref = _conv("triton", 2, cu), _conv("reference", 2, cu)
    check_eager_compiled_reference(fn, ref, d)


def test_opcheck():
    """torch.library.opcheck (schema, autograd registration, fakes, AOT dispatch with dynamic shapes) on each op.
    Packed SSD forward: not the AOT comparison, whose outputs include the chunk slots the table leaves unused
    (uninitialised; the backward never reads them)."""
    from torch.library import opcheck

    import lm_kernels.conv1d.triton_conv1d  # noqa: F401  (registers the ops)
    import lm_kernels.ssd.triton_ssd  # noqa: F401

    ops = torch.ops.lm
    no_aot = ("test_schema", "test_autograd_registration", "test_faketensor")
    for lens in (None, [5, 15]):
        cu = _cu(lens) if lens else None
        d = ssd_inputs(1, 20, 2, 8, 1, 8, init=len(lens) if lens else 1)
        leaves = {k: v.requires_grad_() for k, v in d.items()}
        args = (*(leaves[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_state")), cu, 16, True,
                0.0, INF, True, True, [])
        opcheck(ops.ssd_scan_fwd.default, args, **(dict(test_utils=no_aot) if lens else {}))
        plain = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        y, fin, dtcs, states, ypre, table = ops.ssd_scan_fwd(*plain)
        opcheck(ops.ssd_scan_bwd.default, (torch.randn_like(y), torch.randn_like(fin), *plain[:10], dtcs, states,
                                           ypre, table if lens else None, 16, True, 0.0, INF, []))
        c = conv_inputs(1, 20, 24, 4)
        opcheck(ops.causal_conv1d_fwd.default, (c["x"].requires_grad_(), c["weight"][:, :4].detach().requires_grad_(),
                                                c["bias"].requires_grad_(), c["conv_state"].requires_grad_(), cu, True))
        opcheck(ops.causal_conv1d_bwd.default, (torch.randn(1, 20, 24), torch.randn(1, 24, 3), c["x"].detach(),
                                                c["weight"][:, :4].detach(), c["bias"].detach(),
                                                c["conv_state"].detach(), cu, True, True))


@pytest.mark.parametrize("use", ["explicit", "implicit", "packed"])
def test_mamba2_block_compiles_as_one_graph(use, monkeypatch):
    """torch._dynamo.explain on a tiny Mamba2 block (pre-norm, mixer, residual) with the Triton conv, SSD and gated
    norm: one graph, no break, the inner path's one operator in it (lm_kernels.mamba2) with the norm folded into
    out_proj; and the block compiled (aot_eager: the fold is decided when the graph is traced) gives the eager output
    and gradients (the norm applied by the operator)."""
    import lm  # noqa: F401  (registration)
    from lm.models import LMMamba2Config
    from lm.models.mamba2 import Mamba2Mixer
    from lm.models.modeling import Block

    monkeypatch.setenv("LM_SSD_BACKEND", "triton")
    monkeypatch.setenv("LM_CONV1D_BACKEND", "triton")
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "triton")
    cfg = LMMamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, d_state=16, headdim=8, chunk_size=16)
    block = Block(cfg, 0, Mamba2Mixer)
    x = torch.randn(1, 24, 32, requires_grad=True)  # two chunks of 16, the second partial
    kw = {}
    if use == "implicit":
        kw["injection"] = torch.randn(1, 24, Mamba2Mixer.injection_dim(cfg), requires_grad=True)
    elif use == "packed":
        kw["cu_seqlens"] = _cu([5, 13, 6])  # the second document crosses the chunk boundary
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(x, **kw)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, [str(r.reason)[:300] for r in explained.break_reasons]
    assert explained.graph_count == 1
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "lm.mamba2_inner_fwd" in ops, sorted(ops)
    # one norm group: traced, the norm is folded into out_proj (the operator's last argument, fold)
    inner = [n for g in explained.graphs for n in g.graph.nodes if str(n.target) == "lm.mamba2_inner_fwd"]
    assert [n.args[-1] for n in inner] == [True], [n.args[-1] for n in inner]
    if use != "packed":
        return  # compiled: once, on the packed block (split views of the conv output into the scan)
    leaves = [x, *block.parameters()]

    def run(f):
        y = f(x, **kw)
        return y.detach(), torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), leaves)

    y_e, g_e = run(block)
    y_c, g_c = run(torch.compile(block, backend="aot_eager", fullgraph=True))
    torch._dynamo.reset()
    torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_model_checks_packed_offsets_once_before_compiled_blocks(monkeypatch, tmp_path):
    """The compiled blocks' kernels take cu_seqlens unread (a host read would break the graph), so the model checks
    the offsets once per forward, outside the blocks: offsets that do not end at the sequence length are refused with
    an error naming them, before any block runs."""
    from transformers import AutoModelForCausalLM

    import lm  # noqa: F401  (registration)
    from lm.models.presets import load_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(load_config("lm_mamba2-tiny"))
    for layer in m.model.layers:
        layer.compile(backend="eager")
    ids = torch.randint(1, m.config.vocab_size, (1, 40))
    assert torch.isfinite(m(ids, labels=ids, cu_seqlens=_cu([7, 23, 10])).loss)
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing from 0 to seq_len \(40\)"):
        m(ids, labels=ids, cu_seqlens=_cu([7, 23, 20]))
