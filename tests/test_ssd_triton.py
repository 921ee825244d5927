"""SSD Triton kernels (run under TRITON_INTERPRET=1 on CPU) vs the float64 PyTorch reference."""
import pytest
import torch

from lm_kernels.ssd import ssd_scan

triton = pytest.importorskip("triton")

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("fast_interpreter")


def make(b, t, h, p, g, n, *, D="h", z=True, bias=True, init=True, ns=None):
    d = dict(x=torch.randn(b, t, h, p), dt=torch.randn(b, t, h) - 1.0, A=-(torch.rand(h) * 2 + 0.3),
             B=torch.randn(b, t, g, n), C=torch.randn(b, t, g, n))
    if D == "h":
        d["D"] = torch.randn(h)
    elif D == "hp":
        d["D"] = torch.randn(h, p)
    if z:
        d["z"] = torch.randn(b, t, h, p)
    if bias:
        d["dt_bias"] = torch.randn(h) * 0.5
    if init:
        d["initial_state"] = torch.randn(b if ns is None else ns, h, p, n)
    return d


def run(backend, d, dtype, grad=True, **kw):
    """Forward (+ backward with fixed random cotangents); A stays float32 like a real parameter."""
    dd = {k: v.to(dtype if (k != "A" or dtype == F64) else torch.float32).detach().requires_grad_(grad)
          for k, v in d.items()}
    y, f = ssd_scan(**dd, return_final_state=True, backend=backend, **kw)
    if not grad:
        return y, f, {}
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(y.dtype)
    gf = torch.randn(f.shape, generator=torch.Generator().manual_seed(2), dtype=F64).to(f.dtype)
    ((y * gy).float().sum() + (f * gf).sum()).backward()
    return y, f, {k: v.grad for k, v in dd.items()}


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def compare(d, dtype, tol, **kw):
    yt, ft, gt = run("triton", d, dtype, **kw)
    yr, fr, gr = run("reference", d, F64, **kw)
    assert yt.dtype == dtype and ft.dtype == torch.float32
    assert rel(yt, yr) < tol, f"y {rel(yt, yr)}"
    assert rel(ft, fr) < tol, f"final_state {rel(ft, fr)}"
    for k in gr:
        assert gt[k] is not None and gt[k].shape == gr[k].shape, k
        assert torch.isfinite(gt[k]).all(), k
        assert rel(gt[k], gr[k]) < tol, f"grad {k}: {rel(gt[k], gr[k])}"


def test_triton_fp32_all_options_matches_reference():
    # T=45 is not a multiple of the chunk; 2 groups of 2 heads; initial and final states; dt clamp
    compare(make(2, 45, 4, 16, 2, 16), torch.float32, 2e-5, chunk_size=16, dt_limit=(0.05, 2.0))


def test_triton_fp32_odd_sizes_D_hp_no_gate_no_softplus():
    d = make(1, 40, 2, 12, 1, 10, D="hp", z=False, bias=False, init=False)
    d["dt"] = torch.rand(1, 40, 2) * 0.5 + 0.05
    compare(d, torch.float32, 2e-5, chunk_size=16, dt_softplus=False)


def test_triton_square_scan_tiles(monkeypatch):
    """Square 16-row scan tiles (BM = BK, the GPU's 64 x 64 case), so the diagonal block is one tile and x_m
    comes from it; 32-row chunks (two row blocks: one tile below the diagonal) and a partial last chunk."""
    import lm_kernels.ssd.launch as ln
    if not torch.cuda.is_available():
        monkeypatch.setattr(ln.tuners().scan_fwd2, "configs", [triton.Config(dict(BM=16, BK=16, BP=16), num_warps=4)])
    compare(make(1, 90, 2, 16, 1, 48), torch.float32, 2e-5, chunk_size=32, dt_limit=(0.0, 3.0))


def test_triton_state_kernels_multi_step_chunks(monkeypatch):
    """Chunks longer than the state kernels' step (there: > 256 rows) walk each chunk in several steps."""
    import lm_kernels.ssd.launch as ln
    monkeypatch.setattr(ln, "STATE_STEP_ROWS", 16)
    monkeypatch.setattr(ln, "_PLANS", {})
    compare(make(1, 50, 2, 16, 1, 16), torch.float32, 2e-5, chunk_size=32)


