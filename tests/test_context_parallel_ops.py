"""Context-parallel ops (lm_kernels.context_parallel) on 2 and 4 gloo ranks against the unsharded op: outputs, the
last rank's final state, the gradients of every input (each rank's slice) and of the shared parameters (summed over
the ranks), float64 to 1e-10 and float32 to 1e-5, rows of a batch and packed documents (a document that starts
exactly at a slice start, one of length 1, one that covers a whole slice, one that starts a token before a slice)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from context_parallel_checks import assert_passed, case_params, check, close, label, run_selected, summed

from lm_kernels.context_parallel import (ContextSlice, all_gather, block_scan_cp, causal_conv1d_cp,
                                         chunk_deltaproduct_cp, pass_states, slice_offsets, ssd_scan_cp,
                                         ssd_scan_xbc_cp)
from lm_kernels.conv1d import causal_conv1d
from lm_kernels.deltaproduct import chunk_deltaproduct
from lm_kernels.lru import block_scan
from lm_kernels.ssd import ssd_scan, ssd_scan_xbc

T = 48
OFFSETS = [0, 5, 12, 13, 23, 40, 48]  # at 4 ranks (slices of 12): rank 1 starts a document, rank 2 continues one by 1
#                                       token, rank 3 by 13; the document [23, 40) covers rank 2's slice


def _setup(rank, world, packed):
    """(batch rows, the slice of this rank, ContextSlice, global cu_seqlens or None, local cu_seqlens or None)."""
    n = T // world
    part = slice(rank * n, (rank + 1) * n)
    if not packed:
        return 2, part, ContextSlice(None, lead=rank * n), None, None
    lead, local = slice_offsets(OFFSETS, rank * n, n)
    return (1, part, ContextSlice(None, lead=lead, offsets=local), torch.tensor(OFFSETS, dtype=torch.int32),
            torch.tensor(local, dtype=torch.int32))


def _leaves(full: dict, part) -> tuple[dict, dict]:
    """(full inputs with grad, this rank's slices of the sequence inputs with grad; parameters shared)."""
    ref = {k: v.clone().requires_grad_() for k, v in full.items()}
    mine = {}
    for k, v in full.items():
        seq = v.dim() >= 2 and k not in ("weight",)
        mine[k] = (v[:, part] if seq else v).clone().requires_grad_()
    return ref, mine


def _compare_grads(ref, mine, part, dtype, seq_keys):
    for k in ref:
        if ref[k].grad is None:
            continue
        if k in seq_keys:
            close(f"d{k}", mine[k].grad, ref[k].grad[:, part], dtype)
        else:
            close(f"d{k}", summed(mine[k].grad), ref[k].grad, dtype)


def _case_ssd(rank, world, dtype, packed, xbc_form):
    b, part, sl, cu, cu_local = _setup(rank, world, packed)
    g = torch.Generator().manual_seed(0)
    h, p, ng, n = 4, 3, 2, 5
    full = {"x": torch.randn(b, T, h, p, generator=g, dtype=dtype),
            "B": torch.randn(b, T, ng, n, generator=g, dtype=dtype),
            "C": torch.randn(b, T, ng, n, generator=g, dtype=dtype),
            "dt": torch.randn(b, T, h, generator=g, dtype=dtype) * 0.5,
            "A": -torch.rand(h, generator=g, dtype=dtype) - 0.2, "D": torch.randn(h, generator=g, dtype=dtype),
            "dt_bias": torch.randn(h, generator=g, dtype=dtype) * 0.3}
    w = torch.randn(b, T, h, p, generator=g, dtype=dtype)
    ref, mine = _leaves(full, part)
    kw = dict(chunk_size=5, dt_softplus=True, dt_limit=(0.0, 3.0))

    def run(inp, cu_seqlens, cp):
        if xbc_form:
            xbc = torch.cat([inp["x"].flatten(2), inp["B"].flatten(2), inp["C"].flatten(2)], dim=-1)
            args = dict(headdim=p, ngroups=ng, dstate=n, D=inp["D"], dt_bias=inp["dt_bias"], cu_seqlens=cu_seqlens,
                        **kw)
            if cp:
                return ssd_scan_xbc_cp(xbc, inp["dt"], inp["A"], sl, **args)
            return ssd_scan_xbc(xbc, inp["dt"], inp["A"], return_final_state=True, **args)
        args = dict(D=inp["D"], dt_bias=inp["dt_bias"], cu_seqlens=cu_seqlens, **kw)
        if cp:
            return ssd_scan_cp(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], sl, **args)
        return ssd_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], return_final_state=True, **args)

    y, final = run(ref, cu, False)
    (y * w).sum().backward()
    y_r, final_r = run(mine, cu_local, True)
    (y_r * w[:, part]).sum().backward()
    close("y", y_r, y[:, part], dtype)
    if rank == world - 1:
        close("final", final_r, final[-1:] if packed else final, dtype)
    _compare_grads(ref, mine, part, dtype, ("x", "B", "C", "dt"))


