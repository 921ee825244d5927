"""Helpers of the kernel shape matrix (tests/test_shape_matrix_*.py): the device, the time lengths around a chunk,
non-contiguous views that stay differentiable to the values they show, and the comparison of a Triton op's outputs
and gradients against its float64 PyTorch reference."""
from __future__ import annotations

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
CHUNK = 16  # the chunk of the chunked ops in the matrix (a small one: the interpreter runs it fast)
TS = (1, 2, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5)  # the time lengths every op is run at
PACKED = ([1], [1, 5, 1, 16, 17, 1], [3, 1, 1, 33])  # packed document lengths (batch 1), each with length-1 documents


@pytest.fixture
def full_fp32():
    """float32 products at full precision on the GPU (tf32 would set the error floor, not the kernels)."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(prev)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def cu_offsets(lens):
    """Packed documents' offsets (int32, from 0) on the test device."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)


def strided(v, time_dim=1):
    """v's values as a non-contiguous view, differentiable to v: every other step of a time axis twice as long and a
    column window, offset by one, of a last dim three wider (a split projection's layout; the other dims' strides
    grow with it)."""
    big = list(v.shape)
    big[time_dim] *= 2
    big[-1] += 3
    idx = [slice(None)] * v.dim()
    idx[time_dim] = slice(None, None, 2)
    idx[-1] = slice(1, 1 + v.shape[-1])
    buf = v.new_zeros(big)
    buf[tuple(idx)] = v
    return buf[tuple(idx)]


def strided_vec(v):
    """A tensor as a view with every stride doubled, its last one 2 (a column of a wider table), differentiable to v."""
    return torch.stack([v, torch.zeros_like(v)], -1)[..., 0]


def transposed(v):
    """A tensor with its last two dims stored swapped (unit stride along dim -2), differentiable to v."""
    return v.transpose(-1, -2).contiguous().transpose(-1, -2)


def leaves(data, dtype, keep=()):
    """Fresh leaves on the test device in `dtype` (float64 stays float64); the names in `keep` keep float32 (the
    per-head parameters the models keep in float32) unless dtype is float64."""
    return {k: v.detach().to(DEV, F64 if dtype == F64 else (torch.float32 if k in keep else dtype)).requires_grad_()
            for k, v in data.items()}


def weights(*shapes):
    """Random float64 cotangents for the outputs (fresh draws)."""
    return [torch.randn(s, dtype=F64, device=DEV) for s in shapes]


def weighted_sum(outs, ws, transpose_first=False):
    """sum of <out, w>; transpose_first: the first output enters transposed over its last two dims, so that its
    gradient reaches the op with a non-unit last stride."""
    total = 0
    for i, (o, w) in enumerate(zip(outs, ws)):
        if i == 0 and transpose_first:
            total = total + (o.double().transpose(-1, -2) * w.transpose(-1, -2)).sum()
        else:
            total = total + (o.double() * w).sum()
    return total


def compare(run, data, ws, tol, *, keep=(), transpose_first=False, dtype=torch.float32):
    """run(leaves, backend) -> outputs, with backend "triton" (on `dtype` leaves) and "reference" (on float64 leaves):
    every output and the gradient of every leaf (through the weighted sum of the outputs) within `tol` relative
    error, finite, of the reference's shape."""
    got = leaves(data, dtype, keep)
    outs = run(got, "triton")
    weighted_sum(outs, ws, transpose_first).backward()
    ref = leaves(data, F64)
    ref_outs = run(ref, "reference")
    weighted_sum(ref_outs, ws).backward()
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.shape == r.shape, f"output {i}: shape {tuple(o.shape)} vs {tuple(r.shape)}"
        assert torch.isfinite(o).all(), f"output {i} not finite"
        assert rel(o, r) < tol, f"output {i}: {rel(o, r):.2e}"
    for k in ref:
        g, r = got[k].grad, ref[k].grad
        assert g is not None and g.shape == r.shape, f"grad {k}"
        assert torch.isfinite(g).all(), f"grad {k} not finite"
        assert rel(g, r) < tol, f"grad {k}: {rel(g, r):.2e}"
