"""DeltaProduct Triton kernels vs the float64 chunkwise reference (CPU: TRITON_INTERPRET=1, tiny shapes)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from lm_kernels.deltaproduct import chunk_deltaproduct  # noqa: E402

NAMES = ["o", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dinitial_state"]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def run(backend, ins, wo, ws, dtype, **kw):
    leaves = [x.clone().to(dtype).requires_grad_(True) if x is not None else None for x in ins]
    q, k, v, beta, g, s0 = leaves
    o, s = chunk_deltaproduct(q, k, v, beta, g, initial_state=s0, output_final_state=True, backend=backend, **kw)
    ((o.double() * wo).sum() + (s.double() * ws).sum()).backward()
    return [o.detach(), s.detach()] + [x.grad if x is not None else None for x in leaves]


def make(B, T, H, K, V, nh, gate, h0, n_states, unit_k=True):
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T * nh, H, K)
    k = F.normalize(k, dim=-1) if unit_k else k
    v = torch.randn(B, T * nh, H, V)
    beta = torch.rand(B, T * nh, H) * 2
    g = -torch.rand(B, T, H) * 0.5 if gate else None
    s0 = torch.randn(n_states, H, K, V) if h0 else None
    return [q, k, v, beta, g, s0]


CASES = [
    # B, T, H, K, V, nh, chunk, gate, h0, cu_seqlens, l2norm
    (2, 21, 1, 16, 16, 1, 16, True, True, None, False),
    (1, 19, 2, 16, 8, 2, 16, False, True, None, False),
    (1, 24, 1, 16, 16, 3, 16, True, False, None, False),
    (1, 23, 1, 8, 16, 2, 32, True, True, None, True),
    (1, 40, 1, 16, 16, 2, 64, True, True, None, False),
    (1, 26, 1, 16, 16, 3, 16, True, True, [0, 5, 6, 20, 26], False),
    (1, 40, 2, 32, 32, 4, 64, False, False, None, False),  # the S5 recipe's nh = 4, 16 tokens per chunk
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}nh{c[5]}C{c[6]}g{int(c[7])}"
                                                     f"h{int(c[8])}{'var' if c[9] else ''}{'l2' if c[10] else ''}")
def test_triton_matches_reference(case):
    B, T, H, K, V, nh, C, gate, h0, cu, l2 = case
    cu_t = torch.tensor(cu) if cu is not None else None
    N = B if cu is None else len(cu) - 1
    ins = make(B, T, H, K, V, nh, gate, h0, N, unit_k=not l2)
    wo = torch.randn(B, T, H, V, dtype=torch.float64)
    ws = torch.randn(N, H, K, V, dtype=torch.float64)
    kw = dict(num_householder=nh, chunk_size=C, cu_seqlens=cu_t, use_qk_l2norm=l2)
    ref = run("reference", ins, wo, ws, torch.float64, **kw)
    tri = run("triton", ins, wo, ws, torch.float32, **kw)
    assert tri[0].dtype == torch.float32 and tri[1].dtype == torch.float32
    for name, a, b in zip(NAMES, tri, ref):
        if b is None:
            assert a is None, name
            continue
        assert rel(a, b) < 1e-5, f"{name}: relative error {rel(a, b):.3e}"


def test_triton_no_grad_saves_nothing_and_matches():
    ins = make(1, 20, 1, 16, 16, 2, True, True, 1)
    q, k, v, beta, g, s0 = [x.requires_grad_(True) for x in ins]
    with torch.no_grad():
        o, s = chunk_deltaproduct(q, k, v, beta, g, num_householder=2, initial_state=s0, chunk_size=16,
                                  output_final_state=True, backend="triton")
    assert o.grad_fn is None and s.grad_fn is None
    o_ref, s_ref = chunk_deltaproduct(*(x.detach().double() for x in (q, k, v, beta, g)), num_householder=2,
                                      initial_state=s0.detach().double(), chunk_size=16, output_final_state=True,
                                      backend="reference")
    assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5
    # without output_final_state the state is None
    with torch.no_grad():
        _, s2 = chunk_deltaproduct(q, k, v, beta, g, num_householder=2, chunk_size=16, backend="triton")
    assert s2 is None


def test_triton_rejects_bad_chunk():
    ins = make(1, 8, 1, 16, 16, 1, False, False, 1)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_deltaproduct(*ins[:4], num_householder=1, chunk_size=48, backend="triton")


def test_triton_expanded_grads_and_empty_sequence():
    """loss = o.sum() + state.sum() hands the backward stride-0 gradients; a document may be empty."""
    cu = torch.tensor([0, 5, 5, 12])
    ins = make(1, 12, 1, 16, 16, 2, True, True, 3)
    grads = {}
    for backend, dt in (("reference", torch.float64), ("triton", torch.float32)):
        leaves = [x.clone().to(dt).requires_grad_(True) for x in ins]
        o, s = chunk_deltaproduct(*leaves[:5], num_householder=2, initial_state=leaves[5], output_final_state=True,
                                  cu_seqlens=cu, chunk_size=16, backend=backend)
        (o.sum() + s.sum()).backward()
        grads[backend] = [o.detach(), s.detach()] + [x.grad for x in leaves]
    for name, a, b in zip(NAMES, grads["triton"], grads["reference"]):
        assert rel(a, b) < 1e-5, f"{name}: {rel(a, b):.3e}"
    # the empty document passes its initial state through unchanged
    assert torch.allclose(grads["triton"][1][1], ins[5][1])


@pytest.mark.parametrize("nh", [1, 2, 3])
def test_triton_chunk64_matches_reference(nh):
    """64-row chunks (the 4x4 block merges of T, 32-token query tiles at nh >= 2): 70 gated tokens with an initial state
    are 70 / 140 / 210 rows, full chunks and a partial one; at nh = 3 the chunks start at every sub-step (r0 % 3 = 0,
    1, 2)."""
    ins = make(1, 70, 1, 16, 16, nh, True, True, 1)
    wo = torch.randn(1, 70, 1, 16, dtype=torch.float64)
    ws = torch.randn(1, 1, 16, 16, dtype=torch.float64)
    kw = dict(num_householder=nh, chunk_size=64)
    ref = run("reference", ins, wo, ws, torch.float64, **kw)
    tri = run("triton", ins, wo, ws, torch.float32, **kw)
    for name, a, b in zip(NAMES, tri, ref):
        assert rel(a, b) < 1e-5, f"{name}: relative error {rel(a, b):.3e}"
    # the no-grad forward agrees with the grad forward (same kernels, nothing saved)
    with torch.no_grad():
        o, s = chunk_deltaproduct(*[x.clone() for x in ins[:5]], initial_state=ins[5].clone(),
                                  output_final_state=True, backend="triton", **kw)
    assert rel(o, tri[0]) < 1e-6 and rel(s, tri[1]) < 1e-6


def test_launch_retries_smaller_configs_when_shared_memory_runs_out(monkeypatch):
    """A launch that needs more shared memory than the GPU has (triton raises OutOfResources before running it; seen
    on an H100 for the sequential backward at K = 256) is retried with fewer stages, then narrower V blocks (2 warps
    where 4 warps at 1 stage would be refused), with one warning; the config that fit is reused without retrying, and
    when nothing fits the first error is raised."""
    import warnings

    from triton.runtime.errors import OutOfResources

    import lm_kernels.deltaproduct.chunk as tc
    monkeypatch.setattr(tc, "interpreted", lambda: False)
    monkeypatch.setattr(tc, "_FIT", {})
    calls, budget = [], [32]

    class Kern:
        def __getitem__(self, grid):
            def run(*args, **kw):
                calls.append((grid, kw["BV"], kw["num_warps"], kw["num_stages"]))
                if kw["num_stages"] * kw["BV"] > budget[0]:
                    raise OutOfResources(kw["num_stages"] * kw["BV"], budget[0], "shared memory")
            return run

    x = torch.zeros(1)
    grid = lambda m: (256 // m["BV"],)  # noqa: E731
    with pytest.warns(UserWarning, match="shared memory"):
        tc._launch(Kern(), "bwd_state", grid, (x,), {"BV": 64})  # BASE: 4 warps, 2 stages
    assert calls == [((4,), 64, 4, 2), ((4,), 64, 4, 1), ((8,), 32, 4, 2), ((8,), 32, 2, 1)]
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tc._launch(Kern(), "bwd_state", grid, (x,), {"BV": 64})
    assert calls == [((8,), 32, 2, 1)]
    budget[0] = 8
    with pytest.raises(OutOfResources):
        tc._launch(Kern(), "main", (1,), (x,), {})  # BV 32 at 8 warps, 4 stages: nothing down to BV 8 fits
    assert calls[-1] == ((1,), 16, 8, 1)


def test_float32_wide_key_heads_run_32_row_chunks_on_gpu():
    """The GPU kernels run 32-row chunks for float32 inputs with key heads over 64 (their 64-row backward does not fit
    in shared memory), with a warning; bf16 inputs, small heads, smaller chunks and CPU runs keep the chunk asked for."""
    import warnings

    import lm_kernels.deltaproduct.chunk as tc
    with pytest.warns(UserWarning, match="32-row chunks"):
        assert tc._fitting_chunk(64, torch.float32, 128, True) == 32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tc._fitting_chunk(64, torch.bfloat16, 256, True) == 64
        assert tc._fitting_chunk(64, torch.float32, 64, True) == 64
        assert tc._fitting_chunk(16, torch.float32, 128, True) == 16
        assert tc._fitting_chunk(64, torch.float32, 128, False) == 64


@pytest.mark.parametrize("nh", [1, 2])
def test_triton_bf16_under_the_interpreter(nh):
    """bf16 inputs on CPU: the interpreter's bf16 tl.dot is wrong (triton 3.6 - 3.9), so the op computes in float32
    there; outputs and gradients come back in their inputs' dtypes and match the float64 reference in the bf16 band
    (before the fix, o was off by ~1e10)."""
    ins = make(1, 40, 2, 32, 32, nh, True, True, 1)
    wo = torch.randn(1, 40, 2, 32, dtype=torch.float64)
    ws = torch.randn(1, 2, 32, 32, dtype=torch.float64)
    ref = run("reference", ins, wo, ws, torch.float64, num_householder=nh, chunk_size=32)
    leaves = [x.clone().to(torch.bfloat16).requires_grad_(True) for x in ins[:4]]
    g = ins[4].clone().requires_grad_(True)
    s0 = ins[5].clone().requires_grad_(True)
    o, s = chunk_deltaproduct(*leaves, g, initial_state=s0, output_final_state=True, num_householder=nh,
                              chunk_size=32, backend="triton")
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    ((o.double() * wo).sum() + (s.double() * ws).sum()).backward()
    tri = [o, s] + [x.grad for x in leaves] + [g.grad, s0.grad]
    for name, a, b in zip(NAMES, tri, ref):
        assert a.dtype == (torch.bfloat16 if name in ("o", "dq", "dk", "dv", "dbeta") else torch.float32), name
        assert rel(a.detach(), b) < 2e-2, f"{name}: relative error {rel(a.detach(), b):.3e}"


@pytest.mark.parametrize("nh,split,cu", [(1, True, None), (2, True, [0, 13, 45]), (3, True, None), (2, False, [0, 13, 45])],
                         ids=["nh1", "nh2-varlen", "nh3", "nh2-one-kernel-varlen"])
def test_triton_backward_forms_match_reference(nh, split, cu, monkeypatch):
    """The backward of key heads of two or more K slices (the state loop on K slices, then the WY terms) with two
    16-wide slices of 32-wide key heads (SPLIT_BK lowered from 64), so that dk, dW and the gate gradient are assembled
    from both slices; and the one-kernel backward of one-slice heads: 64-row chunks, gated, with initial states, packed
    sequences at nh = 2."""
    import lm_kernels.deltaproduct.chunk as tc
    if split:
        monkeypatch.setattr(tc, "SPLIT_BK", 16)
    N = 2 if cu else 1
    ins = make(1, 45, 2, 32, 16, nh, True, True, N)
    wo = torch.randn(1, 45, 2, 16, dtype=torch.float64)
    ws = torch.randn(N, 2, 32, 16, dtype=torch.float64)
    kw = dict(num_householder=nh, chunk_size=64, cu_seqlens=torch.tensor(cu) if cu else None)
    ref = run("reference", ins, wo, ws, torch.float64, **kw)
    tri = run("triton", ins, wo, ws, torch.float32, **kw)
    for name, a, b in zip(NAMES, tri, ref):
        assert rel(a, b) < 1e-5, f"{name}: relative error {rel(a, b):.3e}"


@pytest.mark.parametrize("layout", ["contiguous", "projection-view", "d48", "rows-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_l2norm_matches_torch(layout, dtype):
    """The op's q / k L2 norm kernels (l2norm.py) against the PyTorch form in float64, forward and backward: a
    contiguous (B, T, H, D) tensor, a strided view of a fused projection (as the mixer's q), a head size that is not a
    power of two, and a 2-d input (copied to rows)."""
    from lm_kernels.deltaproduct._common import l2norm
    from lm_kernels.deltaproduct.l2norm import l2norm_triton
    torch.manual_seed(0)
    if layout == "projection-view":
        proj = torch.randn(2, 7, 3 * 32 + 10, dtype=torch.float64)
        make_x = lambda p: p[..., 5:5 + 3 * 32].reshape(2, 7, 3, 32)  # noqa: E731
        base = proj
    else:
        shape = {"contiguous": (2, 7, 3, 32), "d48": (3, 5, 2, 48), "rows-only": (9, 16)}[layout]
        base = torch.randn(*shape, dtype=torch.float64) * 3
        make_x = lambda p: p  # noqa: E731
    dy = torch.randn(make_x(base).shape, dtype=torch.float64)
    ref_in = base.clone().requires_grad_(True)
    ref = l2norm(make_x(ref_in))
    (ref * dy).sum().backward()
    tri_in = base.to(dtype).requires_grad_(True)
    x = make_x(tri_in)
    assert layout != "projection-view" or not x.is_contiguous()
    out = l2norm_triton(x)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    (out.double() * dy).sum().backward()
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert rel(out, ref) < tol
    assert rel(tri_in.grad, ref_in.grad) < tol
    with torch.no_grad():  # the no-grad path (no autograd node) gives the same output
        assert torch.equal(l2norm_triton(make_x(base.to(dtype))), out.detach())


@pytest.mark.parametrize("nh,K,V,gate,l2,dtype", [(1, 32, 16, False, False, torch.float32),
                                                 (2, 32, 16, True, True, torch.float32),
                                                 (3, 48, 20, True, False, torch.float32),
                                                 (2, 64, 160, True, True, torch.float16)],
                         ids=["nh1", "nh2-gated-l2", "nh3-K48-V20-gated", "nh2-fp16-l2-V160"])
def test_triton_decode_step_matches_reference(nh, K, V, gate, l2, dtype):
    """The one-kernel decode step (step.py) against the PyTorch step in float64: several sub-steps, decay,
    the in-kernel L2 norm, head sizes that are not powers of two (masked tiles over several V blocks), three steps
    chained; the input state is left untouched and the new state is float32."""
    from lm_kernels.deltaproduct import deltaproduct_step
    torch.manual_seed(1)
    b, h = 2, 3
    S64 = torch.randn(b, h, K, V, dtype=torch.float64) * 0.3
    S_tri = S64.float()
    S_ref = S64
    for _ in range(3):
        q = torch.randn(b, h, K, dtype=torch.float64)
        k = torch.randn(b, nh, h, K, dtype=torch.float64)
        if not l2:
            k = F.normalize(k, dim=-1)
        v = torch.randn(b, nh, h, V, dtype=torch.float64)
        beta = torch.rand(b, nh, h, dtype=torch.float64) * 2
        g = -torch.rand(b, h, dtype=torch.float64) * 0.5 if gate else None
        o_ref, S_ref = deltaproduct_step(S_ref, q, k, v, beta, g, use_qk_l2norm=l2, backend="reference")
        before = S_tri.clone()
        o_tri, S_new = deltaproduct_step(S_tri, q.to(dtype), k.to(dtype), v.to(dtype), beta.float(),
                                         g.float() if g is not None else None, use_qk_l2norm=l2, backend="triton")
        assert torch.equal(S_tri, before)
        assert S_new.dtype == torch.float32 and o_tri.dtype == dtype
        S_tri = S_new
        tol = 1e-5 if dtype == torch.float32 else 5e-3
        assert rel(o_tri, o_ref) < tol, rel(o_tri, o_ref)
        assert rel(S_tri, S_ref) < tol, rel(S_tri, S_ref)


def test_triton_decode_step_refuses_float64():
    from lm_kernels.deltaproduct import deltaproduct_step
    S = torch.zeros(1, 1, 16, 16, dtype=torch.float64)
    x = torch.zeros(1, 1, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        deltaproduct_step(S, x, x[:, None], x[:, None], torch.zeros(1, 1, 1, dtype=torch.float64), backend="triton")


def test_triton_decode_step_empty_batch():
    from lm_kernels.deltaproduct import deltaproduct_step
    S = torch.zeros(0, 2, 16, 8)
    o, S_new = deltaproduct_step(S, torch.zeros(0, 2, 16), torch.zeros(0, 2, 2, 16), torch.zeros(0, 2, 2, 8),
                                 torch.zeros(0, 2, 2), backend="triton")
    assert o.shape == (0, 2, 8) and S_new.shape == (0, 2, 16, 8)


def _launch_parts(ins, nh, chunk, cu):
    """The op's flattened inputs and launch metadata (as chunk_deltaproduct_triton builds them)."""
    import lm_kernels.deltaproduct.chunk as tc
    q, k, v, beta, g, h0 = ins
    B, T, H, K = q.shape
    cu_tok = tuple(range(0, B * T + 1, T)) if cu is None else tuple(cu)
    cseq, crow, coff, NT, cu_rows = tc._tables(cu_tok, nh, chunk, q.device)
    meta = dict(nh=nh, BT=chunk, scale=K ** -0.5, output_final=True, cseq=cseq, crow=crow, coff=coff, NT=NT,
                N=len(cu_tok) - 1, cu_rows=cu_rows)
    q, k, v = (x.reshape(1, -1, H, x.shape[-1]).contiguous() for x in (q, k, v))
    beta = beta.reshape(1, -1, H).contiguous()
    g = g.reshape(1, -1, H).contiguous() if g is not None else None
    return (q, k, v, beta, g, h0), meta


def check_recompute_is_the_saving_forward(ins, nh, chunk, cu=None):
    """What the backward recomputes (W by the prep with W_ONLY; the chunk states, Vn and at nh = 1 Aqk^T by the
    sequential forward with SAVE, without the output) equals, bit for bit, what one forward pass that also stores
    them gives (the prep, then the sequential forward with OUT and SAVE: the forward with grad before the backward
    recomputed them); the forward's own output and final state equal that pass's."""
    import lm_kernels.deltaproduct.chunk as tc
    (q, k, v, beta, g, h0), meta = _launch_parts(ins, nh, chunk, cu)
    L, H, K, V, BK, BV, BQ, prec = tc._sizes(k, v, meta)
    gc = torch.empty(1, L, H, dtype=torch.float32, device=k.device)
    Tm = torch.empty(1, L, H, chunk, dtype=k.dtype, device=k.device)
    aqk = torch.empty(meta["NT"], H, BQ, chunk, dtype=k.dtype, device=k.device) if nh >= 2 else None
    w = tc._prep(q, k, beta, g, gc, Tm, aqk, meta, w_only=False)
    o1, ht1, hs1, vn1, aqkt1 = tc._sequential(q, k, v, beta, h0, gc, Tm, w, aqk, meta, out=True, save=True, final=True)
    o, ht, (gc2, Tm2) = tc._fwd(q, k, v, beta, g, h0, meta)
    # T's entries above each chunk's diagonal are never written (torch.empty: whatever the memory held), so T is
    # compared through what is made of it: W below, rebuilt from the forward's T, equals the one-pass W
    assert torch.equal(gc2, gc)
    assert torch.equal(o, o1) and torch.equal(ht, ht1)
    w2, hs2, vn2, aqkt2 = tc._recompute(q, k, v, beta, h0, gc2, Tm2, meta)
    assert torch.equal(w2, w) and torch.equal(hs2, hs1) and torch.equal(vn2, vn1)
    assert (aqkt2 is None) == (aqkt1 is None) == (nh >= 2)
    if aqkt1 is not None:
        assert torch.equal(aqkt2, aqkt1)


@pytest.mark.parametrize("nh,gate,h0,cu", [(1, True, True, None), (2, False, False, None), (2, True, True, [0, 9, 30]),
                                           (3, True, False, [0, 17, 30])], ids=["nh1", "nh2-plain", "nh2-varlen",
                                                                                "nh3-varlen"])
def test_triton_backward_recompute_is_the_saving_forward(nh, gate, h0, cu):
    N = len(cu) - 1 if cu else 1
    ins = make(1, 30, 2, 16, 16, nh, gate, h0, N)
    check_recompute_is_the_saving_forward(ins, nh, 16, cu)


@pytest.mark.parametrize("nh", [1, 2])
def test_triton_saves_the_inputs_gc_and_T_only(nh):
    """The op keeps its inputs, the gate cumsum gc (L H float32) and T (L H chunk, k's dtype) for the backward; W,
    Vn and the chunk states (the bulk: n_h H K V / chunk per token) are recomputed there."""
    B, T, H, K, V, C = 2, 20, 2, 16, 16, 16
    leaves = [x.requires_grad_(True) for x in make(B, T, H, K, V, nh, True, True, B)]
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, s = chunk_deltaproduct(*leaves[:5], initial_state=leaves[5], output_final_state=True, num_householder=nh,
                                  chunk_size=C, backend="triton")
    inputs = sum(x.numel() * x.element_size() for x in leaves)
    L = B * T * nh
    assert sum(saved.values()) == inputs + L * H * 4 + L * H * C * 4
    (o.sum() + s.sum()).backward()
