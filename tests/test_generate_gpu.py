"""Generation at recurrent speed (issue 29) on CUDA: the CUDA-graph decode step gives the eager path's tokens
(greedy, explicit models of every family; implicit with a fixed iteration count), replays the static path's
logits exactly, survives decoder reuse and K/V growth, and is faster than the eager step."""
from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

import lm  # noqa: F401
from lm.models import LMCache
from lm.models import decode as D
from lm.models.presets import load_config

pytestmark = pytest.mark.gpu

V = 256
SMALL = dict(vocab_size=V, hidden_size=128, num_hidden_layers=3)
FAMILIES = {
    "llama": ("lm_llama-tiny", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)),
    "mamba2": ("lm_mamba2-tiny", dict(d_state=32, headdim=32, chunk_size=32)),
    "deltaproduct": ("lm_deltaproduct-tiny", dict(num_heads=2, head_dim=64, intermediate_size=256, chunk_size=32)),
    "deltaproduct_gated": ("lm_deltaproduct-tiny", dict(num_heads=2, head_dim=64, intermediate_size=256,
                                                        chunk_size=32, use_forget_gate=True, num_householder=3)),
    "lru": ("lm_lru-tiny", dict(intermediate_size=256, chunk_size=32)),
    "bdlru": ("lm_lru-tiny-bdlru", dict(intermediate_size=256, num_states=32, block_size=4, chunk_size=32)),
}


def make(family, implicit=None, dtype=torch.float32):
    preset, kw = FAMILIES[family]
    torch.manual_seed(0)
    cfg = load_config(preset, **{**SMALL, **kw}, implicit=implicit)
    return AutoModelForCausalLM.from_config(cfg).cuda().to(dtype).eval()


def gen(model, prompt, decode, n=16, **kw):
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, eos_token_id=None, decode=decode, **kw)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_graph_decode_equals_eager_greedy(family):
    model = make(family)
    prompt = torch.randint(1, V, (3, 20), device="cuda")
    eager = gen(model, prompt, "eager")
    graph = gen(model, prompt, "graph")
    assert torch.equal(graph, eager)
    assert torch.equal(gen(model, prompt, "static"), eager)
    assert any(d.graph is not None for d in D._DECODERS[model].values()), "no graph was captured"


@pytest.mark.parametrize("family", ["mamba2", "deltaproduct", "llama"])
def test_graph_replays_the_static_steps_logits(family):
    model = make(family, dtype=torch.bfloat16)
    ids = torch.randint(1, V, (2, 24), device="cuda")
    out = {}
    with torch.no_grad():
        for mode in ("static", "graph"):
            cache = LMCache()
            model(ids[:, :16], cache=cache, use_cache=True)
            out[mode] = torch.cat([model(ids[:, i: i + 1], cache=cache, use_cache=True, decode=mode).logits
                                   for i in range(16, 24)], 1)
    assert torch.equal(out["graph"], out["static"])


@pytest.mark.parametrize("family", ["mamba2", "llama", "deltaproduct"])
def test_graph_decode_implicit_fixed_iterations_equals_eager(family):
    model = make(family, implicit=dict(max_iter=2, tol=None, eval_factor=2))
    prompt = torch.randint(1, V, (2, 12), device="cuda")
    assert torch.equal(gen(model, prompt, "graph", n=8), gen(model, prompt, "eager", n=8))


def test_graph_decode_default_on_cuda_reuse_growth_and_beams(monkeypatch):
    """decode='auto' (the default) captures on CUDA; a later call of the same batch size replays the same graph;
    K/V that outgrow their buffers are moved to larger ones and the step is captured again; beams work."""
    monkeypatch.setattr(D, "HEADROOM", 8)
    model = make("llama")
    prompt = torch.randint(1, V, (2, 10), device="cuda")
    ref = gen(model, prompt, "eager", n=40)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, min_new_tokens=40,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(out, ref)
    (dec,) = [d for k, d in D._DECODERS[model].items() if k[0] == 2]
    graph = dec.graph
    assert graph is not None and dec.cache.capacity >= 50
    assert torch.equal(gen(model, prompt, "auto", n=5), ref[:, :15])
    assert dec.graph is graph  # reused, not captured again
    assert torch.equal(gen(model, prompt, "graph", n=6, num_beams=2), gen(model, prompt, "eager", n=6, num_beams=2))


