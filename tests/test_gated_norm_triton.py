"""The gated RMSNorm's custom operators (lm::gated_rms_norm_fwd / _bwd, lm_kernels/rmsnorm, under TRITON_INTERPRET=1
on CPU) against the PyTorch formula (lm.models.layers._RMSNormFn on z + z_add): y and the gradients of x, z, z_add
and the weight, at shapes whose rows cross the interpreter's 3-row backward chunks inside a loop step, two groups per
row, widths that are not powers of two; strided inputs; what the forward saves; torch.library.opcheck; rms_norm's
choice of path; a compiled GatedRMSNorm + Linear (one graph, the eager gradients). The Mamba2 block's one graph with
the norm's operator in it: tests/test_kernel_ops_compile.py."""
import pytest
import torch

import lm.models.layers as layers
from lm_kernels.rmsnorm import gated_rms_norm_triton

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("fast_interpreter")

import lm_kernels.rmsnorm.triton_rmsnorm as T  # noqa: E402  (registers the ops)
from lm_kernels.backend import interpreted  # noqa: E402

EPS = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make(shape, dtype, *, add=True, weight=True):
    """x, z (, z_add) with gradients, weight (float32, as the models keep it) or None, and dy; fresh draws."""
    d = shape[-1]
    x = (torch.randn(shape) * 2).to(dtype).requires_grad_()
    z = (torch.randn(shape) * 2).to(dtype).requires_grad_()
    za = torch.randn(shape).to(dtype).requires_grad_() if add else None
    w = (torch.rand(d) + 0.5).requires_grad_() if weight else None
    dy = torch.randn(shape).to(dtype)
    return x, z, za, w, dy


def leaves(x, z, za, w):
    return [t for t in (x, z, za, w) if t is not None]


def reference(x, z, za, w, dy, group):
    y = layers._RMSNormFn.apply(x, z + za if za is not None else z, w, group, EPS)
    return [y, *torch.autograd.grad(y, leaves(x, z, za, w), dy)]


def ours(x, z, za, w, dy, group):
    y = gated_rms_norm_triton(x, z, w, EPS, group_size=group, z_add=za)
    return [y, *torch.autograd.grad(y, leaves(x, z, za, w), dy)]


SHAPES = [((2, 7, 48), 48),   # 14 rows: 5 chunks of 3, the last one short; 48 channels (block 64, 2 rows a step)
          ((3, 5, 80), 40),   # two groups of 40 per row
          ((11, 64), 16)]     # four groups of 16 (8 rows a step, more than a chunk)
