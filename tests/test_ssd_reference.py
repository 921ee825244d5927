"""SSD PyTorch chunked reference vs the per-timestep recurrence (float64), forward and every gradient."""
import pytest
import torch

from lm_kernels.backend import resolve_backend
from lm_kernels.ssd import ssd_scan, ssd_scan_naive, ssd_step

F64 = torch.float64


def make_inputs(b, t, h, p, g, n, *, D_shape="h", z=True, dt_bias=True, init=True, num_seqs=None, dtype=F64,
                requires_grad=True):
    ns = b if num_seqs is None else num_seqs
    inp = dict(
        x=torch.randn(b, t, h, p, dtype=dtype),
        dt=torch.randn(b, t, h, dtype=dtype) - 1.0,
        A=-(torch.rand(h, dtype=dtype) * 2 + 0.3),
        B=torch.randn(b, t, g, n, dtype=dtype),
        C=torch.randn(b, t, g, n, dtype=dtype),
    )
    kw = {}
    if D_shape == "h":
        kw["D"] = torch.randn(h, dtype=dtype)
    elif D_shape == "hp":
        kw["D"] = torch.randn(h, p, dtype=dtype)
    if z:
        kw["z"] = torch.randn(b, t, h, p, dtype=dtype)
    if dt_bias:
        kw["dt_bias"] = torch.randn(h, dtype=dtype) * 0.5
    if init:
        kw["initial_state"] = torch.randn(ns, h, p, n, dtype=dtype)
    for v in list(inp.values()) + list(kw.values()):
        v.requires_grad_(requires_grad)
    return inp, kw


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def outputs_and_grads(fn, inp, kw, **extra):
    y, fs = fn(**inp, **kw, return_final_state=True, **extra)
    gy = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    gs = torch.randn(fs.shape, dtype=fs.dtype, generator=torch.Generator().manual_seed(2))
    leaves = {k: v for k, v in {**inp, **kw}.items() if torch.is_tensor(v) and v.requires_grad}
    grads = torch.autograd.grad((y * gy).sum() + (fs * gs).sum(), list(leaves.values()), allow_unused=True)
    return y, fs, dict(zip(leaves, grads))


def assert_matches(inp, kw, tol=1e-10, **extra):
    ref = outputs_and_grads(lambda **a: ssd_scan(**a, backend="reference"), inp, kw, **extra)
    nai = outputs_and_grads(ssd_scan_naive, inp, kw, **extra)
    assert rel_err(ref[0], nai[0]) < tol, "y"
    assert rel_err(ref[1], nai[1]) < tol, "final_state"
    assert set(ref[2]) == set(nai[2])
    for k in nai[2]:
        assert nai[2][k] is not None, k
        assert rel_err(ref[2][k], nai[2][k]) < tol, f"grad {k}: {rel_err(ref[2][k], nai[2][k])}"
    return ref


@pytest.mark.parametrize("chunk", [8, 16])
def test_reference_matches_recurrence_all_options(chunk):
    inp, kw = make_inputs(2, 45, 4, 3, 2, 5)
    assert_matches(inp, kw, chunk_size=chunk, dt_limit=(0.05, 3.0))


def test_reference_matches_recurrence_groups_D_hp_no_init():
    inp, kw = make_inputs(1, 20, 6, 4, 3, 2, D_shape="hp", z=False, dt_bias=False, init=False)
    assert_matches(inp, kw, chunk_size=7)


def test_reference_matches_recurrence_no_softplus_single_chunk_and_short():
    inp, kw = make_inputs(2, 5, 2, 2, 1, 3, D_shape=None, z=False)
    inp["dt"] = (torch.rand(2, 5, 2, dtype=F64) + 0.1).requires_grad_()
    assert_matches(inp, kw, chunk_size=16, dt_softplus=False)


def test_packed_documents_equal_separate_runs():
    lens = [7, 0, 19, 1, 13]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    t = sum(lens)
    inp, kw = make_inputs(1, t, 4, 3, 2, 4, num_seqs=len(lens))
    ref = assert_matches(inp, kw, chunk_size=8, cu_seqlens=cu)
    # and each document run alone through the chunked reference (b=1, its own initial state)
    y, fs = ref[0], ref[1]
    for s in range(len(lens)):
        a, e = int(cu[s]), int(cu[s + 1])
        sub = {k: v[:, a:e] for k, v in inp.items() if k != "A"}
        sub["A"] = inp["A"]
        kws = {k: (v[:, a:e] if k == "z" else v) for k, v in kw.items()}
        kws["initial_state"] = kw["initial_state"][s:s + 1]
        ys, fss = ssd_scan(**sub, **kws, chunk_size=8, return_final_state=True, backend="reference")
        if e > a:
            assert rel_err(y[:, a:e], ys) < 1e-12
        assert rel_err(fs[s:s + 1], fss) < 1e-12
    # int64 offsets give the same
    y64, _ = ssd_scan(**inp, **kw, chunk_size=8, cu_seqlens=cu.long(), backend="reference")
    assert torch.equal(y64, y)


