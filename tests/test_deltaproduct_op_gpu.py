"""DeltaProduct Triton kernels on a GPU at real shapes: bf16 vs the float64 chunkwise reference."""
import pytest
import torch
import torch.nn.functional as F

from lm_kernels.deltaproduct import chunk_deltaproduct

pytestmark = pytest.mark.gpu

NAMES = ["o", "final_state", "dq", "dk", "dv", "dbeta", "dg", "dinitial_state"]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(backend, ins, wo, ws, dtype, **kw):
    leaves = [x.clone().to(dtype).requires_grad_(True) if x is not None else None for x in ins]
    q, k, v, beta, g, s0 = leaves
    o, s = chunk_deltaproduct(q, k, v, beta, g, initial_state=s0, output_final_state=True, backend=backend, **kw)
    ((o.double() * wo).sum() + (s.double() * ws).sum()).backward()
    return [o.detach(), s.detach()] + [x.grad if x is not None else None for x in leaves]


def make(B, T, H, K, V, nh, n_states, dtype):
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev)
    k = F.normalize(torch.randn(B, T * nh, H, K, device=dev), dim=-1)
    v = torch.randn(B, T * nh, H, V, device=dev)
    beta = torch.rand(B, T * nh, H, device=dev) * 2
    g = -torch.rand(B, T, H, device=dev) * 0.1
    s0 = torch.randn(n_states, H, K, V, device=dev) * 0.1
    return [q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype), g, s0]


def check(ins, N, nh, dtype, tol_o, tol_g, cu=None, chunk_size=64, l2=False):
    q, v = ins[0], ins[2]
    B, T, H, K = q.shape
    wo = torch.randn(B, T, H, v.shape[-1], dtype=torch.float64, device="cuda")
    ws = torch.randn(N, H, K, v.shape[-1], dtype=torch.float64, device="cuda")
    kw = dict(num_householder=nh, cu_seqlens=cu, chunk_size=chunk_size, use_qk_l2norm=l2)
    ref = run("reference", ins, wo, ws, torch.float64, **kw)
    tri = run_mixed(ins, wo, ws, dtype, **kw)
    errs = {n: rel(a, b) for n, a, b in zip(NAMES, tri, ref)}
    print(f"nh={nh} {dtype}: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items()))
    for n, a in zip(NAMES, tri):
        assert torch.isfinite(a).all(), n
    for n in ("o", "final_state"):
        assert errs[n] < tol_o, (n, errs[n])
    for n in NAMES[2:]:
        assert errs[n] < tol_g, (n, errs[n])


def run_mixed(ins, wo, ws, dtype, **kw):
    """q, k, v, beta in `dtype`; g and the initial state float32 (as the mixer passes them)."""
    leaves = []
    for i, x in enumerate(ins):
        x = x.clone().to(dtype if i < 4 else torch.float32)
        leaves.append(x.requires_grad_(True))
    q, k, v, beta, g, s0 = leaves
    o, s = chunk_deltaproduct(q, k, v, beta, g, initial_state=s0, output_final_state=True, backend="triton", **kw)
    assert o.dtype == dtype and s.dtype == torch.float32
    ((o.double() * wo).sum() + (s.double() * ws).sum()).backward()
    return [o.detach(), s.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("nh", [1, 2, 3])
def test_gpu_bf16_vs_float64(nh):
    B, T, H, K, V = 4, 512, 4, 128, 256
    ins = make(B, T, H, K, V, nh, B, torch.float32)
    check(ins, B, nh, torch.bfloat16, tol_o=1e-2, tol_g=2e-2)


def check_varlen(nh, K=128, V=128, dtype=torch.bfloat16):
    """bf16 (or `dtype`: float32 at 1e-4) vs float64 on a varlen batch of documents of 100, 1, 599 and 324 tokens
    with initial states."""
    cu = torch.tensor([0, 100, 101, 700, 1024], device="cuda")
    ins = make(1, 1024, 4, K, V, nh, 4, torch.float32)
    tol = dict(tol_o=1e-2, tol_g=2e-2) if dtype == torch.bfloat16 else dict(tol_o=1e-4, tol_g=1e-4)
    check(ins, 4, nh, dtype, cu=cu, **tol)


def test_gpu_bf16_varlen():
    check_varlen(2)


def test_gpu_fp32_vs_float64():
    ins = make(2, 300, 2, 64, 64, 3, 2, torch.float32)
    check(ins, 2, 3, torch.float32, tol_o=1e-4, tol_g=1e-4)


def test_gpu_no_grad_equals_grad_forward():
    ins = make(2, 256, 4, 128, 256, 2, 2, torch.bfloat16)
    q, k, v, beta, g, _ = ins
    with torch.no_grad():
        o1, _ = chunk_deltaproduct(q, k, v, beta, g, num_householder=2, backend="triton")
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, beta, g)]
    o2, _ = chunk_deltaproduct(*leaves, num_householder=2, backend="triton")
    assert o1.grad_fn is None and o2.grad_fn is not None
    # with or without grad the forward runs the same launches (the backward recomputes what it needs): equal outputs
    assert torch.equal(o1, o2.detach())


