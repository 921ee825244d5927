"""Shape matrix of the other Triton ops against their float64 PyTorch references, on fresh random inputs: the causal
conv1d, the LRU block scan, the RMSNorms (plain no-grad, plain with autograd, gated), the rope decode step and the
cross-entropy rows; forward and backward (every input's gradient; the cross-entropy's gradient written over its
logits; the rope step has no backward) at T in {1, 2, chunk - 1, chunk, chunk + 1, 3 chunks + 5} (chunk 16 for
the LRU scan; for the others the same lengths cross the interpreter's row tiles and backward chunks), batch 1 and 3
(T = 1 at batch 3 for every op), contiguous inputs and non-contiguous views (time axes with twice the stride, column
windows of wider tensors, transposed weights, strided per-channel vectors and offsets), and packed documents with
length-1 ones where the op takes cu_seqlens. CUDA when available, else the Triton interpreter on CPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lm_kernels.conv1d import causal_conv1d  # noqa: E402
from lm_kernels.cross_entropy import ce_rows_, ce_rows_reference_  # noqa: E402
from lm_kernels.lru import block_scan, lru_lambda_blocks  # noqa: E402
from lm_kernels.rmsnorm import gated_rms_norm_triton, rms_norm_autograd_triton, rms_norm_triton  # noqa: E402
from lm_kernels.rope import rope_kv_step  # noqa: E402
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
    strided_vec,
    transposed,
    weights,
)

pytestmark = pytest.mark.usefixtures("fast_interpreter", "full_fp32")
# (batch, T, layout) for the ops with a time axis: every T of TS, both batch sizes, T = 1 at batch 3 both ways
CASES = [(3, 1, "contiguous"), (3, 1, "strided"), (1, 1, "strided"), (3, 2, "strided"), (1, 15, "contiguous"),
         (3, 16, "contiguous"), (1, 17, "strided"), (3, 53, "strided"), (1, 53, "contiguous")]
IDS = [f"b{b}-T{t}-{lay}" for b, t, lay in CASES]
PACKED_IDS = ["-".join(map(str, v)) for v in PACKED]
assert {t for _, t, _ in CASES} == set(TS)


# --- causal conv1d ---------------------------------------------------------------------------------------------------
C1, W1 = 36, 4  # channels cross the interpreter's 16-channel forward tiles and 32-channel backward blocks


def _conv_run(layout, cu):
    """x (+ x_add) with bias, conv state (its gradient and the new state's) and, packed, the offsets; strided: x and
    x_add time-strided column windows, the weight transposed, the bias and the offsets stride-2 views, the state with
    its channels strided."""
    def run(v, backend):
        lay = dict(v)
        cus = cu
        if backend == "triton" and layout == "strided":
            lay["x"], lay["x_add"] = strided(lay["x"]), strided(lay["x_add"])
            lay["weight"], lay["bias"] = transposed(lay["weight"]), strided_vec(lay["bias"])
            lay["conv_state"] = transposed(lay["conv_state"])
            cus = strided_vec(cu) if cu is not None else None
        return causal_conv1d(lay["x"], lay["weight"], lay["bias"], x_add=lay["x_add"], cu_seqlens=cus,
                             conv_state=lay["conv_state"], activation="silu", backend=backend)
    return run


def _conv_data(b, t):
    return dict(x=torch.randn(b, t, C1, dtype=F64), x_add=torch.randn(b, t, C1, dtype=F64) * 0.5,
                weight=torch.randn(C1, W1, dtype=F64) * 0.5, bias=torch.randn(C1, dtype=F64),
                conv_state=torch.randn(b, C1, W1 - 1, dtype=F64))


@pytest.mark.parametrize("b,t,layout", CASES, ids=IDS)
def test_conv1d(b, t, layout):
    compare(_conv_run(layout, None), _conv_data(b, t), weights((b, t, C1), (b, C1, W1 - 1)), 1e-5)


@pytest.mark.parametrize("lens", PACKED, ids=PACKED_IDS)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_conv1d_packed(lens, layout):
    t = sum(lens)
    compare(_conv_run(layout, cu_offsets(lens)), _conv_data(1, t), weights((1, t, C1), (1, C1, W1 - 1)), 1e-5)


# --- LRU block scan --------------------------------------------------------------------------------------------------
NB = 5


def _lru_run(layout, cu, kind):
    """h_t = A_t h_{t-1} + x_t: dense 3 x 3 blocks per step (strided: A with its block rows and columns swapped in
    memory, x a time-strided column window), or the LRU's 2 x 2 rotation blocks expanded over batch and time
    (stride 0, never copied); the initial state strided in the strided layout."""
    def run(v, backend):
        lay = dict(v)
        if kind == "dense":
            A = lay["A"]
            if backend == "triton" and layout == "strided":
                A = transposed(A)  # A's values, its (m, m) blocks stored column-major
        else:
            b, t = lay["x"].shape[:2]
            A = lru_lambda_blocks(lay["nu_log"], lay["theta_log"]).expand(b, t, -1, -1, -1)
        x, h0 = lay["x"], lay["h0"]
        if backend == "triton" and layout == "strided":
            x, h0 = strided(x), strided(h0)
        return block_scan(A, x, initial_state=h0, cu_seqlens=cu, chunk_size=CHUNK, return_final_state=True,
                          backend=backend)
    return run


def _lru_data(b, t, nseq, kind):
    m = 3 if kind == "dense" else 2
    d = dict(x=torch.randn(b, t, NB, m, dtype=F64), h0=torch.randn(nseq, NB, m, dtype=F64))
    if kind == "dense":
        d["A"] = torch.randn(b, t, NB, m, m, dtype=F64) * (0.6 / m ** 0.5)
    else:
        d["nu_log"] = torch.log(-torch.log(torch.rand(NB, dtype=F64) * 0.5 + 0.45))
        d["theta_log"] = torch.log(torch.rand(NB, dtype=F64) * 3.0 + 0.1)
    return d


@pytest.mark.parametrize("b,t,layout", CASES, ids=IDS)
@pytest.mark.parametrize("kind", ["dense", "lru"])
def test_lru_block_scan(b, t, layout, kind):
    d = _lru_data(b, t, b, kind)
    m = d["x"].shape[-1]
    compare(_lru_run(layout, None, kind), d, weights((b, t, NB, m), (b, NB, m)), 1e-5)


@pytest.mark.parametrize("lens", PACKED, ids=PACKED_IDS)
@pytest.mark.parametrize("kind", ["dense", "lru"])
def test_lru_block_scan_packed(lens, kind):
    t = sum(lens)
    d = _lru_data(1, t, len(lens), kind)
    m = d["x"].shape[-1]
    compare(_lru_run("strided", cu_offsets(lens), kind), d, weights((1, t, NB, m), (len(lens), NB, m)), 1e-5)


# --- RMSNorms --------------------------------------------------------------------------------------------------------
D_N, GROUP = 24, 12
EPS = 1e-5


def _norm(u, weight, group, eps=EPS):
    """The RMSNorm formula in u's dtype, per group of `group` channels, times the weight (or not)."""
    ug = u.unflatten(-1, (-1, group))
    out = (ug * torch.rsqrt(ug.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return out * weight if weight is not None else out


def _view(v, layout):
    return strided(v) if layout == "strided" else v


@pytest.mark.parametrize("b,t,layout", CASES, ids=IDS)
def test_gated_rms_norm(b, t, layout):
    """u = x * silu(z + z_add), normed per group of 12, times the weight: x, z, z_add time-strided column windows
    and the weight a stride-2 view in the strided layout."""
    def run(v, backend):
        if backend == "reference":
            return [_norm(v["x"] * torch.nn.functional.silu(v["z"] + v["z_add"]), v["w"], GROUP)]
        return [gated_rms_norm_triton(_view(v["x"], layout), _view(v["z"], layout),
                                      strided_vec(v["w"]) if layout == "strided" else v["w"], EPS, group_size=GROUP,
                                      z_add=_view(v["z_add"], layout))]
    d = dict(x=torch.randn(b, t, D_N, dtype=F64) * 2, z=torch.randn(b, t, D_N, dtype=F64) * 2,
             z_add=torch.randn(b, t, D_N, dtype=F64), w=torch.rand(D_N, dtype=F64) + 0.5)
    compare(run, d, weights((b, t, D_N)), 1e-5, transpose_first=layout == "strided")


@pytest.mark.parametrize("b,t,layout", CASES, ids=IDS)
def test_rms_norm_autograd(b, t, layout):
    """The plain norm with autograd on the residual sum s = x + residual * scale (one scale per row): y and s, the
    gradients of x, the residual, its scale and the weight; strided views of x, the residual, the scale and the
    weight in the strided layout."""
    def run(v, backend):
        if backend == "reference":
            s = v["x"] + v["r"] * v["scale"]
            return [_norm(s, v["w"], D_N), s]
        y, s = rms_norm_autograd_triton(_view(v["x"], layout), strided_vec(v["w"]) if layout == "strided" else v["w"],
                                        EPS, residual=_view(v["r"], layout),
                                        residual_scale=strided_vec(v["scale"]) if layout == "strided" else v["scale"])
        return [y, s]
    d = dict(x=torch.randn(b, t, D_N, dtype=F64), r=torch.randn(b, t, D_N, dtype=F64),
             scale=torch.rand(b, t, 1, dtype=F64) + 0.5, w=torch.rand(D_N, dtype=F64) + 0.5)
    compare(run, d, weights((b, t, D_N), (b, t, D_N)), 1e-5)


@pytest.mark.parametrize("b,t,layout", CASES, ids=IDS)
def test_rms_norm_no_grad_forward(b, t, layout):
    """The one-kernel forward (no autograd): grouped and gated, and the residual add before the norm."""
    x, z, r = (torch.randn(b, t, D_N, dtype=F64, device=DEV) for _ in range(3))
    w = torch.rand(D_N, dtype=F64, device=DEV) + 0.5
    xf, zf, rf, wf = (v.float() for v in (x, z, r, w))
    if layout == "strided":
        xf, zf, rf, wf = strided(xf), strided(zf), strided(rf), strided_vec(wf)
    y = rms_norm_triton(xf, wf, EPS, z=zf, group_size=GROUP)
    assert rel(y, _norm(x * torch.nn.functional.silu(z), w, GROUP)) < 1e-5
    y, s = rms_norm_triton(xf, wf, EPS, residual=rf)
    assert rel(s, x + r) < 1e-6 and rel(y, _norm(x + r, w, D_N)) < 1e-5


# --- rope decode step ------------------------------------------------------------------------------------------------
NH, NKV, HD, CAP = 4, 2, 8, 7


@pytest.mark.parametrize("b,layout,pos", [(3, "contiguous", 0), (3, "strided", 6), (1, "strided", 0),
                                          (1, "contiguous", 3), (3, "strided", 3)])
def test_rope_kv_step(b, layout, pos):
    """One decode token (T = 1; no backward on the Triton path): q rotated, k rotated and v written at slot `pos`
    of the caches. Strided: qkv a column window of a wider projection, the caches views of buffers stored with
    head_dim outermost (its stride the capacity) and batch rows of a larger pool."""
    qkv = torch.randn(b, 1, (NH + 2 * NKV) * HD, dtype=F64, device=DEV)
    ang = torch.rand(HD // 2, dtype=F64, device=DEV) * 3
    cos, sin = torch.cat([ang.cos(), ang.cos()])[None], torch.cat([ang.sin(), ang.sin()])[None]
    kc0, vc0 = (torch.randn(b, NKV, CAP, HD, dtype=F64, device=DEV) for _ in range(2))
    position = torch.tensor([pos], device=DEV)
    kr, vr = kc0.clone(), vc0.clone()
    qr = rope_kv_step(qkv, cos, sin, kr, vr, position, NH, NKV, backend="reference")
    q32 = qkv.float()
    if layout == "strided":
        q32 = strided(q32)
        kbuf = kc0.float().permute(3, 0, 1, 2).repeat_interleave(2, 1).contiguous()  # (HD, 2b, NKV, CAP)
        vbuf = vc0.float().permute(3, 0, 1, 2).repeat_interleave(2, 1).contiguous()
        kt, vt = kbuf.permute(1, 2, 3, 0)[::2], vbuf.permute(1, 2, 3, 0)[::2]
    else:
        kt, vt = kc0.float().clone(), vc0.float().clone()
    assert (kt.stride(-1) != 1) == (layout == "strided")
    q = rope_kv_step(q32, cos.float(), sin.float(), kt, vt, position, NH, NKV, backend="triton")
    assert rel(q, qr) < 1e-6 and rel(kt, kr) < 1e-6 and rel(vt, vr) < 1e-6


# --- cross-entropy rows ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b,t,layout", CASES, ids=IDS)
def test_cross_entropy_rows(b, t, layout):
    """lse, loss and the gradient written over the logits (rows b * t, some targets ignored), against the float64
    reference; strided: the logits a column window of a wider tensor (row stride > V) and the targets every other
    element of a longer vector. One case at V over the kernel's 4096-column block."""
    V = 4100 if (b, t) == (3, 2) else 37
    n = b * t
    logits = torch.randn(n, V, dtype=F64, device=DEV) * 3
    targets = torch.randint(0, V, (n,), device=DEV)
    targets[::3] = -100
    ref_logits = logits.clone()
    lse_r, loss_r = ce_rows_reference_(ref_logits, targets, 0.7, -100, write_grad=True)
    lg, tg = logits.float(), targets
    if layout == "strided":
        lg = torch.nn.functional.pad(lg, (2, 3))[:, 2:2 + V]
        tg = torch.stack([targets, torch.zeros_like(targets)], -1)[:, 0]
    else:
        lg = lg.clone()
    lse, loss = ce_rows_(lg, tg, 0.7, -100, write_grad=True)
    assert rel(lse, lse_r) < 1e-6 and rel(loss, loss_r) < 1e-5
    assert rel(lg, ref_logits) < 1e-5  # the gradient written over the logits


# --- SwiGLU gate -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("b,t,layout", CASES, ids=IDS)
def test_silu_mul(b, t, layout):
    """silu(g) * u, the no-grad kernel: g and u time-strided column windows in the strided layout."""
    from lm_kernels.swiglu import silu_mul_triton  # noqa: PLC0415

    g, u = (torch.randn(b, t, 40, dtype=F64, device=DEV) for _ in range(2))
    gf, uf = g.float(), u.float()
    if layout == "strided":
        gf, uf = strided(gf), strided(uf)
    assert rel(silu_mul_triton(gf, uf), torch.nn.functional.silu(g) * u) < 1e-6
