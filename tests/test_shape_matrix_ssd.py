"""Shape matrix of the SSD family's Triton ops (lm_kernels.ssd.ssd_scan / ssd_scan_xbc, lm_kernels.mamba2.mamba2_inner)
against their float64 PyTorch references, forward and backward (every input's gradient), on fresh random inputs: T in
{1, 2, chunk - 1, chunk, chunk + 1, 3 chunks + 5} at a 16-token chunk, batch 1 and 3 (T = 1 at batch 3 in every
layout), contiguous inputs and non-contiguous views (a time axis with twice the stride, a column window of a wider
tensor, per-head parameters as strided or transposed views, a non-contiguous output gradient), and packed documents
with length-1 ones. A row written to the wrong place, or left unwritten, moves the relative error far above the
tolerance. CUDA when available (float32 products at full precision), else the Triton interpreter on CPU."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from lm_kernels.conv1d import causal_conv1d_reference  # noqa: E402
from lm_kernels.mamba2 import mamba2_inner  # noqa: E402
from lm_kernels.ssd import ssd_scan, ssd_scan_xbc  # noqa: E402
from shape_matrix import (  # noqa: E402,F401  (full_fp32: a fixture)
    CHUNK,
    DEV,
    F64,
    PACKED,
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
TOL = 5e-5
KEEP = ("A", "D", "dt_bias")  # float32 like the models' parameters
# (batch, T, layout): T in shape_matrix.TS, both batch sizes, T = 1 at batch 3 contiguous and strided
CASES = [(3, 1, "contiguous"), (3, 1, "strided"), (1, 1, "strided"), (3, 2, "contiguous"), (1, 15, "strided"),
         (3, 16, "strided"), (1, 17, "contiguous"), (3, 53, "strided"), (1, 53, "contiguous")]
IDS = [f"b{b}-T{t}-{lay}" for b, t, lay in CASES]
PACKED_IDS = ["-".join(map(str, v)) for v in PACKED]


def _ssd_data(b, t, h, p, g, n, nseq, gate):
    d = dict(x=torch.randn(b, t, h, p, dtype=F64), dt=torch.randn(b, t, h, dtype=F64) - 1.0,
             A=-(torch.rand(h, dtype=F64) * 2 + 0.3), B=torch.randn(b, t, g, n, dtype=F64),
             C=torch.randn(b, t, g, n, dtype=F64), dt_bias=torch.randn(h, dtype=F64) * 0.5,
             initial_state=torch.randn(nseq, h, p, n, dtype=F64))
    d["D"] = torch.randn(h, p, dtype=F64) if gate else torch.randn(h, dtype=F64)
    if gate:
        d["z"] = torch.randn(b, t, h, p, dtype=F64)
    return d


def _ssd_run(layout, cu):
    def run(v, backend):
        lay = dict(v)
        if backend == "triton" and layout == "strided":
            for k in ("x", "dt", "B", "C", "z"):
                if k in lay:
                    lay[k] = strided(lay[k])
            lay["A"], lay["dt_bias"] = strided_vec(lay["A"]), strided_vec(lay["dt_bias"])
            lay["D"] = transposed(lay["D"]) if lay["D"].dim() == 2 else strided_vec(lay["D"])
            lay["initial_state"] = strided(lay["initial_state"])
        return ssd_scan(**lay, chunk_size=CHUNK, dt_limit=(0.0, 3.0), cu_seqlens=cu, return_final_state=True,
                        backend=backend)
    return run


@pytest.mark.parametrize("b,t,layout", CASES, ids=IDS)
def test_ssd_scan(b, t, layout):
    """x, B, C separate: strided layouts read through their strides (a head stride that is not headdim, B / C
    group strides that are not dstate), D as (h, p) transposed, A / dt_bias / D (h,) as stride-2 views, the gate z
    (the gate's backward) with the strided layout, the output's gradient transposed."""
    h, p, g, n = 4, 6, 2, 5
    gate = layout == "strided"
    d = _ssd_data(b, t, h, p, g, n, b, gate)
    compare(_ssd_run(layout, None), d, weights((b, t, h, p), (b, h, p, n)), TOL, keep=KEEP, transpose_first=gate)


@pytest.mark.parametrize("lens", PACKED, ids=PACKED_IDS)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_ssd_scan_packed(lens, layout):
    h, p, g, n = 4, 6, 2, 5
    t = sum(lens)
    d = _ssd_data(1, t, h, p, g, n, len(lens), layout == "strided")
    compare(_ssd_run(layout, cu_offsets(lens)), d, weights((1, t, h, p), (len(lens), h, p, n)), TOL, keep=KEEP)


def _xbc_run(h, p, g, n, layout, cu):
    def run(v, backend):
        xbc = strided(v["xbc"]) if backend == "triton" and layout == "strided" else v["xbc"]
        dt = strided(v["dt"]) if backend == "triton" and layout == "strided" else v["dt"]
        return ssd_scan_xbc(xbc, dt, v["A"], headdim=p, ngroups=g, dstate=n, chunk_size=CHUNK, D=v["D"],
                            dt_bias=v["dt_bias"], initial_state=v["initial_state"], cu_seqlens=cu,
                            return_final_state=True, backend=backend)
    return run


def _xbc_data(b, t, h, p, g, n, nseq):
    return dict(xbc=torch.randn(b, t, h * p + 2 * g * n, dtype=F64), dt=torch.randn(b, t, h, dtype=F64) - 1.0,
                A=-(torch.rand(h, dtype=F64) * 2 + 0.3), D=torch.randn(h, dtype=F64),
                dt_bias=torch.randn(h, dtype=F64) * 0.5, initial_state=torch.randn(nseq, h, p, n, dtype=F64))


@pytest.mark.parametrize("b,t,layout", CASES, ids=IDS)
def test_ssd_scan_xbc(b, t, layout):
    """x | B | C in one tensor; the backward writes dx, dB and dC into column views of one gradient (at T = 1 their
    size-1 time axis has a stride of its own: the batch stride must come from the tensor)."""
    h, p, g, n = 4, 6, 2, 5
    compare(_xbc_run(h, p, g, n, layout, None), _xbc_data(b, t, h, p, g, n, b), weights((b, t, h, p), (b, h, p, n)),
            TOL, keep=KEEP)


@pytest.mark.parametrize("lens", PACKED, ids=PACKED_IDS)
def test_ssd_scan_xbc_packed(lens):
    h, p, g, n = 4, 6, 2, 5
    t = sum(lens)
    compare(_xbc_run(h, p, g, n, "strided", cu_offsets(lens)), _xbc_data(1, t, h, p, g, n, len(lens)),
            weights((1, t, h, p), (len(lens), h, p, n)), TOL, keep=KEEP)


# Mamba2's inner path: d_inner 16 = 2 heads of 8, 2 groups of dstate 8, conv width 4, norm groups of 8
DI, P2, G2, N2, W2, NG = 16, 8, 2, 8, 4, 8
H2, CD = DI // P2, DI + 2 * G2 * N2


def _gated_norm(u, z, weight, group, eps=1e-5):
    """The gated RMSNorm's formula in the inputs' dtype: v = u * silu(z), per group v / rms(v), times the weight."""
    v = u * torch.nn.functional.silu(z)
    vg = v.unflatten(-1, (-1, group))
    out = (vg * torch.rsqrt(vg.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return out * weight if weight is not None else out


def _mamba2_data(b, t, nseq, *, adds):
    d = dict(zxbcdt=torch.randn(b, t, DI + CD + H2, dtype=F64), conv_weight=torch.randn(CD, W2, dtype=F64) * 0.5,
             conv_bias=torch.randn(CD, dtype=F64), A=-(torch.rand(H2, dtype=F64) * 2 + 0.3),
             D=torch.randn(H2, dtype=F64), dt_bias=torch.randn(H2, dtype=F64) * 0.5,
             norm_weight=torch.rand(DI, dtype=F64) + 0.5, conv_state=torch.randn(b, CD, W2 - 1, dtype=F64),
             initial_state=torch.randn(nseq, H2, P2, N2, dtype=F64))
    if adds:
        d["add"] = torch.randn(b, t, DI + CD + H2, dtype=F64) * 0.5
    return d


def _mamba2_run(layout, cu, fold):
    """The Triton operator (strided layout: the projection and the injection time-strided column windows, conv bias,
    A, D, dt_bias and the norm weight stride-2 views, the conv state with its channels strided) against the float64
    composition of the conv, SSD and gated-norm references. fold: one norm group and no weight, the operator's u
    and rstd (outside autograd) give the normalized output as the caller's projection forms it."""
    group = DI if fold else NG

    def run(v, backend):
        if backend == "reference":
            z, xbc, dt = v["zxbcdt"].split([DI, CD, H2], -1)
            z_add = x_add = None
            if "add" in v:
                z_add, x_add, dt_add = v["add"].split([DI, CD, H2], -1)
                z, dt = z + z_add, dt + dt_add
            xo, ncs = causal_conv1d_reference(xbc, v["conv_weight"], v["conv_bias"], x_add=x_add,
                                              conv_state=v["conv_state"], cu_seqlens=cu, activation="silu")
            y, fin = ssd_scan_xbc(xo, dt, v["A"], headdim=P2, ngroups=G2, dstate=N2, chunk_size=CHUNK, D=v["D"],
                                  dt_bias=v["dt_bias"], dt_limit=(0.0, 3.0), initial_state=v["initial_state"],
                                  cu_seqlens=cu, return_final_state=True, backend="reference")
            out = _gated_norm(y.flatten(-2), z, None if fold else v["norm_weight"], group)
            return out, ncs, fin
        lay = dict(v)
        if layout == "strided":
            for k in ("zxbcdt", "add"):
                if k in lay:
                    lay[k] = strided(lay[k])
            for k in ("conv_bias", "A", "D", "dt_bias", "norm_weight"):
                if k in lay:
                    lay[k] = strided_vec(lay[k])
            lay["conv_state"] = lay["conv_state"].transpose(1, 2).contiguous().transpose(1, 2)
        out = mamba2_inner(lay["zxbcdt"], lay["conv_weight"], lay["conv_bias"], lay["A"], d_inner=DI, headdim=P2,
                           ngroups=G2, dstate=N2, chunk_size=CHUNK, D=lay["D"], dt_bias=lay["dt_bias"],
                           dt_limit=(0.0, 3.0), norm_weight=None if fold else lay["norm_weight"], norm_group=group,
                           add=lay.get("add"), conv_state=lay["conv_state"], initial_state=lay["initial_state"],
                           cu_seqlens=cu, return_final_state=True, fold_norm=fold)
        if fold:
            u, ncs, fin, rstd = out
            assert not rstd.requires_grad
            return u * rstd, ncs, fin
        return out
    return run


M2_CASES = [(3, 1, "contiguous", False), (3, 1, "strided", True), (1, 1, "contiguous", True),
            (3, 2, "strided", False), (1, 15, "contiguous", False), (3, 16, "contiguous", True),
            (1, 17, "strided", False), (3, 53, "strided", False), (3, 53, "contiguous", True)]


@pytest.mark.parametrize("b,t,layout,fold", M2_CASES, ids=[f"b{b}-T{t}-{lay}{'-fold' if f else ''}"
                                                           for b, t, lay, f in M2_CASES])
def test_mamba2_inner(b, t, layout, fold):
    """The fused conv -> SSD -> gated norm operator, its gradients written into one tensor of the projection's
    shape; the injection `add` with the strided layout; both states in and out."""
    d = _mamba2_data(b, t, b, adds=layout == "strided")
    if fold:
        d.pop("norm_weight")
    compare(_mamba2_run(layout, None, fold), d, weights((b, t, DI), (b, CD, W2 - 1), (b, H2, P2, N2)), TOL, keep=KEEP)


@pytest.mark.parametrize("lens", PACKED, ids=PACKED_IDS)
def test_mamba2_inner_packed(lens):
    t = sum(lens)
    d = _mamba2_data(1, t, len(lens), adds=True)
    compare(_mamba2_run("strided", cu_offsets(lens), False), d,
            weights((1, t, DI), (1, CD, W2 - 1), (len(lens), H2, P2, N2)), TOL, keep=KEEP)


@pytest.mark.parametrize("b,layout", [(3, "contiguous"), (3, "strided"), (1, "strided")])
def test_ssd_step(b, layout):
    """The one-token decode step (no backward on the Triton path) against its float64 reference: strided, every
    activation a column window of a wider tensor, the state with its (p, n) dims stored swapped, A / dt_bias
    stride-2 views and D (h, p) transposed."""
    from lm_kernels.ssd import ssd_step  # noqa: PLC0415

    h, p, g, n = 4, 6, 2, 5
    d = dict(state=torch.randn(b, h, p, n, dtype=F64) * 0.5, x=torch.randn(b, h, p, dtype=F64),
             dt=torch.randn(b, h, dtype=F64) - 1.0, A=-(torch.rand(h, dtype=F64) * 2 + 0.3),
             B=torch.randn(b, g, n, dtype=F64), C=torch.randn(b, g, n, dtype=F64), D=torch.randn(h, p, dtype=F64),
             z=torch.randn(b, h, p, dtype=F64), dt_bias=torch.randn(h, dtype=F64) * 0.5)
    d = {k: v.to(DEV) for k, v in d.items()}
    y_r, s_r = ssd_step(**d, dt_limit=(0.0, 3.0), backend="reference")
    f = {k: v.float() for k, v in d.items()}
    if layout == "strided":
        for k in ("x", "dt", "B", "C", "z"):
            f[k] = strided(f[k])
        f["state"] = transposed(f["state"])
        f["A"], f["dt_bias"], f["D"] = strided_vec(f["A"]), strided_vec(f["dt_bias"]), transposed(f["D"])
    y, s = ssd_step(**f, dt_limit=(0.0, 3.0), backend="triton")
    assert rel(y, y_r) < TOL and rel(s, s_r) < TOL