VARIANTS = {"add-weight": dict(add=True, weight=True), "weight": dict(add=False, weight=True),
            "add-noweight": dict(add=True, weight=False)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape,group", SHAPES, ids=[f"{'x'.join(map(str, s))}-g{g}" for s, g in SHAPES])
def test_op_matches_formula(shape, group, variant, dtype):
    """y, dx, dz, dz_add, dweight of the op against _RMSNormFn on z + z_add via autograd. bf16: the interpreter's
    casts to bfloat16 truncate (the GPU's round to nearest), which roughly doubles the rounding error of y, dx, dz and
    of the sum z + z_add; checked against the float64 formula as well."""
    inputs = make(shape, dtype, **VARIANTS[variant])
    got, ref = ours(*inputs, group), reference(*inputs, group)
    names = ["y", "dx", "dz"] + (["dz_add"] if inputs[2] is not None else []) + (["dw"] if inputs[3] is not None
                                                                                   else [])
    assert len(got) == len(ref) == len(names)
    for name, a, r in zip(names, got, ref):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        tol = 2e-6 if dtype == torch.float32 else 1.5e-2
        assert rel(a, r) < tol, f"{name}: {rel(a, r):.2e}"
    if inputs[2] is not None:  # one tensor for d(z + z_add), as autograd's add hands it to both
        assert torch.equal(got[2], got[3])
    if dtype == torch.bfloat16:
        x, z, za, w, dy = inputs
        exact = reference(*[t.detach().double().requires_grad_() if t is not None else None for t in (x, z, za, w)],
                          dy.double(), group)
        for name, a, r, e in zip(names, got, ref, exact):
            assert rel(a, e) < 3 * rel(r, e) + 1e-3, f"{name}: {rel(a, e):.2e} vs the formula's {rel(r, e):.2e}"


def test_single_row_and_half_precision():
    """One row of one group (one program, one partial) and float16."""
    for shape, dtype in (((1, 1, 96), torch.float32), ((4, 3, 24), torch.float16)):
        inputs = make(shape, dtype)
        for a, r in zip(ours(*inputs, None), reference(*inputs, shape[-1])):
            assert rel(a, r) < (2e-6 if dtype == torch.float32 else 2e-3)


def test_strided_inputs_and_saved_tensors():
    """x, z, z_add as split views of wider projections (row stride != width) and a dy with non-unit channel stride;
    the forward saves x, z, z_add and the weight themselves and one float32 rstd per (row, group), nothing else."""
    proj = torch.randn(3, 5, 2 * 40 + 7, requires_grad=True)
    x, z = proj[..., :40], proj[..., 40:80]
    inj = torch.randn(3, 5, 40 + 3, requires_grad=True)
    za = inj[..., 3:]
    w = (torch.rand(40) + 0.5).requires_grad_()
    dy = torch.randn(40, 3, 5).permute(1, 2, 0)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = gated_rms_norm_triton(x, z, w, EPS, group_size=20, z_add=za)
    assert [t.data_ptr() for t in saved[:4]] == [x.data_ptr(), z.data_ptr(), za.data_ptr(), w.data_ptr()]
    assert len(saved) == 5 and saved[4].shape == (3, 5, 2) and saved[4].dtype == torch.float32
    got = torch.autograd.grad(y, [proj, inj, w], dy)
    yr = layers._RMSNormFn.apply(x, z + za, w, 20, EPS)
    ref = torch.autograd.grad(yr, [proj, inj, w], dy)
    assert rel(y, yr) < 2e-6 and all(rel(a, r) < 2e-6 for a, r in zip(got, ref))


def test_no_gradient_and_empty():
    """Without autograd the op returns y alone (nothing saved); zero rows: empty outputs, a zero weight gradient."""
    x, z, za, w, dy = make((2, 3, 16), torch.float32)
    with torch.no_grad():
        y = gated_rms_norm_triton(x, z, w, EPS, z_add=za)
    assert not y.requires_grad and rel(y, layers._RMSNormFn.apply(x, z + za, w, 16, EPS)) < 2e-6
    x, z, za, w, dy = make((0, 16), torch.float32)
    y = gated_rms_norm_triton(x, z, w, EPS, z_add=za)
    gx, gz, gza, gw = torch.autograd.grad(y, [x, z, za, w], dy)
    assert y.shape == (0, 16) and gx.shape == (0, 16) and torch.equal(gw, torch.zeros(16))


@pytest.mark.skipif(not interpreted(), reason="the bounds checker instruments the Triton interpreter (CPU)")
def test_forward_and_backward_in_bounds():
    """Every load and store of both kernels stays inside its tensors (tests/bounds_check.py): split views of a
    projection, a row count that leaves the last chunk short, a group narrower than its block."""
    from bounds_check import bounds_checked

    proj = torch.randn(7, 2 * 36 + 5, requires_grad=True)
    za = torch.randn(7, 36, requires_grad=True)
    w = torch.randn(36, requires_grad=True)
    with bounds_checked():
        y = gated_rms_norm_triton(proj[:, :36], proj[:, 36:72], w, EPS, group_size=12, z_add=za)
        torch.autograd.grad(y, [proj, za, w], torch.randn(7, 36))


def test_argument_errors():
    x, z = torch.randn(2, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match="z_add must come with z"):
        gated_rms_norm_triton(x, z, None, EPS, z_add=torch.randn(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        gated_rms_norm_triton(x, z, None, EPS, group_size=3)
    with pytest.raises(ValueError, match="z_add must come with z"):
        layers.rms_norm(x, None, EPS, z_add=z)


def test_opcheck():
    """torch.library.opcheck (schema, autograd registration, fakes, AOT dispatch) on both ops."""
    from torch.library import opcheck

    ops = torch.ops.lm
    for add, weight in ((True, True), (False, False)):
        x, z, za, w, dy = make((2, 5, 24), torch.float32, add=add, weight=weight)
        opcheck(ops.gated_rms_norm_fwd.default, (x, z, za, w, 12, EPS))
        plain = [t.detach() if t is not None else None for t in (x, z, za, w)]
        _, rstd = ops.gated_rms_norm_fwd(*plain, 12, EPS)
        opcheck(ops.gated_rms_norm_bwd.default, (dy, *plain, rstd, 12))


def test_rms_norm_dispatch(monkeypatch):
    """rms_norm takes the ops for a gated norm on the triton backend (with or without autograd), the PyTorch formula
    on z + z_add otherwise (backend reference, float64, plain norms); GatedRMSNorm passes z_add through."""
    calls = []
    real = layers.gated_rms_norm_triton
    monkeypatch.setattr(layers, "gated_rms_norm_triton", lambda *a, **k: calls.append(k) or real(*a, **k))
    norm = layers.GatedRMSNorm(32, 16)
    x, z, za, _, _ = make((2, 3, 32), torch.float32)
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "reference")
    y_ref = norm(x, z, za)
    assert not calls and torch.allclose(y_ref, norm(x, z + za))
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "triton")
    y = norm(x, z, za)
    with torch.no_grad():
        y_ng = norm(x, z, za)
    assert len(calls) == 2 and calls[0]["z_add"] is za and y.requires_grad
    assert rel(y, y_ref) < 2e-6 and torch.equal(y_ng, y.detach())
    calls.clear()
    norm.double()(x.double(), z.double(), za.double())  # float64: the formula
    layers.rms_norm(x, norm.weight.float(), EPS)  # plain: the formula
    assert not calls


class _Tiny(torch.nn.Module):
    """Linear -> GatedRMSNorm (gate z, injection part z_add) -> Linear."""

    def __init__(self, d):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.norm = layers.GatedRMSNorm(d, d // 2)
        self.out = torch.nn.Linear(d, d)

    def forward(self, h, z, z_add):
        return self.out(self.norm(self.inp(h), z, z_add))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_gated_norm_gives_eager_gradients(backend, monkeypatch, tmp_path):
    """torch.compile(fullgraph=True) of Linear + GatedRMSNorm + Linear with the Triton norm: one graph, the forward and
    backward ops run in it, and the eager gradients (of the input, z, z_add and every parameter; inductor: its own
    kernels for the linears' backward sum in another order)."""
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "triton")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    launches = []
    for name in ("_fwd_launch", "gated_rms_norm_bwd_launch"):
        real = getattr(T, name)
        monkeypatch.setattr(T, name, lambda *a, _r=real, _n=name, **k: launches.append(_n) or _r(*a, **k))
    d = 40
    model = _Tiny(d)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    h, z, za = (torch.randn(2, 9, d, requires_grad=True) for _ in range(3))
    ins = [h, z, za, *model.parameters()]

    def run(f):
        y = f(h, z, za)
        return y.detach(), torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(), ins)

    y_e, g_e = run(model)
    assert launches == ["_fwd_launch", "gated_rms_norm_bwd_launch"]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(h, z, za)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    launches.clear()
    y_c, g_c = run(torch.compile(model, backend=backend, fullgraph=True))
    torch._dynamo.reset()
    assert "_fwd_launch" in launches and "gated_rms_norm_bwd_launch" in launches
    tol = 1e-6 if backend == "aot_eager" else 1e-5
    torch.testing.assert_close(y_c, y_e, rtol=tol, atol=tol)
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "reference")
    y_r, g_r = run(model)
    torch.testing.assert_close(y_r, y_e, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_r, g_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
