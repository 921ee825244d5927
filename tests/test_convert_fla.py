"""`lm convert --from fla / --to fla` on CPU: an fla GatedDeltaProduct model and its lm conversion give the
same logits (float32), and converting back gives fla's state dict bit for bit; bad input is refused with
nothing written.

fla's model classes run here with its Triton pieces swapped for PyTorch (fla's kernels are GPU-only): the
DeltaProduct op by fla's own naive recurrence (`naive_recurrent_gated_delta_product`, after fla's in-kernel
q/k L2 norm), its RMSNorm by fla's `rms_norm_ref`, and the short conv, gated norm and SwiGLU by their plain
definitions. What this checks is what conversion is about: parameter names and cuts, config names, block
wiring. tests/test_convert_fla_gpu.py runs fla's own kernels.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

fla = pytest.importorskip("fla", reason="flash-linear-attention is not installed (pip install 'lm[fla]')")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import lm  # noqa: E402,F401
from lm.cli import main as lm_main  # noqa: E402
from lm.convert import fla as conv  # noqa: E402

VOCAB = 97


def _l2norm(x, eps=1e-6):  # fla's l2norm_fwd: x / sqrt(sum x^2 + eps)
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.fixture
def fla_on_cpu(monkeypatch):
    """Run fla's GatedDeltaProduct model classes on CPU (see the module docstring)."""
    import fla.layers.gated_deltaproduct as layer_mod
    import fla.modules.mlp as mlp_mod
    from fla.modules import FusedRMSNormGated, RMSNorm, ShortConvolution
    from fla.modules.norm.layernorm import rms_norm_ref
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product

    def op(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, num_householder=1,
           use_qk_l2norm_in_kernel=False, scale=None, **_):
        if use_qk_l2norm_in_kernel:
            q, k = _l2norm(q), _l2norm(k)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return naive_recurrent_gated_delta_product(q, k, v, g, beta, scale, cu_seqlens=cu_seqlens,
                                                   initial_state=initial_state, num_householder=num_householder)

    def conv_forward(self, x, residual=None, mask=None, cache=None, output_final_state=False, cu_seqlens=None,
                     **_):
        assert cu_seqlens is None and cache is None
        w = self.weight.shape[-1]
        y = F.conv1d(x.transpose(1, 2), self.weight, self.bias, padding=w - 1, groups=x.shape[-1])[..., :x.shape[1]]
        y = y.transpose(1, 2)
        return (F.silu(y) if self.activation in ("silu", "swish") else y), None

    def gated_norm_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * F.silu(g.float())).to(x.dtype)

    def norm_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
        return rms_norm_ref(x, self.weight, self.bias, residual=residual, eps=self.eps, prenorm=prenorm, upcast=True)

    monkeypatch.setattr(layer_mod, "chunk_gated_delta_product", op)
    monkeypatch.setattr(ShortConvolution, "forward", conv_forward)
    monkeypatch.setattr(FusedRMSNormGated, "forward", gated_norm_forward)
    monkeypatch.setattr(RMSNorm, "forward", norm_forward)
    monkeypatch.setattr(mlp_mod, "swiglu", lambda x, y: F.silu(x) * y)


def _fla_model(dtype=torch.float32, **over):
    from fla.models import GatedDeltaProductConfig, GatedDeltaProductForCausalLM

    kw = dict(hidden_size=48, num_heads=2, head_dim=16, expand_v=1.5, num_hidden_layers=2, vocab_size=VOCAB,
              num_householder=2, use_forget_gate=True, use_output_gate=True, allow_neg_eigval=True,
              hidden_ratio=2, conv_size=4, norm_eps=1e-5, tie_word_embeddings=False,
              fuse_norm=False, fuse_swiglu=False, fuse_cross_entropy=False, bos_token_id=1, eos_token_id=2)
    kw.update(over)
    model = GatedDeltaProductForCausalLM(GatedDeltaProductConfig(**kw))
    with torch.no_grad():  # nonzero norm weights and biases so that a swapped key would show
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


def _fla_logits(model, ids):
    with torch.enable_grad():  # fla's layer takes its chunk path (the op swapped above) when grad is on
        return model(input_ids=ids).logits.detach()


