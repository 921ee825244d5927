"""`lm convert` for fla's hybrid GatedDeltaProduct (its `attn` spec: some layers standard attention) <-> `lm_hybrid`,
CPU, float32: the converted model gives fla's logits, and converting back gives fla's state dict bit for bit; an
lm_hybrid of DeltaProduct and attention layers goes to fla and gives the same logits there; what fla cannot hold is
refused.

fla's model runs here as in tests/test_convert_fla.py (its Triton pieces swapped for PyTorch), and its attention's
flash-attn call (flash_attn is not installed on CPU) and Triton rotary kernel by their plain definitions: causal
softmax attention over the keys in the window (flash-attn's window_size = (w - 1, 0)), and fla's own
`rotary_embedding_ref` on the tables fla made."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

fla = pytest.importorskip("fla", reason="flash-linear-attention is not installed (pip install 'lm[fla]')")

from safetensors.torch import load_file  # noqa: E402
from test_convert_fla import VOCAB, _fla_logits, _fla_model, fla_on_cpu  # noqa: E402,F401
from transformers import AutoModelForCausalLM  # noqa: E402

import lm  # noqa: E402,F401
from lm.cli import main as lm_main  # noqa: E402
from lm.convert import fla as conv  # noqa: E402
from lm.models import LMHybridConfig, LMHybridForCausalLM  # noqa: E402


def _flash_attn_func(q, k, v, causal=True, window_size=(-1, -1), **_):
    """flash-attn's flash_attn_func on (b, t, h, d) tensors, by the formula (causal, GQA, left window)."""
    assert causal
    t, s, h = q.shape[1], k.shape[1], q.shape[2]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    kh, vh = kh.repeat_interleave(h // kh.shape[1], 1), vh.repeat_interleave(h // vh.shape[1], 1)
    i, j = torch.arange(s - t, s)[:, None], torch.arange(s)[None, :]
    seen = j <= i
    if window_size[0] >= 0:
        seen &= j >= i - window_size[0]
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen).transpose(1, 2)


@pytest.fixture
def fla_hybrid_on_cpu(fla_on_cpu, monkeypatch):
    import fla.layers.attn as attn_mod
    import fla.modules.rotary.ops as rot
    from fla.modules.rotary.ops import rotary_embedding_ref

    def rotary(x, cos, sin, interleaved=False, seqlen_offsets=0, cu_seqlens=None, **_):
        assert cu_seqlens is None and isinstance(seqlen_offsets, int)
        t = x.shape[1]
        return rotary_embedding_ref(x, cos[seqlen_offsets:seqlen_offsets + t], sin[seqlen_offsets:seqlen_offsets + t],
                                    interleaved)

    monkeypatch.setattr(attn_mod, "flash_attn_func", _flash_attn_func)
    monkeypatch.setattr(rot, "rotary_embedding", rotary)


ATTN = {
    "gqa_window_bias": dict(layers=[1, 3], num_heads=4, num_kv_heads=2, window_size=5, qkv_bias=True,
                            rope_theta=50000.0),
    "full_list": [dict(layers=[0], num_heads=2), dict(layers=[2], num_heads=2)],
}


@pytest.mark.parametrize("case", sorted(ATTN))
def test_from_fla_hybrid_same_logits_and_back_bit_for_bit(fla_hybrid_on_cpu, tmp_path, case):
    model = _fla_model(num_hidden_layers=4, attn=ATTN[case])
    src = tmp_path / "fla"
    model.save_pretrained(src)
    ids = torch.randint(0, VOCAB, (2, 21))
    ref = _fla_logits(model, ids)

    out, _ = conv.from_fla(src, tmp_path / "lm")
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg = ours.config
    assert cfg.model_type == "lm_hybrid" and set(cfg.mlp_kinds) == {"attention", "deltaproduct"}
    assert cfg.layer_pattern == {"gqa_window_bias": "D*D*", "full_list": "*D*D"}[case]
    a = cfg.kind_config("attention")
    spec = ATTN[case] if isinstance(ATTN[case], dict) else ATTN[case][0]
    assert a.num_attention_heads == spec["num_heads"] and a.sliding_window == spec.get("window_size")
    with torch.no_grad():
        got = ours(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)

    back, _ = conv.to_fla(out, tmp_path / "back")
    x, y = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(x) == sorted(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k
    again = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32, fuse_norm=False, fuse_swiglu=False).eval()
    assert again.config.attn["layers"] == [i for i, c in enumerate(cfg.layer_pattern) if c == "*"]
    torch.testing.assert_close(_fla_logits(again, ids), ref, rtol=0, atol=0)