@pytest.mark.parametrize("nh", [1, 2, 3])
def test_gpu_backward_recompute_is_the_saving_forward(nh):
    """bf16 at the bench's head sizes, gated, packed documents with initial states: W, the chunk states, Vn and (nh =
    1) Aqk^T as the backward recomputes them (the prep with W_ONLY, the sequential forward with SAVE and without the
    output: separately compiled specializations) equal, bit for bit, those of one forward pass that stores them, so
    the gradients are those of the forward that saved them."""
    from test_deltaproduct_op_triton import check_recompute_is_the_saving_forward
    cu = [0, 100, 101, 700, 1024]
    ins = make(1, 1024, 4, 128, 256, nh, 4, torch.bfloat16)
    check_recompute_is_the_saving_forward(ins, nh, 64, cu)


@pytest.mark.parametrize("nh,chunk", [(4, 64), (1, 16)])
def test_gpu_fp32_small_heads_16_token_chunks(nh, chunk):
    """The S5 recipe's shape (12 heads of 32, nh = 4, float32 inputs as `lm synth` passes them): chunks of
    16 tokens, which crashed the backward on an H100 before token tiles got at least 32 rows."""
    ins = make(3, 160, 12, 32, 32, nh, 3, torch.float32)
    check(ins, 3, nh, torch.float32, tol_o=1e-4, tol_g=1e-4, chunk_size=chunk)



@pytest.mark.parametrize("nh", [1, 2, 3])
@pytest.mark.parametrize("K,V", [(32, 32), (64, 16)])
def test_gpu_bf16_small_heads(nh, K, V):
    """bf16 with value heads under 64 (the synthetic-task presets use head_dim 32): the sequential backward then runs
    32- / 16-wide V blocks. (Launched at one stage with 4 warps such blocks give wrong gradients or illegal addresses
    on an H100 with triton 3.6; `_launch` never falls back to that config. The defaults run 2 stages.)"""
    check_varlen(nh, K, V)


@pytest.mark.parametrize("nh", [1, 2])
@pytest.mark.parametrize("K,V", [(256, 128), (192, 64)])
def test_gpu_bf16_wide_key_heads(nh, K, V):
    """bf16 with the widest key heads the op takes (K = 256) and a K that is not a power of two (192: 256-wide tiles,
    the padding masked), on the varlen batch: the kernels' shared memory and registers grow with K."""
    check_varlen(nh, K, V)


@pytest.mark.parametrize("nh", [1, 2])
@pytest.mark.parametrize("K,V", [(128, 128), (256, 64)])
def test_gpu_fp32_wide_key_varlen(nh, K, V):
    """float32 inputs with key heads over 64 on the varlen batch: float32 tiles take twice the shared memory (the main
    backward at 64-row chunks would need 360-720 KB), so the op runs 32-row chunks for them (_fitting_chunk)."""
    with pytest.warns(UserWarning, match="32-row chunks"):
        check_varlen(nh, K, V, dtype=torch.float32)


@pytest.mark.parametrize("nh", [1, 4])
def test_gpu_bf16_varlen_split_backward(nh):
    """The backward of key heads of two K slices (the state loop on 64-wide K slices, then the WY terms) at nh = 1 and
    4: packed documents of 100, 1, 599 and 324 tokens with initial states against float64."""
    import lm_kernels.deltaproduct.chunk as tc
    assert 128 >= 2 * tc.SPLIT_BK
    check_varlen(nh)