def test_graph_decode_is_faster_than_eager():
    model = make("mamba2", dtype=torch.bfloat16)
    prompt = torch.randint(1, V, (1, 32), device="cuda")
    times = {}
    for mode in ("eager", "graph"):
        gen(model, prompt, mode, n=4)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen(model, prompt, mode, n=64)
        torch.cuda.synchronize()
        times[mode] = time.perf_counter() - t0
    print(f"64 tokens: eager {times['eager'] * 1e3:.1f} ms, graph {times['graph'] * 1e3:.1f} ms")
    assert times["graph"] < 0.7 * times["eager"]


def test_decode_kernels_equal_pytorch_forms(monkeypatch):
    """The decode step's Triton kernels (the SSD step writing the cache in place, the RMSNorm forward) against their
    PyTorch forms on CUDA: the norm at Mamba2-350M's shapes (bf16, plain over 1024 and gated over 2048), and greedy
    CUDA-graph generation of a float32 Mamba2 with the kernels = with the PyTorch forms (LM_*_BACKEND=reference)."""
    from lm.models import layers
    from lm_kernels.rmsnorm import rms_norm_triton
    for d, gated in ((1024, False), (2048, True)):
        x = torch.randn(4, 1, d, device="cuda", dtype=torch.bfloat16) * 3
        z = torch.randn_like(x) if gated else None
        w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
        ref = layers._RMSNormFn.apply(x, z, w, d, 1e-5).float()
        err = ((rms_norm_triton(x, w, 1e-5, z=z).float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err
    model = make("mamba2")
    prompt = torch.randint(1, V, (2, 9), device="cuda")
    out = gen(model, prompt, "graph", n=24)
    D.release_decoders(model)
    monkeypatch.setenv("LM_SSD_BACKEND", "reference")
    monkeypatch.setenv("LM_RMSNORM_BACKEND", "reference")
    assert torch.equal(gen(model, prompt, "graph", n=24), out)


def test_llama_decode_kernels_equal_pytorch_forms(monkeypatch):
    """The Llama decode step's kernel (rotary embedding of q and k, K/V written into the static cache) against its
    PyTorch form on CUDA at Llama-350M's shapes (16 heads of 64, bf16, a 2048-slot cache, a late position; batch 4 with
    GQA), SwiGLU's silu_mul kernel at its width (2816), the residual add fused into the RMSNorm kernel (the bf16 sum bit
    for bit), and greedy CUDA-graph generation of a float32 Llama with the kernels = with the PyTorch forms."""
    from lm.models.layers import rotary_cos_sin
    from lm_kernels.rope import rope_kv_step, rope_kv_step_reference
    for b, h, hkv in ((1, 16, 16), (4, 16, 4)):
        d, cap, pos = 64, 2048, 1337
        qkv = torch.randn(b, 1, (h + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
        cos, sin = rotary_cos_sin(torch.tensor([pos], device="cuda"), d, 10000.0, torch.float32)
        kc = torch.randn(b, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        kr, vr = kc.double(), vc.double()
        p = torch.tensor([pos], device="cuda")
        q_ref = rope_kv_step_reference(qkv.double(), cos.double(), sin.double(), kr, vr, p, h, hkv)
        q = rope_kv_step(qkv, cos, sin, kc, vc, p, h, hkv, backend="triton")
        for a, r in ((q, q_ref), (kc, kr), (vc, vr)):
            err = ((a.double() - r).norm() / r.norm()).item()
            assert err < 1e-2, err
        assert torch.equal(vc[:, :, pos], vr[:, :, pos].to(vc.dtype))
    from lm_kernels.swiglu import silu_mul_triton
    g, u = (torch.randn(1, 1, 2816, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(2))
    ref = torch.nn.functional.silu(g.double()) * u.double()
    assert ((silu_mul_triton(g, u).double() - ref).norm() / ref.norm()).item() < 1e-2
    from lm_kernels.rmsnorm import rms_norm_triton
    x, h, w = g[..., :1024], u[..., :1024], torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    y, s = rms_norm_triton(x, w, 1e-5, residual=h)
    assert torch.equal(s, x + h) and torch.equal(y, rms_norm_triton(x + h, w, 1e-5))
    model = make("llama")
    prompt = torch.randint(1, V, (2, 9), device="cuda")
    for op in ("ROPE", "SWIGLU", "RMSNORM"):
        monkeypatch.setenv(f"LM_{op}_BACKEND", "triton")
    out = gen(model, prompt, "graph", n=24)
    D.release_decoders(model)
    for op in ("ROPE", "SWIGLU", "RMSNORM"):
        monkeypatch.setenv(f"LM_{op}_BACKEND", "reference")
    assert torch.equal(gen(model, prompt, "graph", n=24), out)