def _case_conv(rank, world, dtype, packed, with_add):
    b, part, sl, cu, cu_local = _setup(rank, world, packed)
    g = torch.Generator().manual_seed(1)
    c, width = 6, 4
    full = {"x": torch.randn(b, T, c, generator=g, dtype=dtype), "weight": torch.randn(c, width, generator=g,
                                                                                        dtype=dtype),
            "bias": torch.randn(c, generator=g, dtype=dtype)}
    if with_add:
        full["x_add"] = torch.randn(b, T, c, generator=g, dtype=dtype)
    w = torch.randn(b, T, c, generator=g, dtype=dtype)
    ref, mine = _leaves(full, part)
    y, _ = causal_conv1d(ref["x"], ref["weight"], ref["bias"], x_add=ref.get("x_add"), cu_seqlens=cu)
    (y * w).sum().backward()
    y_r = causal_conv1d_cp(mine["x"], mine["weight"], mine["bias"], sl, x_add=mine.get("x_add"), cu_seqlens=cu_local)
    (y_r * w[:, part]).sum().backward()
    close("y", y_r, y[:, part], dtype)
    _compare_grads(ref, mine, part, dtype, ("x", "x_add"))


def _case_deltaproduct(rank, world, dtype, packed, gated):
    b, part, sl, cu, cu_local = _setup(rank, world, packed)
    g = torch.Generator().manual_seed(2)
    H, K, V, nh = 2, 4, 6, 2
    full = {"q": torch.randn(b, T, H, K, generator=g, dtype=dtype),
            "k": torch.randn(b, T * nh, H, K, generator=g, dtype=dtype),
            "v": torch.randn(b, T * nh, H, V, generator=g, dtype=dtype),
            "beta": torch.rand(b, T * nh, H, generator=g, dtype=dtype) * 2}
    if gated:
        full["g"] = -torch.rand(b, T, H, generator=g, dtype=dtype) * 0.3
    w = torch.randn(b, T, H, V, generator=g, dtype=dtype)
    ref = {k: v.clone().requires_grad_() for k, v in full.items()}
    rows = slice(part.start * nh, part.stop * nh)
    mine = {k: (v[:, rows] if k in ("k", "v", "beta") else v[:, part]).clone().requires_grad_()
            for k, v in full.items()}
    kw = dict(num_householder=nh, use_qk_l2norm=True, chunk_size=8)
    o, final = chunk_deltaproduct(ref["q"], ref["k"], ref["v"], ref["beta"], ref.get("g"), cu_seqlens=cu,
                                  output_final_state=True, **kw)
    (o * w).sum().backward()
    o_r, final_r = chunk_deltaproduct_cp(mine["q"], mine["k"], mine["v"], mine["beta"], mine.get("g"), sl,
                                         cu_seqlens=cu_local, **kw)
    (o_r * w[:, part]).sum().backward()
    close("o", o_r, o[:, part], dtype)
    if rank == world - 1:
        close("final", final_r, final[-1:] if packed else final, dtype)
    for k in ref:
        close(f"d{k}", mine[k].grad, ref[k].grad[:, rows if k in ("k", "v", "beta") else part], dtype)