@pytest.mark.parametrize("heads,groups", [(3, 1), (4, 2)])
def test_triton_odd_sizes_varlen(heads, groups):
    """Odd head counts per group, headdim and dstate not powers of two, D per (head, p), packed documents
    with chunks cut short (default kernels)."""
    lens = [9, 0, 30, 1, 20]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    d = make(1, sum(lens), heads, 12, groups, 10, D="hp", ns=len(lens))
    compare(d, torch.float32, 2e-5, chunk_size=16, cu_seqlens=cu, dt_limit=(0.0, 3.0))


def test_triton_varlen_block_sizes_follow_dstate_not_chunk_count():
    """Packed documents at a dstate (64) whose block sizes differ from those of the chunk-slot count (NCB = 8 here):
    the plan's packed-table set-up must not touch the dstate it sizes the n blocks from."""
    lens = [50, 0, 70, 1, 36]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    compare(make(1, sum(lens), 2, 16, 1, 64, ns=len(lens)), torch.float32, 2e-5, chunk_size=32, cu_seqlens=cu)


def rounded(d, dtype):
    """The inputs rounded to `dtype` (kept float32), so that the float64 reference sees what the kernels see."""
    return {k: v.to(dtype).float() for k, v in d.items()}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 5e-3)])
def test_triton_several_tiles_fixed_and_packed(dtype, tol, monkeypatch):
    """16-row tiles in 64-row chunks (4 row blocks): float32 runs the row-block scan (chunk_scan_fwd2, decay on
    the x rows below the diagonal), float16 the whole-chunk scan (chunk_scan_fwd4); the backward's intra-chunk
    d(dt*A) from the row sums of the share tiles in per-row-block slots and their column sums (dx_bwd, combined by
    dt_bwd) with the decay below the diagonal factorised; fixed-length with a partial chunk and packed documents
    (chunks cut short, so some row blocks and slots do not exist)."""
    import lm_kernels.ssd.launch as ln
    monkeypatch.setattr(ln, "TILE_ROWS", 16)
    monkeypatch.setattr(ln, "_PLANS", {})
    compare(rounded(make(1, 100, 4, 16, 1, 16), dtype), dtype, tol, chunk_size=64, dt_limit=(0.0, 3.0))
    lens = [9, 0, 70, 1, 36]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    compare(rounded(make(1, sum(lens), 4, 16, 2, 16, ns=len(lens)), dtype), dtype, tol, chunk_size=64,
            cu_seqlens=cu)


def test_triton_dbdc_two_n_blocks_dcs_partial_sums():
    """dstate > 128 (N = 160): dbdc_bwd runs two 128-wide n blocks per row block, each writing its part of
    dC / dB and its partial dcs sums to its own slot, summed by dt_bwd."""
    compare(make(1, 40, 2, 16, 1, 160), torch.float32, 2e-5, chunk_size=16)