CASES = {
    "gated_outgate_untied": {},
    "plain_tied_nh3": dict(use_forget_gate=False, use_output_gate=False, allow_neg_eigval=False,
                           num_householder=3, tie_word_embeddings=True, expand_v=1.0),
    "noconv_intermediate": dict(use_short_conv=False, intermediate_size=80, hidden_ratio=None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_fla_same_logits_and_back_bit_for_bit(fla_on_cpu, tmp_path, case):
    model = _fla_model(**CASES[case])
    src = tmp_path / "fla"
    model.save_pretrained(src)
    ids = torch.randint(0, VOCAB, (2, 21))
    ref = _fla_logits(model, ids)

    out, _ = conv.from_fla(src, tmp_path / "lm")
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert ours.config.model_type == "lm_deltaproduct"
    assert ours.config.rms_norm_eps == model.config.norm_eps
    assert ours.config.tie_word_embeddings == model.config.tie_word_embeddings
    with torch.no_grad():
        got = ours(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)

    back, _ = conv.to_fla(out, tmp_path / "back")
    a, b = load_file(str(src / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    again = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32, fuse_norm=False,  # fla loads it
                                                 fuse_swiglu=False).eval()
    torch.testing.assert_close(_fla_logits(again, ids), ref, rtol=0, atol=0)


def test_bfloat16_round_trip_keeps_dtype_and_bits(tmp_path):
    model = _fla_model(dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "fla")
    out, _ = conv.from_fla(tmp_path / "fla", tmp_path / "lm")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(out / "model.safetensors")).values())
    back, _ = conv.to_fla(out, tmp_path / "back")
    a, b = load_file(str(tmp_path / "fla" / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_from_lm_model_to_fla_same_logits(fla_on_cpu, tmp_path):
    from lm.models.deltaproduct import LMDeltaProductConfig, LMDeltaProductForCausalLM

    cfg = LMDeltaProductConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16,
                               expand_v=2.0, num_householder=2, use_forget_gate=True, use_output_gate=True,
                               intermediate_size=64, chunk_size=16)
    ours = LMDeltaProductForCausalLM(cfg).eval()
    ours.save_pretrained(tmp_path / "lm")
    ids = torch.randint(0, VOCAB, (2, 19))
    with torch.no_grad():
        ref = ours(ids).logits
    out, dropped = conv.to_fla(tmp_path / "lm", tmp_path / "fla")
    assert "chunk_size" in dropped
    fla_cfg = json.loads((out / "config.json").read_text())
    assert fla_cfg["model_type"] == "gated_deltaproduct" and fla_cfg["intermediate_size"] == 64
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, fuse_norm=False, fuse_swiglu=False)
    torch.testing.assert_close(_fla_logits(theirs.eval(), ids), ref, rtol=1e-4, atol=1e-4)


def test_cli_round_trip(tmp_path, capsys):
    _fla_model().save_pretrained(tmp_path / "fla")
    assert lm_main(["convert", "--from", "fla", str(tmp_path / "fla"), "--output", str(tmp_path / "lm")]) == 0
    assert "lm_deltaproduct" in capsys.readouterr().out
    assert lm_main(["convert", "--to", "fla", str(tmp_path / "lm"), "--output", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "gated_deltaproduct"


def _refused(tmp_path, fn, src, match):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        fn(src, out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no temporary left


def test_bad_fla_input_is_refused_and_nothing_written(tmp_path):
    src = tmp_path / "fla"
    _fla_model().save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())

    def write(**over):
        (src / "config.json").write_text(json.dumps({**cfg, **over}))

    write(model_type="gated_deltanet")
    _refused(tmp_path, conv.from_fla, src, "model_type: 'gated_deltanet'")
    write(num_heads=3)
    _refused(tmp_path, conv.from_fla, src, r"attn.q_proj.weight has shape \(32, 48\), the config implies \(48, 48\)")
    write(attn=[{"layers": [0], "num_heads": 2}, {"layers": [1], "num_heads": 4}])  # one setting per kind
    _refused(tmp_path, conv.from_fla, src, "^attn: the specs give different")
    write(attn={"layers": [1], "num_heads": 2, "qk_norm": True})
    _refused(tmp_path, conv.from_fla, src, r"^attn: field\(s\) \['qk_norm'\]")
    write(attnres_block_size=2)
    _refused(tmp_path, conv.from_fla, src, "attnres_block_size")
    write(hidden_act="powlu")
    _refused(tmp_path, conv.from_fla, src, "hidden_act")
    write(num_v_heads=4)
    _refused(tmp_path, conv.from_fla, src, "num_v_heads")
    write()
    sd = load_file(str(src / "model.safetensors"))
    from safetensors.torch import save_file

    save_file({k: v for k, v in sd.items() if "layers.1.attn.v_conv1d" not in k}, str(src / "model.safetensors"))
    _refused(tmp_path, conv.from_fla, src, "v_conv1d.weight is missing")
    (src / "model.safetensors").unlink()
    _refused(tmp_path, conv.from_fla, src, "no model.safetensors")
    assert lm_main(["convert", "--from", "fla", str(src), "--output", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_bad_lm_input_is_refused(tmp_path):
    from lm.models.deltaproduct import LMDeltaProductConfig, LMDeltaProductForCausalLM
    from lm.models.mamba2 import LMMamba2Config, LMMamba2ForCausalLM

    small = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1)
    LMDeltaProductForCausalLM(LMDeltaProductConfig(**small, num_heads=2, implicit={"max_iter": 2})).save_pretrained(
        tmp_path / "implicit")
    _refused(tmp_path, conv.to_fla, tmp_path / "implicit", "^implicit: ")
    LMDeltaProductForCausalLM(LMDeltaProductConfig(**small, num_heads=2, intermediate_size=0)).save_pretrained(
        tmp_path / "nomlp")
    _refused(tmp_path, conv.to_fla, tmp_path / "nomlp", "^intermediate_size: ")
    LMMamba2ForCausalLM(LMMamba2Config(**small)).save_pretrained(tmp_path / "mamba")
    _refused(tmp_path, conv.to_fla, tmp_path / "mamba", "model_type: 'lm_mamba2'")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        conv.to_fla(tmp_path / "nomlp", tmp_path / "taken")