def _lm_hybrid(pattern="D*DD*", **attention):
    torch.manual_seed(0)
    cfg = LMHybridConfig(vocab_size=VOCAB, hidden_size=32, layer_pattern=pattern, intermediate_size=64,
                         mlp_kinds=["attention", "deltaproduct"], rms_norm_eps=1e-6,
                         deltaproduct=dict(num_heads=2, head_dim=16, expand_v=2.0, num_householder=2,
                                           use_forget_gate=True, use_output_gate=True, chunk_size=16),
                         attention=dict(num_attention_heads=4, num_key_value_heads=2, **attention))
    return LMHybridForCausalLM(cfg).eval()


def test_from_lm_hybrid_to_fla_same_logits(fla_hybrid_on_cpu, tmp_path):
    ours = _lm_hybrid(sliding_window=4, rope_theta=1000.0)
    ours.save_pretrained(tmp_path / "lm")
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        ref = ours(ids).logits
    out, dropped = conv.to_fla(tmp_path / "lm", tmp_path / "fla")
    assert "chunk_size" in dropped
    fla_cfg = json.loads((out / "config.json").read_text())
    assert fla_cfg["attn"] == {"layers": [1, 4], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": False,
                               "window_size": 4, "rope_theta": 1000.0}
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, fuse_norm=False, fuse_swiglu=False)
    torch.testing.assert_close(_fla_logits(theirs.eval(), ids), ref, rtol=1e-4, atol=1e-4)


def test_cli_names_the_hybrid(fla_hybrid_on_cpu, tmp_path, capsys):
    _fla_model(num_hidden_layers=2, attn=dict(layers=[1], num_heads=2)).save_pretrained(tmp_path / "fla")
    assert lm_main(["convert", "--from", "fla", str(tmp_path / "fla"), "--output", str(tmp_path / "lm")]) == 0
    assert "wrote lm_hybrid model" in capsys.readouterr().out


def test_what_fla_cannot_hold_is_refused(tmp_path):
    def refused(model, match):
        folder = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        model.save_pretrained(folder)
        with pytest.raises(ValueError, match=match):
            conv.to_fla(folder, tmp_path / "out")
        assert not (tmp_path / "out").exists()

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, attention=dict(num_attention_heads=4),
                 mamba2=dict(d_state=8, headdim=8), deltaproduct=dict(num_heads=2))
    refused(LMHybridForCausalLM(LMHybridConfig(layer_pattern="M*", **small)), r"layer_pattern: .*\['mamba2'\]")
    refused(LMHybridForCausalLM(LMHybridConfig(layer_pattern="D*", mlp_kinds=["attention"], **small)),
            r"mlp_kinds: .*\['deltaproduct'\]")
    refused(LMHybridForCausalLM(LMHybridConfig(layer_pattern="D*", mlp_kinds=["attention", "deltaproduct"],
                                               **{**small, "attention": dict(num_attention_heads=4, head_dim=16)})),
            "attention.head_dim")
    refused(LMHybridForCausalLM(LMHybridConfig(layer_pattern="D*", mlp_kinds=["attention", "deltaproduct"],
                                               implicit=dict(max_iter=2), **small)), "^implicit: ")