class _Launches:
    """Counts the launches of an autotuned kernel (kernel[grid](...)) and passes them on."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


def test_triton_whole_chunk_scan_every_partial_chunk_and_fallback(monkeypatch):
    """The whole-chunk scan (chunk_scan_fwd4: four row blocks per program; 16-bit inputs) on packed documents
    whose chunks end in each of the four row blocks (returns after block 0, 1, 2, 3), full chunks and an empty
    document, with D per head, the gate and initial / final states; a chunk of other than four row blocks and
    float32 inputs run chunk_scan_fwd2; bf16 forward and backward (the pre-gate output stored for dz)."""
    import lm_kernels.ssd.launch as ln
    monkeypatch.setattr(ln, "TILE_ROWS", 16)
    monkeypatch.setattr(ln, "_PLANS", {})
    counter = _Launches(ln.tuners().scan_fwd4)
    monkeypatch.setattr(ln.tuners(), "scan_fwd4", counter)
    lens = [10, 20, 0, 40, 60, 64, 130]  # chunk 64 = 4 blocks of 16: last chunks of 10, 20, 40, 60, 64, 2 rows
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    d = rounded(make(1, sum(lens), 2, 16, 1, 16, ns=len(lens)), torch.float16)
    y, f, _ = run("triton", d, torch.float16, grad=False, chunk_size=64, cu_seqlens=cu)
    yr, fr, _ = run("reference", d, F64, grad=False, chunk_size=64, cu_seqlens=cu)
    assert counter.n == 1
    assert rel(y, yr) < 2e-3 and rel(f, fr) < 2e-3, (rel(y, yr), rel(f, fr))
    y, f, _ = run("triton", d, torch.float16, grad=False, chunk_size=32, cu_seqlens=cu)  # 2 row blocks: fwd4 too
    yr, fr, _ = run("reference", d, F64, grad=False, chunk_size=32, cu_seqlens=cu)
    assert counter.n == 2
    assert rel(y, yr) < 2e-3 and rel(f, fr) < 2e-3, (rel(y, yr), rel(f, fr))
    y, f, _ = run("triton", d, torch.float16, grad=False, chunk_size=16, cu_seqlens=cu)  # 1 row block: fwd2
    yr, fr, _ = run("reference", d, F64, grad=False, chunk_size=16, cu_seqlens=cu)
    assert counter.n == 2
    assert rel(y, yr) < 2e-3 and rel(f, fr) < 2e-3, (rel(y, yr), rel(f, fr))
    compare(make(1, 80, 2, 16, 1, 16), torch.bfloat16, 3e-2, chunk_size=64)
    assert counter.n == 3
    compare(make(1, 80, 2, 16, 1, 16), torch.bfloat16, 3e-2, chunk_size=32)  # forward and backward, 2 row blocks
    assert counter.n == 4
    compare(make(1, 80, 2, 16, 1, 16), torch.float32, 2e-5, chunk_size=64)  # float32: fwd2
    assert counter.n == 4


def test_triton_varlen_matches_reference_and_separate_runs():
    lens = [9, 0, 30, 1, 20]  # an empty document, documents across chunk boundaries
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    d = make(1, sum(lens), 2, 16, 1, 16, ns=len(lens))
    compare(d, torch.float32, 2e-5, chunk_size=16, cu_seqlens=cu)
    with torch.no_grad():
        y, f = ssd_scan(**d, chunk_size=16, cu_seqlens=cu, return_final_state=True, backend="triton")
        for s, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if e == a:
                assert torch.allclose(f[s], d["initial_state"][s])
                continue
            one = {k: (v[:, a:e] if k in ("x", "dt", "B", "C", "z") else v) for k, v in d.items()}
            one["initial_state"] = d["initial_state"][s:s + 1]
            ys, fs = ssd_scan(**one, chunk_size=16, return_final_state=True, backend="triton")
            assert rel(y[:, a:e], ys.double()) < 1e-5 and rel(f[s:s + 1], fs.double()) < 1e-5


def test_triton_bf16_forward_backward():
    d = make(1, 48, 2, 16, 1, 16)
    compare(d, torch.bfloat16, 3e-2, chunk_size=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_low_precision_several_tiles(dtype, monkeypatch):
    """bf16 (chunk states kept in bf16) and fp16 (float32 states) with 16-row tiles in 32-row chunks."""
    import lm_kernels.ssd.launch as ln
    monkeypatch.setattr(ln, "TILE_ROWS", 16)
    monkeypatch.setattr(ln, "_PLANS", {})
    compare(make(1, 48, 2, 16, 1, 16), dtype, 3e-2, chunk_size=32)


def test_triton_no_grad_path_matches_and_builds_no_graph():
    d = make(1, 33, 2, 16, 1, 16)
    dd = {k: v.clone().requires_grad_() for k, v in d.items()}
    with torch.no_grad():
        y0, f0 = ssd_scan(**dd, chunk_size=16, return_final_state=True, backend="triton")
    assert y0.grad_fn is None and f0.grad_fn is None
    y1, f1 = ssd_scan(**dd, chunk_size=16, return_final_state=True, backend="triton")
    assert y1.grad_fn is not None
    assert torch.equal(y0, y1.detach()) and torch.equal(f0, f1.detach())
    y2, f2 = ssd_scan(**d, chunk_size=16, backend="triton")  # nothing requires grad
    assert f2 is None and y2.grad_fn is None and torch.equal(y2, y0)


def test_triton_strided_inputs():
    b, t, h, p, g, n = 1, 20, 2, 16, 1, 16
    xbc = torch.randn(b, t, h * p + 2 * g * n)  # like Mamba2's in_proj split: views, not copies
    x = xbc[..., :h * p].view(b, t, h, p)
    B = xbc[..., h * p:h * p + g * n].view(b, t, g, n)
    C = xbc[..., h * p + g * n:].view(b, t, g, n)
    dt, A = torch.randn(b, t, h), -torch.rand(h) - 0.5
    with torch.no_grad():
        y, _ = ssd_scan(x, dt, A, B, C, chunk_size=16, backend="triton")
        yr, _ = ssd_scan(x.double(), dt.double(), A.double(), B.double(), C.double(), chunk_size=16,
                         backend="reference")
    assert rel(y, yr) < 1e-5


def _xbc_pair(d, h, p, g, n):
    """x | B | C of `d` as one tensor, and the separate views of a copy of it (the gradient of the views reaches
    their base through autograd's concatenation)."""
    b, t = d["x"].shape[:2]
    return torch.cat([d["x"].reshape(b, t, h * p), d["B"].reshape(b, t, g * n), d["C"].reshape(b, t, g * n)], -1)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_ssd_scan_xbc_matches_separate_inputs(packed, dtype, tol, monkeypatch):
    """ssd_scan_xbc (x | B | C in one tensor, its gradient written by the backward kernels into one tensor) against
    ssd_scan on views of the same tensor, forward and backward: two row blocks per chunk, packed documents too, z /
    D / dt_bias / initial state on; and the reference backend's xbc path against the float64 reference."""
    import lm_kernels.ssd.launch as ln
    from lm_kernels.ssd import ssd_scan_xbc
    monkeypatch.setattr(ln, "TILE_ROWS", 16)
    monkeypatch.setattr(ln, "_PLANS", {})
    h, p, g, n = 4, 16, 2, 16
    lens = [20, 0, 41, 3] if packed else None
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32) if packed else None
    d = make(1 if packed else 2, sum(lens) if packed else 50, h, p, g, n, ns=len(lens) if packed else None)
    kw = dict(chunk_size=32, cu_seqlens=cu, return_final_state=True)
    rest = {k: v for k, v in d.items() if k not in ("x", "B", "C")}

    def grads(fn, base, backend):
        leaves = {k: v.to(dtype if k in ("dt", "z") else v.dtype).detach().requires_grad_() for k, v in rest.items()}
        xbc = base.to(dtype).detach().requires_grad_()
        y, f = fn(xbc, leaves, backend)
        gen = torch.Generator().manual_seed(3)
        gy = torch.randn(y.shape, generator=gen, dtype=F64).to(y.dtype)
        gf = torch.randn(f.shape, generator=gen, dtype=F64)
        ((y * gy).float().sum() + (f * gf).sum()).backward()
        return y, f, {"xbc": xbc.grad, **{k: v.grad for k, v in leaves.items()}}

    def fused(xbc, leaves, backend):
        return ssd_scan_xbc(xbc, leaves["dt"], leaves["A"], headdim=p, ngroups=g, dstate=n, backend=backend,
                            **{k: v for k, v in leaves.items() if k not in ("dt", "A")}, **kw)

    def views(xbc, leaves, backend):
        b, t = xbc.shape[:2]
        x, B, C = xbc.split([h * p, g * n, g * n], -1)
        return ssd_scan(x.reshape(b, t, h, p), leaves["dt"], leaves["A"], B.reshape(b, t, g, n),
                        C.reshape(b, t, g, n), backend=backend, **{k: v for k, v in leaves.items()
                                                                    if k not in ("dt", "A")}, **kw)

    base = _xbc_pair(d, h, p, g, n)
    y1, f1, g1 = grads(fused, base, "triton")
    y2, f2, g2 = grads(views, base, "triton")
    assert g1["xbc"].shape == base.shape and g1["xbc"].dtype == dtype
    assert torch.equal(y1, y2) and torch.equal(f1, f2)  # the same kernels on the same memory
    for k in g2:
        assert torch.equal(g1[k], g2[k]), k
    yr, fr, gr = grads(fused, base.double(), "reference")  # the reference backend's xbc path (float64 leaves)
    y3, f3, g3 = grads(views, base.double(), "reference")
    assert torch.equal(yr, y3)
    assert rel(y1, yr.detach()) < tol and rel(g1["xbc"], gr["xbc"]) < tol
    with pytest.raises(ValueError, match="x \\| B \\| C"):
        ssd_scan_xbc(base[..., 1:], d["dt"], d["A"], headdim=p, ngroups=g, dstate=n, backend="triton")
    with pytest.raises(ValueError, match="x \\| B \\| C"):
        ssd_scan_xbc(base[..., 1:], d["dt"], d["A"], headdim=p, ngroups=g, dstate=n, backend="reference")


