"""Llama's one-token decode step kernel (lm_kernels/rope/triton_rope.py, under TRITON_INTERPRET=1 on CPU): the rotary
embedding of q and k and the write of k and v into a static cache, against its PyTorch form (rope_kv_step_reference)
in float64, for GQA and full heads, head_dim not a power of two, batch > 1, positions > 0 and a strided projection;
and greedy generation through the static decoder with the kernels (this one, SwiGLU's silu_mul, the RMSNorm with its
fused residual add) = with the PyTorch forms (explicit and implicit Llama, the implicit one's frozen iterations
rewriting the same slot)."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import lm  # noqa: F401
import lm_kernels.rope as rope_mod
from lm.models import decode as Dec
from lm.models.layers import rotary_cos_sin
from lm.models.presets import load_config
from lm_kernels.rope import rope_kv_step, rope_kv_step_reference

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("fast_interpreter")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def inputs(b, h, hkv, d, cap, pos, dtype, strided=False):
    c = (h + 2 * hkv) * d
    qkv = torch.randn(b, 1, 2 * c if strided else c, dtype=torch.float64)
    qkv = (qkv[..., ::2] if strided else qkv).to(dtype)  # strided: a view with channel stride 2
    cos, sin = rotary_cos_sin(torch.tensor([pos]), d, 10000.0, torch.float32)
    kc = torch.randn(b, hkv, cap, d, dtype=torch.float64).to(dtype)
    return qkv, cos, sin, kc, torch.randn_like(kc), torch.tensor([pos])


@pytest.mark.parametrize("b,h,hkv,d,pos", [(1, 4, 4, 16, 0), (3, 4, 2, 12, 5), (2, 6, 1, 10, 37), (1, 2, 2, 64, 63)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(b, h, hkv, d, pos, dtype):
    qkv, cos, sin, kc, vc, p = inputs(b, h, hkv, d, 64, pos, dtype, strided=(b == 3))
    kc_ref, vc_ref = kc.double(), vc.double()
    q_ref = rope_kv_step_reference(qkv.double(), cos.double(), sin.double(), kc_ref, vc_ref, p, h, hkv)
    q = rope_kv_step(qkv, cos, sin, kc, vc, p, h, hkv, backend="triton")
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert q.shape == (b, h, 1, d) and q.dtype == dtype
    assert rel(q, q_ref) < tol
    assert rel(kc[:, :, pos], kc_ref[:, :, pos]) < tol
    assert torch.equal(vc[:, :, pos], vc_ref[:, :, pos].to(dtype))  # v is copied, not computed
    others = [i for i in range(64) if i != pos]  # every other slot is left as it was
    assert torch.equal(kc[:, :, others], kc_ref[:, :, others].to(dtype))
    assert torch.equal(vc[:, :, others], vc_ref[:, :, others].to(dtype))


def test_backend_choice_and_errors(monkeypatch):
    qkv, cos, sin, kc, vc, p = inputs(1, 2, 2, 8, 8, 3, torch.float64)
    with pytest.raises(ValueError, match="float64"):
        rope_kv_step(qkv, cos, sin, kc, vc, p, 2, 2, backend="triton")
    q = rope_kv_step(qkv, cos, sin, kc, vc, p, 2, 2)  # automatic on CPU: the reference
    assert q.dtype == torch.float64
    with pytest.raises(ValueError, match="channels"):
        rope_kv_step(qkv, cos, sin, kc, vc, p, 4, 2)
    monkeypatch.setenv("LM_ROPE_BACKEND", "nope")
    with pytest.raises(ValueError, match="LM_ROPE_BACKEND"):
        rope_kv_step(qkv.float(), cos, sin, kc.float(), vc.float(), p, 2, 2)


def _generate(model, prompt, backend, monkeypatch):
    calls = []
    with monkeypatch.context() as m:
        m.setenv("LM_ROPE_BACKEND", backend)
        m.setenv("LM_SWIGLU_BACKEND", backend)
        m.setenv("LM_RMSNORM_BACKEND", backend)
        m.setattr(rope_mod, "_triton", lambda *a: (calls.append(1), _orig_triton(*a))[1])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), decode="static", max_new_tokens=8,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
    Dec.release_decoders(model)
    return out, len(calls)


_orig_triton = rope_mod._triton


@pytest.mark.parametrize("implicit", [None, dict(max_iter=2, tol=None, eval_factor=2)])
def test_static_decode_with_kernel_equals_reference(implicit, monkeypatch):
    torch.manual_seed(0)
    cfg = load_config("lm_llama-tiny", vocab_size=64, hidden_size=36, num_hidden_layers=2, num_attention_heads=3,
                      num_key_value_heads=1, intermediate_size=64, implicit=implicit)  # head_dim 12, GQA
    model = AutoModelForCausalLM.from_config(cfg).eval()
    prompt = torch.randint(1, 64, (2, 5))
    ref, n_ref = _generate(model, prompt, "reference", monkeypatch)
    out, n = _generate(model, prompt, "triton", monkeypatch)
    assert n_ref == 0 and n > 0
    assert torch.equal(out, ref)