def test_step_chain_equals_scan():
    b, t, h, p, g, n = 2, 11, 4, 3, 2, 5
    inp, kw = make_inputs(b, t, h, p, g, n, requires_grad=False)
    y, fs = ssd_scan(**inp, **kw, chunk_size=4, return_final_state=True, dt_limit=(0.0, 2.0), backend="reference")
    state = kw["initial_state"].clone()
    before = state.clone()
    for i in range(t):
        yi, state_new = ssd_step(state, inp["x"][:, i], inp["dt"][:, i], inp["A"], inp["B"][:, i], inp["C"][:, i],
                                 D=kw["D"], z=kw["z"][:, i], dt_bias=kw["dt_bias"], dt_limit=(0.0, 2.0))
        assert rel_err(yi, y[:, i]) < 1e-12
        assert torch.equal(state, before)  # not modified in place
        state = before = state_new
    assert rel_err(state, fs) < 1e-12


def test_step_float32_state_dtype():
    state = torch.randn(2, 4, 3, 5)
    y, s = ssd_step(state, torch.randn(2, 4, 3, dtype=torch.bfloat16), torch.randn(2, 4), -torch.rand(4),
                    torch.randn(2, 1, 5), torch.randn(2, 1, 5))
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32 and s.shape == state.shape


def test_float32_reference_close_to_float64():
    inp, kw = make_inputs(2, 40, 4, 8, 1, 16, requires_grad=False)
    y64, f64 = ssd_scan(**inp, **kw, chunk_size=16, return_final_state=True, backend="reference")
    cast = lambda d: {k: v.float() for k, v in d.items()}  # noqa: E731
    y32, f32 = ssd_scan(**cast(inp), **cast(kw), chunk_size=16, return_final_state=True, backend="reference")
    assert y32.dtype == torch.float32 and f32.dtype == torch.float32
    assert rel_err(y32.double(), y64) < 1e-5 and rel_err(f32.double(), f64) < 1e-5


def test_returns_tuple_and_dtypes():
    inp, kw = make_inputs(1, 10, 2, 2, 1, 2, requires_grad=False, dtype=torch.float32)
    inp = {k: (v if k == "A" else v.bfloat16()) for k, v in inp.items()}
    y, fs = ssd_scan(**inp, chunk_size=4, backend="reference")
    assert y.dtype == torch.bfloat16 and y.shape == inp["x"].shape and fs is None
    _, fs = ssd_scan(**inp, chunk_size=4, return_final_state=True, backend="reference")
    assert fs.dtype == torch.float32 and fs.shape == (1, 2, 2, 2)


def test_bad_arguments_raise_valueerror():
    inp, kw = make_inputs(2, 10, 4, 2, 2, 3, requires_grad=False)
    with pytest.raises(ValueError, match="dt"):
        ssd_scan(**{**inp, "dt": inp["dt"][:, :5]}, backend="reference")
    with pytest.raises(ValueError, match="ngroups"):
        ssd_scan(**{**inp, "B": torch.randn(2, 10, 3, 3), "C": torch.randn(2, 10, 3, 3)}, backend="reference")
    with pytest.raises(ValueError, match="cu_seqlens"):
        ssd_scan(**inp, cu_seqlens=torch.tensor([0, 10], dtype=torch.int32), backend="reference")
    with pytest.raises(ValueError, match="initial_state"):
        ssd_scan(**inp, initial_state=torch.randn(3, 4, 2, 3), backend="reference")
    with pytest.raises(ValueError, match="backend"):
        ssd_scan(**inp, backend="cuda")


def test_backend_auto_and_env(monkeypatch):
    """ssd_scan's backend=None goes through lm_kernels.backend.resolve_backend with LM_SSD_BACKEND."""
    monkeypatch.delenv("LM_SSD_BACKEND", raising=False)
    assert resolve_backend("ssd", None, torch.device("cpu")) == "reference"  # CPU tensor
    inp = dict(x=torch.randn(1, 8, 2, 2), dt=torch.randn(1, 8, 2), A=-torch.rand(2), B=torch.randn(1, 8, 1, 3),
               C=torch.randn(1, 8, 1, 3))
    monkeypatch.setenv("LM_SSD_BACKEND", "reference")
    y, _ = ssd_scan(**inp, chunk_size=4)
    assert torch.equal(y, ssd_scan(**inp, chunk_size=4, backend="reference")[0])
    monkeypatch.setenv("LM_SSD_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LM_SSD_BACKEND"):
        ssd_scan(**inp, chunk_size=4)