def test_ssd_xbc_opcheck():
    """torch.library.opcheck (schema, fakes, autograd registration, AOT dispatch) on both ops with x | B | C."""
    from torch.library import opcheck

    import lm_kernels.ssd.triton_ssd  # noqa: F401 (registers the ops)
    h, p, g, n = 2, 16, 1, 16
    d = make(1, 20, h, p, g, n, z=False, init=False)
    xbc = _xbc_pair(d, h, p, g, n).requires_grad_()
    dt = d["dt"].requires_grad_()
    args = (xbc, dt, d["A"], None, None, d["D"], None, d["dt_bias"], None, None, 16, True, 0.0, float("inf"), False,
            True, [p, g, n])
    opcheck(torch.ops.lm.ssd_scan_fwd.default, args)
    out = torch.ops.lm.ssd_scan_fwd(*args)
    opcheck(torch.ops.lm.ssd_scan_bwd.default, (torch.randn(1, 20, h, p), None, xbc.detach(), dt.detach(), d["A"],
                                                None, None, d["D"], None, d["dt_bias"], None, None, *out[2:4], None,
                                                None, 16, True, 0.0, float("inf"), [p, g, n]))


def test_triton_rejects_bad_chunk_and_float64():
    d = make(1, 8, 2, 16, 1, 16, z=False, init=False)
    with pytest.raises(ValueError, match="power of two"):
        ssd_scan(**d, chunk_size=24, backend="triton")
    with pytest.raises(ValueError, match="float64"):
        ssd_scan(**{k: v.double() for k, v in d.items()}, chunk_size=16, backend="triton")


