"""backend="fla" vs backend="triton" on the same inputs (GPU): forward (o, final state) and backward (grads of
q, k, v, beta, g, initial state), both measured against the float32 reference. Prints the errors (pytest -s)."""
import pytest
import torch

from lm_kernels.deltaproduct import chunk_deltaproduct
from lm_kernels.deltaproduct.fla_backend import hopper_backward_blocked

pytestmark = pytest.mark.gpu
pytest.importorskip("fla", reason="flash-linear-attention is not installed (pip install 'lm[fla]')")


def _inputs(B, T, H, K, V, nh, gated, varlen, seed=0):
    g_ = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16

    def rn(*s):
        return torch.randn(*s, device=dev, generator=g_)

    x = dict(q=rn(B, T, H, K).to(bf), k=rn(B, T * nh, H, K).to(bf), v=rn(B, T * nh, H, V).to(bf),
             beta=2 * torch.rand(B, T * nh, H, device=dev, generator=g_),  # float32 as the model passes it
             g=torch.nn.functional.logsigmoid(rn(B, T, H)) if gated else None)
    cu = None
    if varlen:
        cu = torch.tensor([0, T // 3, T // 3 + 5, T], device=dev, dtype=torch.int32)
    n = B if cu is None else len(cu) - 1
    x["initial_state"] = 0.1 * rn(n, H, K, V)
    return x, cu


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _run(backend, x, cu, nh, grad_out=None):
    leaves = {k: (v.detach().clone().requires_grad_(grad_out is not None) if v is not None else None)
              for k, v in x.items()}
    if backend == "reference":  # float32 reference on the same (bf16-rounded) values
        leaves_in = {k: (v.float() if v is not None else None) for k, v in leaves.items()}
    else:
        leaves_in = leaves
    o, s = chunk_deltaproduct(leaves_in["q"], leaves_in["k"], leaves_in["v"], leaves_in["beta"], leaves_in["g"],
                              num_householder=nh, initial_state=leaves_in["initial_state"], output_final_state=True,
                              use_qk_l2norm=True, cu_seqlens=cu, backend=backend)
    grads = {}
    if grad_out is not None:
        do, ds = grad_out
        ((o.float() * do).sum() + (s * ds).sum()).backward()
        grads = {k: v.grad for k, v in leaves.items() if v is not None}
    return o, s, grads


CASES = [(nh, gated, False) for nh in (1, 2, 3) for gated in (False, True)] + [(2, False, True), (2, True, True)]
IDS = [f"nh{n}-{'gated' if g else 'plain'}-{'varlen' if v else 'dense'}" for n, g, v in CASES]


@pytest.mark.parametrize("nh,gated,varlen", CASES, ids=IDS)
def test_fla_matches_triton_and_reference(nh, gated, varlen):
    # K, V as scripts/gpu_fla.sh's speed table: its process finds these kernels compiled in triton's disk cache
    B, T, H, K, V = (1 if varlen else 2), 200, 2, 128, 256
    x, cu = _inputs(B, T, H, K, V, nh, gated, varlen)
    ref_o, ref_s, _ = _run("reference", x, cu, nh)
    with torch.no_grad():
        fo, fs, _ = _run("fla", x, cu, nh)
        to, ts, _ = _run("triton", x, cu, nh)
    errs = {"o fla": _rel(fo, ref_o), "o triton": _rel(to, ref_o), "o fla-triton": _rel(fo, to),
            "S fla": _rel(fs, ref_s), "S triton": _rel(ts, ref_s)}
    print(f"\nnh={nh} gated={gated} varlen={varlen} forward rel. errors: "
          + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert fo.dtype == torch.bfloat16 and fs.dtype == torch.float32
    assert all(v < 2e-2 for v in errs.values()), errs

    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(fo.shape, device="cuda", generator=gen)
    ds = torch.randn(fs.shape, device="cuda", generator=gen)
    if gated and hopper_backward_blocked(x["q"].device):
        with pytest.raises(ValueError, match="use backend='triton'"):
            _run("fla", x, cu, nh, (do, ds))
        return
    _, _, rg = _run("reference", x, cu, nh, (do, ds))
    _, _, fg = _run("fla", x, cu, nh, (do, ds))
    _, _, tg = _run("triton", x, cu, nh, (do, ds))
    gerr = {f"d{k} fla/triton": f"{_rel(fg[k], rg[k]):.1e}/{_rel(tg[k], rg[k]):.1e}" for k in rg}
    print(f"nh={nh} gated={gated} varlen={varlen} backward rel. errors vs reference: {gerr}")
    for k in rg:
        assert _rel(fg[k], rg[k]) < 3e-2 and _rel(tg[k], rg[k]) < 3e-2, (k, gerr)


def test_fla_refuses_float32_with_the_way_on():
    x, _ = _inputs(1, 16, 2, 32, 32, 2, True, False)
    q = x["q"].float()
    with pytest.raises(ValueError, match="cast to bfloat16 or use backend='triton'"):
        chunk_deltaproduct(q, x["k"], x["v"], x["beta"], x["g"], num_householder=2, backend="fla")
