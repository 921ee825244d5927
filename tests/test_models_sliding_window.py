"""Sliding-window attention (lm_llama's `sliding_window`, the hybrids' attention settings), CPU: the mixer against a
plain masked reference in float64 (training path, packed documents, GQA, windows shorter and longer than the
sequence), cached generation (dynamic and static cache, explicit and implicit) equal to full forwards once the
sequence outgrows the window, left padding, and the FLOPs of a window."""
from __future__ import annotations

import math

import pytest
import torch
from model_checks import assert_incremental_equals_full, greedy_by_full_forward
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.models import LMCache, LMHybridConfig, LMLlamaConfig
from lm.models.layers import apply_rotary, rotary_cos_sin
from lm.models.llama import Attention, causal_mask
from lm.models.presets import flops_per_token

V = 64


def reference_attention(mixer: Attention, x: torch.Tensor, window: int | None, pos=None) -> torch.Tensor:
    """The mixer's output by the textbook formula: softmax(q k^T / sqrt(d) + mask) v with mask -inf where key j is
    not in (i - window, i] (positions `pos`, default 0..t-1)."""
    b, t, _ = x.shape
    hd, nh, nkv = mixer.head_dim, mixer.n_heads, mixer.n_kv
    q, k, v = mixer.qkv_proj(x).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, k, v = (u.view(b, t, -1, hd).transpose(1, 2) for u in (q, k, v))
    pos = torch.arange(t) if pos is None else pos
    cos, sin = rotary_cos_sin(pos, hd, mixer.rope_theta, x.dtype)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    i, j = pos[:, None], pos[None, :]
    allowed = (j <= i) & ((j > i - window) if window is not None else True)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    o = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
    return mixer.o_proj(o.transpose(1, 2).reshape(b, t, nh * hd))


def attention(window, kv=2, seed=0):
    torch.manual_seed(seed)
    cfg = LMLlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=kv, sliding_window=window)
    return Attention(cfg, 0).double()


@pytest.mark.parametrize("window,t", [(1, 9), (4, 17), (7, 7), (16, 9), (None, 13)])
@pytest.mark.parametrize("kv", [4, 2])
def test_window_attention_equals_masked_reference(window, t, kv):
    """The training forward (the banded mask from shared_inputs, as the model passes it) against the formula."""
    mixer = attention(window, kv)
    x = torch.randn(2, t, 32, dtype=torch.float64)
    shared = mixer.shared_inputs(t, None, x.device)
    assert ("attn_mask" in shared) == (window is not None and t > window)
    torch.testing.assert_close(mixer(x, **shared), reference_attention(mixer, x, window), rtol=1e-12, atol=1e-12)
    # without the model's shared inputs (the mixer on its own) the same
    torch.testing.assert_close(mixer(x), reference_attention(mixer, x, window), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [3, 8, None])
def test_window_attention_packed_equals_each_document(window):
    """Packed documents: the window stays inside each document, positions restart at each."""
    mixer = attention(window)
    lens = [5, 11, 1, 9]
    x = torch.randn(1, sum(lens), 32, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    out = mixer(x, cu_seqlens=cu, **mixer.shared_inputs(x.shape[1], cu, x.device, max_seqlen=max(lens)))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        torch.testing.assert_close(out[:, a:b], reference_attention(mixer, x[:, a:b], window), rtol=1e-12,
                                   atol=1e-12)


def test_causal_mask_band():
    m = causal_mask(3, 6, 2, "cpu")  # the last 3 of 6 keys are new; each sees itself and one before
    assert m.tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]
    assert torch.equal(causal_mask(4, 4, None, "cpu"), torch.ones(4, 4, dtype=torch.bool).tril())


def llama(window, implicit=None, seed=0, **over):
    torch.manual_seed(seed)
    cfg = LMLlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=64, sliding_window=window, implicit=implicit,
                        initializer_range=0.2, **over)
    return AutoModelForCausalLM.from_config(cfg).eval()


def test_window_changes_the_function_past_the_window():
    """The window is not a no-op: logits equal full attention's up to position window - 1, differ after."""
    full, win = llama(None), llama(5)
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        a, b = full(ids).logits, win(ids).logits
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert (a[:, 5:] - b[:, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("implicit", [None, dict(max_iter=3, tol=None)], ids=["explicit", "implicit"])
def test_window_generation_equals_full_forwards(implicit):
    """Prompt 7, window 4, 10 new tokens: the dynamic cache (eager) and the static cache (all keys in buffers, the
    step's mask banded) generate what full forwards give; explicit also chunk by chunk logits."""
    model = llama(4, implicit)
    prompt = torch.randint(1, V, (2, 7))
    ref = greedy_by_full_forward(model, prompt, 10, sequential=implicit is not None)
    for decode in ("eager", "static"):
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                                 pad_token_id=0, eos_token_id=None, prefill="sequential", decode=decode)
        assert torch.equal(out, ref), decode
    if implicit is None:
        assert_incremental_equals_full(model, vocab=V, split=9, length=16)


def test_window_left_padding_equals_alone():
    model = llama(3)
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(1, V, (n,), generator=g) for n in (6, 2, 9)]
    T = max(len(p) for p in ps)
    ids, mask = torch.zeros(len(ps), T, dtype=torch.long), torch.zeros(len(ps), T, dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    args = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    for decode in ("eager", "static"):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, decode=decode, **args)[:, T:]
            logits = model(ids, attention_mask=mask).logits
            for i, p in enumerate(ps):
                alone = model.generate(p[None], decode=decode, **args)[:, len(p):]
                assert torch.equal(out[i], alone[0]), (decode, i)
                torch.testing.assert_close(logits[i, T - len(p):], model(p[None]).logits[0], rtol=1e-4, atol=1e-4)


def test_window_in_a_hybrid_and_its_flops():
    cfg = LMHybridConfig(vocab_size=V, hidden_size=32, layer_pattern="M*", attention=dict(num_attention_heads=4,
                         sliding_window=256), mamba2=dict(d_state=8, headdim=8))
    model = AutoModelForCausalLM.from_config(cfg)
    assert model.model.layers[1].mixer.window == 256
    full = LMHybridConfig(vocab_size=V, hidden_size=32, layer_pattern="M*", attention=dict(num_attention_heads=4),
                          mamba2=dict(d_state=8, headdim=8))
    # scores and values over 256 keys (fewer for the first 255 tokens) instead of t / 2 = 1024 on average
    diff = flops_per_token(full, 2048)["forward_stack"] - flops_per_token(cfg, 2048)["forward_stack"]
    keys = (256 * 257 / 2 + (2048 - 256) * 256) / 2048
    assert diff == pytest.approx(4 * 32 * (1024 - keys))
    with pytest.raises(ValueError, match="attention.sliding_window"):
        LMHybridConfig(layer_pattern="*", attention=dict(sliding_window=0))