def _round_to_bf16(v):
    import numpy as np
    if v.dtype != np.float32:
        return v
    u = np.ascontiguousarray(v).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32).reshape(v.shape)


@pytest.mark.skipif(torch.cuda.is_available(), reason="emulates the GPU's bf16 products in the interpreter")
def test_triton_bf16_products_dA_accuracy(monkeypatch):
    """With the dot operands rounded to bf16 as on a GPU (the interpreter's own bf16 dot is wrong, so the
    kernels use float32 products there), dA and dt_bias stay accurate: they are sums over every token,
    and a formulation whose cancelling terms carry different roundings (row sums from one product, column sums
    from another, e.g. dx's bf16 one) loses them (seen on an H100: 4.6e-2 against mamba_ssm's 4.9e-3; 1.9e-1 for
    dA in this emulation). The kernels take the row and the column sums from the same float32 tile."""
    import numpy as np
    from triton.runtime import interpreter as interp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = np.matmul(_round_to_bf16(a.data), _round_to_bf16(b.data), dtype=d.data.dtype) + d.data
        return interp.TensorHandle(out, d.dtype.scalar)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", create_dot)
    d = dict(x=torch.randn(1, 1024, 2, 64), dt=torch.randn(1, 1024, 2) * 0.5, A=-torch.exp(torch.randn(2) * 0.5),
             B=torch.randn(1, 1024, 1, 64), C=torch.randn(1, 1024, 1, 64), D=torch.randn(2),
             dt_bias=torch.randn(2) * 0.5 - 2.0)
    gy = torch.randn(1, 1024, 2, 64, dtype=F64)

    def grads(backend, dtype):
        dd = {k: (v.to(dtype) if k in ("x", "dt", "B", "C") else (v.double() if dtype == F64 else v))
              .detach().requires_grad_() for k, v in d.items()}
        y, _ = ssd_scan(**dd, chunk_size=256, backend=backend)
        (y.double() * gy).sum().backward()
        return {k: v.grad for k, v in dd.items()}

    gt, gr = grads("triton", torch.bfloat16), grads("reference", F64)
    errs = {k: rel(gt[k], gr[k]) for k in gr}
    assert errs["A"] < 6e-2 and errs["dt_bias"] < 2e-2 and errs["dt"] < 2e-2, errs


