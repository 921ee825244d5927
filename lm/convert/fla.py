"""flash-linear-attention `gated_deltaproduct` checkpoints <-> `lm_deltaproduct` / `lm_hybrid` Hugging Face folders.

    from_fla(SRC, OUT):  fla folder (config.json + safetensors, as fla's save_pretrained writes it) -> lm folder
    to_fla(SRC, OUT):    lm folder (or a run / checkpoint folder, exported first) -> fla folder

An fla model without attention layers becomes an `lm_deltaproduct`; one whose config has an `attn` spec (fla's hybrid:
the listed layers are standard attention, the others DeltaProduct) becomes an `lm_hybrid` with the layer pattern of
those layers ("D" DeltaProduct, "*" attention), both kinds with the MLP, the DeltaProduct fields in its
`deltaproduct` settings and the spec's in its `attention` settings (num_heads -> num_attention_heads, num_kv_heads ->
num_key_value_heads, qkv_bias -> attention_bias, window_size -> sliding_window, rope_theta; fla's head_dim is
hidden_size / num_heads). The way back takes an lm_hybrid of DeltaProduct and attention layers only.

The two models compute the same function (tests/test_convert_fla.py checks the logits); they differ in
how the parameters are cut:

    fla  model.layers.i.attn.{q,k,v,b,a,g}_proj   ours  model.layers.i.mixer.in_proj (rows stacked in
                                                        that order; a only with use_forget_gate, g only
                                                        with use_output_gate)
    fla  model.layers.i.attn.{q,k,v}_conv1d       ours  model.layers.i.mixer.conv1d (one depthwise conv
                                                        over the stacked q|k|v channels)
    fla  attn.{A_log,dt_bias,o_norm,o_proj}       ours  mixer.{A_log,dt_bias,o_norm,o_proj}
    fla  model.layers.i.{attn_norm,mlp_norm,mlp}  ours  model.layers.i.{norm,mlp_norm,mlp}
    fla  model.embeddings / model.norm / lm_head  ours  model.embed_tokens / model.norm_f / lm_head
  attention layers (fla's hybrid):
    fla  model.layers.i.attn.{q,k,v}_proj         ours  model.layers.i.mixer.qkv_proj (rows stacked; biases too)
    fla  model.layers.i.attn.o_proj               ours  model.layers.i.mixer.o_proj

Within k, v and beta both lay a token's rows out as (num_householder, heads, dim), so the stacked blocks
are fla's weights unchanged. Config names: fla's norm_eps is our rms_norm_eps; fla's hidden_ratio (or
intermediate_size) gives our intermediate_size by fla's own rule; tie_word_embeddings, the head sizes and
the DeltaProduct switches carry over by name. Tensors keep their dtype, so from_fla then to_fla gives
back fla's state dict bit for bit.

What does not map is refused with a ValueError naming the field: an implicit model, a model without an
MLP (intermediate_size 0, or a kind left out of mlp_kinds), other layer kinds than DeltaProduct and attention,
attention specs that differ between layers or carry fields this converter does not know, attention whose head_dim
is not hidden_size / num_heads, attention residuals (`attnres_block_size`), a hidden_act other than swish, config
fields this converter does not know.
Fields that only steer training or kernels on one side are dropped and listed (fla: attn_mode, fuse_*,
use_l2warp, max_position_embeddings without attention layers; ours: chunk_size and the initialisation ranges).
The output is written to a temporary folder beside OUT and renamed at the end: nothing is written on error.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

FLA_MODEL_TYPE = "gated_deltaproduct"
LM_MODEL_TYPE = "lm_deltaproduct"
LM_HYBRID_TYPE = "lm_hybrid"
FLA_ARCHITECTURE = "GatedDeltaProductForCausalLM"

# fla config fields that have a counterpart in ours (same name unless mapped in _config_from_fla)
_FLA_MAPPED = {
    "hidden_size", "num_hidden_layers", "vocab_size", "num_heads", "head_dim", "expand_v", "num_householder",
    "allow_neg_eigval", "use_forget_gate", "use_output_gate", "use_short_conv", "conv_size", "norm_eps",
    "hidden_ratio", "intermediate_size", "hidden_act", "tie_word_embeddings", "initializer_range",
    "bos_token_id", "eos_token_id", "pad_token_id", "attn", "attnres_block_size",
}
# fla fields that steer its kernels, fused losses or generation only: no effect on the weights or the function
_FLA_DROPPED = {
    "attn_mode", "fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp",
    "max_position_embeddings", "use_cache",
}
# the fields of fla's attention spec (fla.models.configuration_utils.AttentionSpec)
_FLA_ATTN_FIELDS = {"layers", "num_heads", "num_kv_heads", "qkv_bias", "window_size", "rope_theta"}
# our fields that only set initialisation or the kernel's tiling
_LM_DROPPED = {"chunk_size", "dt_min", "dt_max", "A_init_range", "rescale_o_proj", "injection_norm"}
_DP_FIELDS = ("num_heads", "head_dim", "expand_v", "num_householder", "allow_neg_eigval", "use_forget_gate",
              "use_output_gate", "use_short_conv", "conv_size")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


def fla_intermediate_size(hidden_size: int, hidden_ratio, intermediate_size) -> int:
    """fla's GatedMLP width: intermediate_size if given, else 2/3 * hidden_ratio (default 4) * hidden_size
    rounded up to a multiple of 256."""
    if intermediate_size is not None:
        return int(intermediate_size)
    width = int(hidden_size * (4 if hidden_ratio is None else hidden_ratio) * 2 / 3)
    return 256 * ((width + 255) // 256)


def _hf_keys() -> set[str]:
    from lm.models.config import _HF_KEYS

    return _HF_KEYS


# --- config ------------------------------------------------------------------------------------------------
def _fla_attention(fla: dict) -> tuple[list[int], dict] | None:
    """(the attention layers, their one spec) of fla's `attn` (a spec or a list of specs), or None without any."""
    attn = fla.get("attn")
    if attn is None:
        return None
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs):
        raise ValueError(f"attn: expected fla's attention spec (a dict) or a list of them, got {attn!r}")
    layers = sorted(i for s in specs for i in s.get("layers", []))
    if not layers:
        return None
    for s in specs:
        unknown = sorted(set(s) - _FLA_ATTN_FIELDS)
        if unknown:
            raise ValueError(f"attn: field(s) {unknown} of fla's attention spec have no lm counterpart that this "
                             "converter knows; refusing rather than dropping them")
    norm = [dict(num_heads=s["num_heads"], num_kv_heads=s.get("num_kv_heads") or s["num_heads"],
                 qkv_bias=s.get("qkv_bias", False), window_size=s.get("window_size"),
                 rope_theta=s.get("rope_theta", 10000.0)) for s in specs]
    if any(n != norm[0] for n in norm):
        raise ValueError(f"attn: the specs give different attention settings to different layers ({norm}); an "
                         "lm_hybrid has one setting per layer kind")
    return layers, norm[0]