@pytest.mark.parametrize("nh", [1, 2])
def test_gpu_bf16_qk_l2norm(nh):
    """use_qk_l2norm (the models' setting) through the Triton L2 norm kernels, bf16 vs float64, with keys of norm 3."""
    ins = make(2, 512, 4, 128, 128, nh, 2, torch.float32)
    ins[1] = ins[1] * 3
    check(ins, 2, nh, torch.bfloat16, tol_o=1e-2, tol_g=2e-2, l2=True)


def test_gpu_l2norm_kernels_bf16_vs_float64():
    """The L2 norm kernels on a strided view of a fused projection (as the mixer's q), bf16 vs float64."""
    from lm_kernels.deltaproduct._common import l2norm
    from lm_kernels.deltaproduct.l2norm import l2norm_triton
    proj = torch.randn(4, 1000, 4 * 128 + 96, device="cuda", dtype=torch.float64)
    dy = torch.randn(4, 1000, 4, 128, device="cuda", dtype=torch.float64)
    view = lambda p: p[..., 64:64 + 4 * 128].reshape(4, 1000, 4, 128)  # noqa: E731
    ref_in = proj.clone().requires_grad_(True)
    ref = l2norm(view(ref_in))
    (ref * dy).sum().backward()
    tri_in = proj.to(torch.bfloat16).requires_grad_(True)
    out = l2norm_triton(view(tri_in))
    (out.double() * dy).sum().backward()
    assert rel(out, ref) < 1e-2 and rel(tri_in.grad, ref_in.grad) < 1e-2, (rel(out, ref), rel(tri_in.grad, ref_in.grad))


@pytest.mark.parametrize("nh", [1, 2, 3])
def test_gpu_decode_step_bf16_vs_float64(nh):
    """The one-kernel decode step (step.py), four chained steps at K 128, V 256, gated, with the L2 norm,
    bf16 q / k / v against the float64 PyTorch step."""
    from lm_kernels.deltaproduct import deltaproduct_step
    b, h, K, V = 4, 8, 128, 256
    S = torch.randn(b, h, K, V, device="cuda", dtype=torch.float64) * 0.1
    S_ref, S_tri = S, S.float()
    for _ in range(4):
        q = torch.randn(b, h, K, device="cuda", dtype=torch.float64)
        k = torch.randn(b, nh, h, K, device="cuda", dtype=torch.float64)
        v = torch.randn(b, nh, h, V, device="cuda", dtype=torch.float64)
        beta = torch.rand(b, nh, h, device="cuda", dtype=torch.float64) * 2
        g = -torch.rand(b, h, device="cuda", dtype=torch.float64) * 0.1
        o_ref, S_ref = deltaproduct_step(S_ref, q, k, v, beta, g, use_qk_l2norm=True, backend="reference")
        o, S_tri = deltaproduct_step(S_tri, q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.float(), g.float(),
                                     use_qk_l2norm=True)
        assert o.dtype == torch.bfloat16 and S_tri.dtype == torch.float32
        assert rel(o, o_ref) < 1e-2 and rel(S_tri, S_ref) < 1e-2, (rel(o, o_ref), rel(S_tri, S_ref))


def test_gpu_prefill_then_decode_steps_equal_the_chunk_forward():
    """Generation's path: the chunk kernels over a prefix (final state out), then Triton decode steps, give the
    outputs and final state of the chunk kernels over the whole sequence (bf16, nh = 2, gated, L2 norm)."""
    from lm_kernels.deltaproduct import deltaproduct_step
    nh, B, T0, T1, H, K, V = 2, 2, 100, 4, 4, 128, 128
    q, k, v, beta, g, _ = make(B, T0 + T1, H, K, V, nh, B, torch.bfloat16)
    beta = beta.float()
    o_all, s_all = chunk_deltaproduct(q, k, v, beta, g, num_householder=nh, use_qk_l2norm=True,
                                      output_final_state=True)
    _, s = chunk_deltaproduct(q[:, :T0], k[:, :T0 * nh], v[:, :T0 * nh], beta[:, :T0 * nh], g[:, :T0],
                              num_householder=nh, use_qk_l2norm=True, output_final_state=True)
    for t in range(T0, T0 + T1):
        rows = slice(t * nh, (t + 1) * nh)
        o, s = deltaproduct_step(s, q[:, t], k[:, rows], v[:, rows], beta[:, rows], g[:, t],
                                 use_qk_l2norm=True)
        assert rel(o, o_all[:, t]) < 2e-2, (t, rel(o, o_all[:, t]))
    assert rel(s, s_all) < 2e-2