def _case_block_scan(rank, world, dtype, packed, expanded):
    b, part, sl, cu, cu_local = _setup(rank, world, packed)
    g = torch.Generator().manual_seed(3)
    nb, m = 3, 3
    if expanded:  # a time-invariant A (the lru variant): one (nb, m, m) parameter expanded over b and t
        A0 = torch.randn(nb, m, m, generator=g, dtype=dtype) * 0.4
    else:
        A0 = torch.randn(b, T, nb, m, m, generator=g, dtype=dtype) * 0.5
    full = {"A": A0, "x": torch.randn(b, T, nb, m, generator=g, dtype=dtype)}
    w = torch.randn(b, T, nb, m, generator=g, dtype=dtype)
    ref = {k: v.clone().requires_grad_() for k, v in full.items()}
    mine = {"A": (A0 if expanded else A0[:, part]).clone().requires_grad_(),
            "x": full["x"][:, part].clone().requires_grad_()}

    def a_of(inp, t):
        return inp["A"].expand(b, t, nb, m, m) if expanded else inp["A"]

    h, final = block_scan(a_of(ref, T), ref["x"], cu_seqlens=cu, chunk_size=4, return_final_state=True)
    (h * w).sum().backward()
    h_r, final_r = block_scan_cp(a_of(mine, T // world), mine["x"], sl, cu_seqlens=cu_local, chunk_size=4)
    (h_r * w[:, part]).sum().backward()
    close("h", h_r, h[:, part], dtype)
    if rank == world - 1:
        close("final", final_r, final[-1:] if packed else final, dtype)
    close("dx", mine["x"].grad, ref["x"].grad[:, part], dtype)
    if expanded:
        close("dA", summed(mine["A"].grad), ref["A"].grad, dtype)
    else:
        close("dA", mine["A"].grad, ref["A"].grad[:, part], dtype)


def _all_cases(rank, world, op):
    """flag: ssd_scan_xbc_cp vs ssd_scan_cp; conv with an x_add; DeltaProduct gated; a time-invariant (expanded) A."""
    for dtype in (torch.float64, torch.float32):
        for packed in (False, True):
            for flag in (False, True):
                with label(f"{str(dtype)[6:]} packed={packed} flag={flag}"):
                    op(rank, world, dtype, packed, flag)


def _case_collectives(rank, world):
    """all_gather and pass_states on a group of 3 of the 4 ranks, [1, 2, 3] (a group rank unlike the global rank, as
    in a context group of a data x context run; an odd size)."""
    members = [1, 2, 3]
    group = dist.new_group(members)  # every rank of the world takes part in creating it
    if rank not in members:
        return
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    # all_gather: forward the stacked values, backward each owner's gradient summed over the ranks
    x = torch.full((2, 3), float(rank), dtype=torch.float64, requires_grad=True)
    out = all_gather(x, group)
    check(out.shape == (world, 2, 3) and out[:, 0, 0].tolist() == list(range(world)),
          f"all_gather: {out[:, 0, 0].tolist()}")
    (out * (rank + 1)).sum().backward()  # every rank weights every entry by rank + 1
    close("all_gather dx", x.grad, torch.full((2, 3), world * (world + 1) / 2, dtype=torch.float64), torch.float64,
          0.0)
    # pass_states with a matrix transition: h_r against the fold written out, and its gradient against autograd
    # through that fold on the gathered (S, M) of every rank
    g = torch.Generator().manual_seed(7)
    Ss = torch.randn(world, 2, 3, 4, generator=g, dtype=torch.float64)
    Ms = torch.randn(world, 2, 3, 3, generator=g, dtype=torch.float64) * 0.5
    ws = torch.randn(world, 2, 3, 4, generator=g, dtype=torch.float64)
    S, M = Ss[rank].clone().requires_grad_(), Ms[rank].clone().requires_grad_()
    h = pass_states(S, M, ContextSlice(group, lead=rank), torch.matmul)
    (h * ws[rank]).sum().backward()
    Sr, Mr = Ss.clone().requires_grad_(), Ms.clone().requires_grad_()
    hs, loss = [torch.zeros(2, 3, 4, dtype=torch.float64)], 0
    for j in range(world - 1):
        hs.append(Mr[j] @ hs[-1] + Sr[j])
    for j in range(world):
        loss = loss + (hs[j] * ws[j]).sum()
    loss.backward()
    close("h", h, hs[rank].detach(), torch.float64)
    close("dS", S.grad, Sr.grad[rank], torch.float64)
    close("dM", M.grad, Mr.grad[rank], torch.float64)


_OPS = {"ssd": (_all_cases, (_case_ssd,)), "conv": (_all_cases, (_case_conv,)),
        "deltaproduct": (_all_cases, (_case_deltaproduct,)), "block_scan": (_all_cases, (_case_block_scan,))}
CASES = {2: dict(_OPS), 4: {**_OPS, "collectives": (_case_collectives, ())}}


@pytest.fixture(scope="module")
def reports(request):
    """Every selected case, in one start of 2 ranks and one of 4."""
    return run_selected(request, CASES)


@pytest.mark.multirank
@pytest.mark.parametrize("world, case", case_params(CASES))
def test_op_equals_unsharded(reports, world, case):
    """Each op against the unsharded op (float64 and float32, rows and packed documents, both forms of each op);
    `collectives`: all_gather and pass_states with their backward, on a group of 3 of the 4 ranks."""
    assert_passed(reports, world, case)


def test_slice_offsets():
    assert slice_offsets(OFFSETS, 0, 12) == (0, (0, 5, 12))
    assert slice_offsets(OFFSETS, 12, 12) == (0, (0, 1, 11, 12))
    assert slice_offsets(OFFSETS, 24, 12) == (1, (0, 12))
    assert slice_offsets(OFFSETS, 36, 12) == (13, (0, 4, 12))
    assert slice_offsets([0, 4, 4, 8], 0, 8) == (0, (0, 4, 8))  # empty documents dropped
    with pytest.raises(ValueError, match="slice's end"):
        slice_offsets([0, 8], 4, 8)