def config_from_fla(fla: dict) -> tuple[dict, list[str]]:
    """Our config kwargs (lm_deltaproduct's, or lm_hybrid's where fla's `attn` names attention layers) for an fla
    gated_deltaproduct config.json dict, and the dropped fields."""
    mt = fla.get("model_type")
    if mt != FLA_MODEL_TYPE:
        raise ValueError(f"model_type: {mt!r} is not fla's {FLA_MODEL_TYPE!r}; only fla GatedDeltaProduct "
                         "checkpoints convert to lm_deltaproduct / lm_hybrid")
    unknown = sorted(set(fla) - _FLA_MAPPED - _FLA_DROPPED - _hf_keys())
    if unknown:
        raise ValueError(f"{unknown[0]}: fla config field(s) {unknown} have no lm_deltaproduct counterpart "
                         "that this converter knows; refusing rather than dropping them")
    if fla.get("attnres_block_size") is not None:
        raise ValueError("attnres_block_size: fla's attention residuals have no lm_deltaproduct counterpart")
    act = fla.get("hidden_act", "swish")
    if act not in ("swish", "silu"):
        raise ValueError(f"hidden_act: {act!r}; lm_deltaproduct's MLP is SwiGLU (fla 'swish') only")
    hidden = fla.get("hidden_size", 2048)
    layers = fla.get("num_hidden_layers", 21)
    common = {
        "vocab_size": fla.get("vocab_size", 32000),
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": fla_intermediate_size(hidden, fla.get("hidden_ratio", 4), fla.get("intermediate_size")),
        "rms_norm_eps": fla.get("norm_eps", 1e-6),
        "initializer_range": fla.get("initializer_range", 0.02),
    }
    dp = {
        "num_heads": fla.get("num_heads", 6),
        "head_dim": fla.get("head_dim", 256),
        "expand_v": fla.get("expand_v", 2.0),
        "num_householder": fla.get("num_householder", 1),
        "allow_neg_eigval": fla.get("allow_neg_eigval", False),
        "use_forget_gate": fla.get("use_forget_gate", False),
        "use_output_gate": fla.get("use_output_gate", True),
        "use_short_conv": fla.get("use_short_conv", True),
        "conv_size": fla.get("conv_size", 4),
    }
    tokens = {
        "tie_word_embeddings": fla.get("tie_word_embeddings", False),
        "bos_token_id": fla.get("bos_token_id", 1),
        "eos_token_id": fla.get("eos_token_id", 2),
        "pad_token_id": fla.get("pad_token_id"),
        "implicit": None,
    }
    dropped = sorted(k for k in _FLA_DROPPED if k in fla)
    attn = _fla_attention(fla)
    if attn is None:
        return {**common, **dp, **tokens}, dropped
    where, spec = attn
    if where[-1] >= layers:
        raise ValueError(f"attn: layer {where[-1]} is out of range for num_hidden_layers={layers}")
    if hidden % spec["num_heads"]:
        raise ValueError(f"attn: num_heads={spec['num_heads']} does not divide hidden_size={hidden}")
    attention = {
        "num_attention_heads": spec["num_heads"],
        "num_key_value_heads": spec["num_kv_heads"],
        "head_dim": hidden // spec["num_heads"],
        "attention_bias": spec["qkv_bias"],
        "sliding_window": spec["window_size"],
        "rope_theta": float(spec["rope_theta"]),
        "max_position_embeddings": fla.get("max_position_embeddings", 2048),
    }
    pattern = "".join("*" if i in where else "D" for i in range(layers))
    cfg = {**common, "layer_pattern": pattern, "mlp_kinds": ["attention", "deltaproduct"], "deltaproduct": dp,
           "attention": attention, **tokens}
    return cfg, [k for k in dropped if k != "max_position_embeddings"]


