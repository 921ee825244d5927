"""The one-kernel SSD decode step (lm_kernels/ssd/step.py, under TRITON_INTERPRET=1 on CPU) vs the PyTorch step
(ssd_step_reference), chained steps vs the scan, the in-place update of `out_state`, and Mamba2 generation through
the static decoder with the kernel."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import lm  # noqa: F401
import lm.models.mamba2 as mamba2
from lm.models import decode as Dec
from lm.models.presets import load_config
from lm_kernels.ssd import ssd_scan, ssd_step, ssd_step_reference

triton = pytest.importorskip("triton")

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("fast_interpreter")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make(b, h, p, g, n, *, D="h", z=False, bias=True):
    d = dict(state=torch.randn(b, h, p, n, dtype=F64) * 0.5, x=torch.randn(b, h, p, dtype=F64),
             dt=torch.randn(b, h, dtype=F64) - 1.0, A=-(torch.rand(h, dtype=F64) * 2 + 0.3),
             B=torch.randn(b, g, n, dtype=F64), C=torch.randn(b, g, n, dtype=F64))
    kw = {}
    if D == "h":
        kw["D"] = torch.randn(h, dtype=F64)
    elif D == "hp":
        kw["D"] = torch.randn(h, p, dtype=F64)
    if z:
        kw["z"] = torch.randn(b, h, p, dtype=F64)
    if bias:
        kw["dt_bias"] = torch.randn(h, dtype=F64) * 0.5
    return d, kw


def cast(d, dtype):
    """Activations to `dtype`; the state and the parameters (A, D, dt_bias) float32, as the models hold them."""
    return {k: v.float() if k in ("state", "A", "D", "dt_bias") else v.to(dtype) for k, v in d.items()}


CASES = {  # (b, h, p, g, n), D, z, dt_bias, dt_limit, softplus
    "plain": ((2, 4, 16, 1, 16), "h", False, True, (0.0, float("inf")), True),
    "groups-odd-sizes": ((2, 6, 10, 3, 12), "hp", True, True, (0.05, 0.8), True),
    "noD-nobias-nosoftplus": ((1, 4, 8, 2, 32), None, False, False, (0.0, float("inf")), False),
    "multi-pblock": ((1, 2, 40, 1, 128), "h", True, True, (0.0, 0.5), True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_step_matches_reference(case, dtype):
    shape, D, z, bias, limit, softplus = CASES[case]
    d, kw = make(*shape, D=D, z=z, bias=bias)
    if not softplus:
        d["dt"] = d["dt"].abs()
    y64, s64 = ssd_step_reference(**d, **kw, dt_limit=limit, dt_softplus=softplus)
    d32, kw32 = cast(d, dtype), {k: v.float() if k != "z" else v.to(dtype) for k, v in kw.items()}
    before = d32["state"].clone()
    y, s = ssd_step(**d32, **kw32, dt_limit=limit, dt_softplus=softplus, backend="triton")
    assert torch.equal(d32["state"], before)  # not modified without out_state
    assert y.dtype == dtype and s.dtype == torch.float32 and s.shape == before.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel(y, y64) < tol and rel(s, s64) < tol
    # the same inputs through the float32 PyTorch step: the kernel is what the CPU path computes
    yr, sr = ssd_step(**d32, **kw32, dt_limit=limit, dt_softplus=softplus, backend="reference")
    assert rel(y, yr) < (1e-6 if dtype == torch.float32 else 1e-2) and rel(s, sr) < 1e-6


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_step_from_a_log(backend):
    """a_log=True: A given as the mixer's A_log parameter (A = -exp(A_log), formed inside the kernel) equals the step
    given A itself, on both paths."""
    d, kw = make(2, 6, 10, 3, 12, D="hp", z=True)
    d32, kw32 = cast(d, torch.float32), {k: v.float() for k, v in kw.items()}
    y_ref, s_ref = ssd_step_reference(**d, **kw)
    A_log = torch.log(-d32["A"])
    y, s = ssd_step(d32["state"], d32["x"], d32["dt"], A_log, d32["B"], d32["C"], **kw32, a_log=True,
                    backend=backend)
    assert rel(y, y_ref) < 1e-5 and rel(s, s_ref) < 1e-5


def test_chained_steps_in_place_equal_scan():
    """Steps with out_state=state (the static cache's in-place update) over t tokens equal the scan's outputs and
    final state; strided views of one (b, t, channels) buffer as inputs, as the Mamba2 mixer passes them."""
    b, t, h, p, g, n = 2, 6, 4, 12, 2, 16
    xbc = torch.randn(b, t, h * p + 2 * g * n)
    xs, B, C = xbc.split([h * p, g * n, g * n], dim=-1)
    xs, B, C = xs.reshape(b, t, h, p), B.reshape(b, t, g, n), C.reshape(b, t, g, n)
    dt, A = torch.randn(b, t, h) - 1.0, -(torch.rand(h) * 2 + 0.3)
    kw = dict(D=torch.randn(h), dt_bias=torch.randn(h) * 0.5, dt_limit=(0.0, 1.5))
    s0 = torch.randn(b, h, p, n) * 0.5
    y_scan, s_scan = ssd_scan(xs, dt, A, B, C, chunk_size=4, initial_state=s0, return_final_state=True,
                              backend="reference", **kw)
    state = s0.clone()
    for i in range(t):
        y, s = ssd_step(state, xs[:, i], dt[:, i], A, B[:, i], C[:, i], out_state=state, backend="triton", **kw)
        assert s is state
        assert rel(y, y_scan[:, i]) < 1e-5
    assert rel(state, s_scan) < 1e-5


def test_reference_out_state_and_argument_checks():
    d, kw = make(2, 4, 8, 2, 16)
    d = cast(d, torch.float32)
    kw = {k: v.float() for k, v in kw.items()}
    y, s = ssd_step_reference(**d, **kw)
    state = d.pop("state")
    buf = state.clone()
    y2, s2 = ssd_step_reference(buf, **d, **kw, out_state=buf)
    assert s2 is buf and torch.equal(buf, s) and torch.equal(y2, y)
    with pytest.raises(ValueError, match="out_state"):
        ssd_step(state, **d, **kw, out_state=torch.zeros(2, 4, 8, 15), backend="triton")
    with pytest.raises(ValueError, match="float64"):
        ssd_step(state.double(), **d, **kw, backend="triton")
    with pytest.raises(ValueError, match="backward"):
        ssd_step(state.requires_grad_(), **d, **kw, backend="triton")
    y0, s0 = ssd_step(torch.zeros(0, 4, 8, 16), torch.zeros(0, 4, 8), torch.zeros(0, 4), d["A"],
                      torch.zeros(0, 2, 16), torch.zeros(0, 2, 16), backend="triton")
    assert y0.shape == (0, 4, 8) and s0.shape == (0, 4, 8, 16)


def test_mamba2_static_generation_with_the_kernel(monkeypatch):
    """Greedy generation through the static decoder with the Triton step (writing the cache's SSM buffers in place)
    gives the eager path's tokens (PyTorch step)."""
    torch.manual_seed(0)
    cfg = load_config("lm_mamba2-tiny", vocab_size=64, hidden_size=32, num_hidden_layers=2, d_state=16, headdim=8,
                      ngroups=2, chunk_size=8)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    prompt = torch.randint(1, 64, (2, 5))
    args = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        eager = model.generate(prompt, attention_mask=torch.ones_like(prompt), decode="eager", **args)
    calls = []

    def step(*a, **k):
        calls.append(k["out_state"])
        return ssd_step(*a, **k, backend="triton")

    monkeypatch.setattr(mamba2, "ssd_step", step)
    with torch.no_grad():
        static = model.generate(prompt, attention_mask=torch.ones_like(prompt), decode="static", **args)
    Dec.release_decoders(model)
    assert torch.equal(static, eager)
    assert len(calls) == 2 * (args["max_new_tokens"] - 1) and all(c is not None for c in calls)