def test_autotuned_kernels_with_atomics_reset_their_outputs():
    """Autotuning runs a kernel many times on the real buffers: whatever it accumulates with atomics
    must be listed in reset_to_zero, or the first call (the tuning call) returns sums of several runs."""
    import inspect
    import re

    from triton.runtime.autotuner import Autotuner

    import lm_kernels.ssd.launch as ln
    checked = 0
    for obj in vars(ln.tuners()).values():
        if not isinstance(obj, Autotuner):
            continue
        fn = obj.fn
        src = getattr(fn, "src", None) or inspect.getsource(getattr(fn, "fn", fn))
        targets = set(re.findall(r"tl\.atomic_\w+\((\w+)", src))
        assert targets <= set(obj.reset_to_zero or []), (fn, targets)
        checked += 1
    assert checked >= 5  # the autotuned kernels were found (none uses atomics)


def test_triton_launch_reuses_the_autotuned_config(autotuner_runs, monkeypatch):
    """launch: the first call per shape / dtypes goes through the autotuner, later ones launch the config it
    chose directly (same outputs, forward and backward); a swapped configs list is tuned again."""
    import lm_kernels.ssd.launch as ln
    runs = autotuner_runs
    d = make(1, 40, 2, 16, 1, 16)
    y1, f1, g1 = run("triton", d, torch.float32, chunk_size=16)
    assert sorted(runs) == sorted(["dtcb_fwd_kernel", "state_fwd_kernel", "chunk_scan_fwd2_kernel", "dstate_bwd_kernel",
                                   "dcb_bwd_kernel", "dx_bwd_kernel", "dbdc_bwd_kernel"]), runs
    y2, f2, g2 = run("triton", d, torch.float32, chunk_size=16)
    assert len(runs) == 7  # no autotuner call the second time
    assert torch.equal(y1, y2) and torch.equal(f1, f2) and all(torch.equal(g1[k], g2[k]) for k in g1)
    monkeypatch.setattr(ln.tuners().scan_fwd2, "configs", list(ln.tuners().scan_fwd2.configs))
    with torch.no_grad():
        y3, _ = ssd_scan(**d, chunk_size=16, backend="triton")
    assert runs[7:] == ["chunk_scan_fwd2_kernel"]  # the other two kernels' keys are known
    assert torch.equal(y1, y3)


def test_triton_too_many_chunks_for_the_launch_grid_is_a_clear_error():
    """More chunks in one call than a launch grid's third axis holds (65535) is refused before any launch, with what
    to change, for fixed-length batches and for packed documents (whose chunk slots count the documents too)."""
    from lm_kernels.ssd import launch as ln

    def args(b, t, h=1, p=16, g=1, n=16):
        return dict(x=torch.zeros(b, t, h, p), dt=torch.zeros(b, t, h), A=-torch.ones(h), B=torch.zeros(b, t, g, n),
                    C=torch.zeros(b, t, g, n))

    with pytest.raises(ValueError, match=r"65536 chunks in one call.*larger chunk_size or fewer tokens per call"):
        ssd_scan(**args(ln.MAX_GRID_YZ + 1, 16), chunk_size=16, backend="triton")
    t = 65536  # T // 16 = 4096 chunk slots plus one per document: 61439 one-token documents and a long last one
    n_docs = ln.MAX_GRID_YZ + 1 - t // 16
    cu = torch.arange(n_docs + 1, dtype=torch.int32)
    cu[-1] = t
    with pytest.raises(ValueError, match=rf"{n_docs} documents at chunk_size 16 make 65536 chunks"):
        ssd_scan(**args(1, t), chunk_size=16, cu_seqlens=cu, backend="triton")