def _lm_config(lm: dict):
    """Our config object (LMDeltaProductConfig or LMHybridConfig) for a config.json dict, checked convertible."""
    mt = lm.get("model_type")
    if mt not in (LM_MODEL_TYPE, LM_HYBRID_TYPE):
        raise ValueError(f"model_type: {mt!r}; only {LM_MODEL_TYPE!r} models and {LM_HYBRID_TYPE!r} models of "
                         f"DeltaProduct and attention layers convert to fla's {FLA_MODEL_TYPE!r}")
    from lm.models import MODEL_TYPES

    c = MODEL_TYPES[mt][0](**{k: v for k, v in lm.items() if k not in ("architectures", "auto_map", "model_type")})
    if c.implicit is not None:
        raise ValueError("implicit: an implicit (fixed-point) model has no fla counterpart; fla's "
                         "GatedDeltaProduct is explicit only")
    if c.intermediate_size == 0:
        raise ValueError("intermediate_size: 0 (blocks without an MLP); fla's GatedDeltaProduct blocks always "
                         "have one")
    if mt == LM_HYBRID_TYPE:
        other = sorted(set(c.kinds) - {"deltaproduct", "attention"})
        if other:
            raise ValueError(f"layer_pattern: layers of kind(s) {other}; fla's GatedDeltaProduct hybrid has "
                             "DeltaProduct ('D') and attention ('*') layers only")
        bare = sorted(set(c.kinds) - set(c.mlp_kinds))
        if bare:
            raise ValueError(f"mlp_kinds: the {bare} layers have no MLP; every fla GatedDeltaProduct block has one")
        if "attention" in c.kinds:
            a = c.kind_config("attention")
            if a.head_dim * a.num_attention_heads != c.hidden_size:
                raise ValueError(f"attention.head_dim: {a.head_dim}; fla's attention has head_dim = hidden_size / "
                                 f"num_heads = {c.hidden_size // a.num_attention_heads}")
    return c


def config_to_fla(lm: dict) -> tuple[dict, list[str]]:
    """fla's gated_deltaproduct config.json dict for our lm_deltaproduct or lm_hybrid config dict, and the dropped
    fields."""
    c = _lm_config(lm)
    hybrid = c.model_type == LM_HYBRID_TYPE
    d = c if not hybrid else c.kind_config("deltaproduct") if "deltaproduct" in c.kinds else None
    if d is None:  # attention layers only: fla's DeltaProduct fields at our defaults (no DeltaProduct layer reads them)
        from lm.models.deltaproduct import LMDeltaProductConfig

        d = LMDeltaProductConfig(hidden_size=c.hidden_size, num_heads=1)
    ratio = next((r for r in range(1, 17)
                  if fla_intermediate_size(c.hidden_size, r, None) == c.intermediate_size), None)
    attn, max_pos = None, 2048
    if hybrid and "attention" in c.kinds:
        a = c.kind_config("attention")
        attn = {"layers": [i for i, k in enumerate(c.layer_kinds) if k == "attention"],
                "num_heads": a.num_attention_heads, "num_kv_heads": a.num_key_value_heads,
                "qkv_bias": bool(a.attention_bias), "window_size": a.sliding_window, "rope_theta": float(a.rope_theta)}
        max_pos = a.max_position_embeddings
    fla = {
        "model_type": FLA_MODEL_TYPE,
        "architectures": [FLA_ARCHITECTURE],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "hidden_ratio": ratio,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "swish",
        "norm_eps": c.rms_norm_eps,
        "initializer_range": c.initializer_range,
        "num_heads": d.num_heads,
        "head_dim": d.head_dim,
        "expand_v": float(d.expand_v),
        "num_householder": d.num_householder,
        "allow_neg_eigval": d.allow_neg_eigval,
        "use_forget_gate": d.use_forget_gate,
        "use_output_gate": d.use_output_gate,
        "use_short_conv": d.use_short_conv,
        "conv_size": d.conv_size,
        "tie_word_embeddings": bool(c.tie_word_embeddings),
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
        "attn": attn,
        "attnres_block_size": None,
        "attn_mode": "chunk",
        "max_position_embeddings": max_pos,
        "fuse_norm": True,
        "fuse_swiglu": True,
        "fuse_cross_entropy": True,
        "fuse_linear_cross_entropy": False,
        "use_l2warp": False,
        "use_cache": True,
    }
    settings = {**lm, **(lm.get("deltaproduct") or {})} if hybrid else lm
    return fla, sorted(k for k in _LM_DROPPED if k in settings)


# --- weights -----------------------------------------------------------------------------------------------
def _plan(cfg: dict) -> list[tuple[str, dict]]:
    """Each layer's (kind, widths) for our config kwargs (lm_deltaproduct's or lm_hybrid's): "deltaproduct" with
    the fused projection's and conv's parts, or "attention" with q / k / v / o widths."""
    if "layer_pattern" not in cfg:
        return [("deltaproduct", _dp_widths(cfg))] * cfg["num_hidden_layers"]
    from lm.models.hybrid import LMHybridConfig

    c = LMHybridConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "model_type")})
    widths = {}
    if "deltaproduct" in c.kinds:
        d = c.kind_config("deltaproduct")
        widths["deltaproduct"] = _dp_widths({**{f: getattr(d, f) for f in _DP_FIELDS}, "hidden_size": c.hidden_size})
    if "attention" in c.kinds:
        a = c.kind_config("attention")
        hd = a.head_dim
        widths["attention"] = dict(q=a.num_attention_heads * hd, k=a.num_key_value_heads * hd,
                                   v=a.num_key_value_heads * hd, bias=bool(a.attention_bias))
    return [(k, widths[k]) for k in c.layer_kinds]


def _dp_widths(cfg: dict) -> dict:
    """DeltaProduct widths for our config kwargs (head_dim resolved)."""
    H, nh = cfg["num_heads"], cfg["num_householder"]
    dk = cfg["head_dim"] if cfg.get("head_dim") is not None else cfg["hidden_size"] // H
    dv = int(dk * cfg["expand_v"])
    return dict(H=H, nh=nh, dk=dk, dv=dv, q=H * dk, k=nh * H * dk, v=nh * H * dv, b=nh * H,
                a=H if cfg["use_forget_gate"] else 0, g=H * dv if cfg["use_output_gate"] else 0,
                conv=cfg["conv_size"] if cfg["use_short_conv"] else 0, forget=cfg["use_forget_gate"])


def _expected_fla_shapes(cfg: dict) -> dict[str, tuple]:
    """fla parameter name -> shape, for our config kwargs."""
    d, V, I = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    shapes = {"model.embeddings.weight": (V, d), "model.norm.weight": (d,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, d)
    for i, (kind, w) in enumerate(_plan(cfg)):
        p = f"model.layers.{i}."
        shapes[p + "attn_norm.weight"] = (d,)
        shapes[p + "mlp_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (I, d)
        shapes[p + "mlp.up_proj.weight"] = (I, d)
        shapes[p + "mlp.down_proj.weight"] = (d, I)
        if kind == "attention":
            for name in "qkv":
                shapes[p + f"attn.{name}_proj.weight"] = (w[name], d)
                if w["bias"]:
                    shapes[p + f"attn.{name}_proj.bias"] = (w[name],)
            shapes[p + "attn.o_proj.weight"] = (d, w["q"])
            continue
        for name in "qkvbag":
            if w[name]:
                shapes[p + f"attn.{name}_proj.weight"] = (w[name], d)
        if w["conv"]:
            for name in "qkv":
                shapes[p + f"attn.{name}_conv1d.weight"] = (w[name], 1, w["conv"])
        if w["forget"]:
            shapes[p + "attn.A_log"] = (w["H"],)
            shapes[p + "attn.dt_bias"] = (w["H"],)
        shapes[p + "attn.o_norm.weight"] = (w["dv"],)
        shapes[p + "attn.o_proj.weight"] = (d, w["H"] * w["dv"])
    return shapes


def _check_shapes(sd: dict, shapes: dict[str, tuple], what: str, tied_head: str | None) -> None:
    missing = [k for k in shapes if k not in sd]
    if missing:
        raise ValueError(f"{what}: weight {missing[0]} is missing ({len(missing)} missing in all); the "
                         "safetensors do not hold the model its config.json describes")
    unexpected = sorted(k for k in sd if k not in shapes and k != tied_head)
    if unexpected:
        raise ValueError(f"{what}: weight(s) {unexpected[:4]} have no counterpart in the converted model "
                         f"({len(unexpected)} in all)")
    for k, shape in shapes.items():
        if tuple(sd[k].shape) != tuple(shape):
            raise ValueError(f"{what}: weight {k} has shape {tuple(sd[k].shape)}, the config implies "
                             f"{tuple(shape)}")


def _renamed(cfg: dict) -> list[tuple[str, str]]:
    """(fla name, our name) of every weight that only changes name: all but fla's per-head-kind projections and
    convs, which we hold as one in_proj and one conv1d per DeltaProduct layer (one qkv_proj per attention layer)."""
    pairs = [("model.embeddings.weight", "model.embed_tokens.weight"), ("model.norm.weight", "model.norm_f.weight")]
    if not cfg["tie_word_embeddings"]:
        pairs.append(("lm_head.weight", "lm_head.weight"))
    for i, (kind, w) in enumerate(_plan(cfg)):
        p = f"model.layers.{i}."
        pairs += [(p + "attn_norm.weight", p + "norm.weight"), (p + "mlp_norm.weight", p + "mlp_norm.weight")]
        pairs += [(p + f"mlp.{n}.weight", p + f"mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")]
        mixer = (["o_proj.weight"] if kind == "attention" else
                 (["A_log", "dt_bias"] if w["forget"] else []) + ["o_norm.weight", "o_proj.weight"])
        pairs += [(p + "attn." + n, p + "mixer." + n) for n in mixer]
    return pairs


def _checked_and_renamed(sd: dict, cfg: dict, to_fla: bool) -> dict:
    """`sd` (ours if to_fla, else fla's) checked against the shapes our config kwargs `cfg` imply; returns its
    weights that only change name, under the other side's names."""
    tied_head = "lm_head.weight" if cfg["tie_word_embeddings"] else None
    if to_fla:
        _check_shapes(sd, _expected_lm_shapes(cfg), "lm checkpoint", tied_head)
        return {theirs: sd[ours] for theirs, ours in _renamed(cfg)}
    _check_shapes(sd, _expected_fla_shapes(cfg), "fla checkpoint", tied_head)
    return {ours: sd[theirs] for theirs, ours in _renamed(cfg)}


def _cuts(kind: str, w: dict) -> list[tuple[str, str, list[tuple[str, int]]]]:
    """(our name, fla's name pattern, [(part, rows)]) of each weight we hold as one and fla as several row blocks."""
    if kind == "attention":
        out = [("mixer.qkv_proj.weight", "attn.{}_proj.weight", [(n, w[n]) for n in "qkv"])]
        if w["bias"]:
            out.append(("mixer.qkv_proj.bias", "attn.{}_proj.bias", [(n, w[n]) for n in "qkv"]))
        return out
    out = [("mixer.in_proj.weight", "attn.{}_proj.weight", [(n, w[n]) for n in "qkvbag" if w[n]])]
    if w["conv"]:
        out.append(("mixer.conv1d.weight", "attn.{}_conv1d.weight", [(n, w[n]) for n in "qkv"]))
    return out


def state_dict_from_fla(sd: dict, cfg: dict) -> dict:
    """Our state dict for fla's `sd` (checked against our config kwargs `cfg`)."""
    out = _checked_and_renamed(sd, cfg, to_fla=False)
    for i, (kind, w) in enumerate(_plan(cfg)):
        p = f"model.layers.{i}."
        for ours, theirs, parts in _cuts(kind, w):
            out[p + ours] = torch.cat([sd[p + theirs.format(n)] for n, _ in parts], 0)
    return out


def _expected_lm_shapes(cfg: dict) -> dict[str, tuple]:
    """Our parameter name -> shape, for our config kwargs."""
    fla = _expected_fla_shapes(cfg)
    shapes = {ours: fla[theirs] for theirs, ours in _renamed(cfg)}
    for i, (kind, w) in enumerate(_plan(cfg)):
        p = f"model.layers.{i}."
        for ours, theirs, parts in _cuts(kind, w):
            first = fla[p + theirs.format(parts[0][0])]
            shapes[p + ours] = (sum(r for _, r in parts), *first[1:])
    return shapes


def state_dict_to_fla(sd: dict, cfg: dict) -> dict:
    """fla's state dict for our `sd` (checked against our config kwargs `cfg`)."""
    out = _checked_and_renamed(sd, cfg, to_fla=True)
    for i, (kind, w) in enumerate(_plan(cfg)):
        p = f"model.layers.{i}."
        for ours, theirs, parts in _cuts(kind, w):
            for (n, _), t in zip(parts, sd[p + ours].split([r for _, r in parts], 0)):
                out[p + theirs.format(n)] = t.contiguous()
    return out


# --- folders -----------------------------------------------------------------------------------------------
def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    return json.loads(path.read_text())


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder's model.safetensors, or of the shards its model.safetensors.index.json lists."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json (save the model with "
                         "save_pretrained(..., safe_serialization=True))")
    sd: dict[str, torch.Tensor] = {}
    for name in shards:
        if not (folder / name).is_file():
            raise ValueError(f"{folder}: safetensors shard {name} (listed in the index) is missing")
        sd.update(load_file(str(folder / name)))
    return sd


def _save_safetensors(sd: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata={"format": "pt"})


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


class _AtomicFolder:
    """A temporary folder beside `out`, renamed to `out` on success and removed on error."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.check(self.out)

    @staticmethod
    def check(out: Path) -> None:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"--output {out}: exists and is not empty; choose a new folder")

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        if self.out.is_dir():
            self.out.rmdir()  # empty (checked above)
        os.replace(self.tmp, self.out)
        return False


def from_fla(src, output) -> tuple[Path, list[str]]:
    """Convert an fla gated_deltaproduct folder to an lm_deltaproduct folder (an lm_hybrid folder where it has
    attention layers); returns (output, dropped fields)."""
    from lm.models import MODEL_TYPES
    from lm.models.modeling import write_remote_code

    src = Path(src)
    _AtomicFolder.check(Path(output))
    cfg, dropped = config_from_fla(read_config(src))
    config_cls, _, lm_cls = MODEL_TYPES[LM_HYBRID_TYPE if "layer_pattern" in cfg else LM_MODEL_TYPE]
    sd = state_dict_from_fla(read_safetensors(src), cfg)
    config = config_cls(**cfg)  # validates (names the field that is out of range)
    dtypes = {t.dtype for t in sd.values()}
    if len(dtypes) == 1:
        config.dtype = str(next(iter(dtypes))).removeprefix("torch.")
    config.architectures = [lm_cls.__name__]
    with _AtomicFolder(output) as tmp:
        config.save_pretrained(str(tmp))
        write_remote_code(tmp, config_cls)
        _save_safetensors(sd, tmp / "model.safetensors")
        _copy_tokenizer(src, tmp)
    return Path(output), dropped


def _lm_folder(src: Path, workdir: Path) -> Path:
    """src itself if it is an HF folder with safetensors, else a run / checkpoint folder exported to workdir."""
    if (src / "config.json").is_file() and ((src / "model.safetensors").is_file()
                                             or (src / "model.safetensors.index.json").is_file()):
        return src
    if (src / "config.json").is_file() and not (src / "client.json").is_file():
        read_safetensors(src)  # raises: an HF folder without safetensors
    from lm.train.export import export_checkpoint

    return export_checkpoint(src, workdir / "hf", dtype="float32")


def to_fla(src, output) -> tuple[Path, list[str]]:
    """Convert an lm_deltaproduct or lm_hybrid (DeltaProduct and attention layers) folder (or a run / checkpoint
    folder) to an fla gated_deltaproduct folder."""
    src = Path(src)
    _AtomicFolder.check(Path(output))
    with tempfile.TemporaryDirectory() as work:
        folder = _lm_folder(src, Path(work))
        lm_cfg = read_config(folder)
        fla_cfg, dropped = config_to_fla(lm_cfg)
        cfg, _ = config_from_fla(fla_cfg)  # our kwargs with head_dim / intermediate_size resolved
        sd = state_dict_to_fla(read_safetensors(folder), cfg)
        dtypes = {t.dtype for t in sd.values()}
        if len(dtypes) == 1:
            fla_cfg["dtype"] = str(next(iter(dtypes))).removeprefix("torch.")
        with _AtomicFolder(output) as tmp:
            (tmp / "config.json").write_text(json.dumps(fla_cfg, indent=2, sort_keys=True) + "\n")
            _save_safetensors(sd, tmp / "model.safetensors")
            _copy_tokenizer(folder, tmp)
    return Path(output), dropped
