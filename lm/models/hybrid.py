"""Hybrid stacks: attention and recurrent layers in one model (`lm_hybrid`), explicit or implicit.

    LMHybridConfig(layer_pattern="MMMMM*" * 7, hidden_size=1024, intermediate_size=2816,
                   attention={"num_attention_heads": 16}, mamba2={"d_state": 128, "headdim": 64})

`layer_pattern` names each layer's token mixer, as Megatron-Core's hybrid layer pattern does: a string of one letter
per layer, or a list of kind names (one per layer).

    letter  kind           layer (the pure family's block, with its config fields in the kind's settings dict)
    *       attention      lm_llama's: RoPE attention, GQA (num_key_value_heads), optional sliding_window
    M       mamba2         lm_mamba2's: conv + SSD + gated norm
    D       deltaproduct   lm_deltaproduct's: (Gated) DeltaProduct (use_forget_gate in its settings)
    L       lru            lm_lru's, variant lru
    H       hlru           lm_lru's, variant hlru
    B       bdlru          lm_lru's, variant bdlru

Each kind used has a settings dict named after it (`attention`, `mamba2`, `deltaproduct`, `lru`, `hlru`, `bdlru`)
holding that family's own config fields (lm_llama's num_attention_heads, head_dim, rope_theta, sliding_window, ...;
lm_mamba2's d_state, headdim, expand, chunk_size, ...); a field left out takes the family's default. The fields every
family shares (vocab_size, hidden_size, intermediate_size, rms_norm_eps, initializer_range, implicit, ...) are set
once at the top. A layer is built from its family's config (`LMHybridConfig.kind_config`), so it computes exactly what
that family's layer computes.

Channel mixer: a layer of a kind in `mlp_kinds` carries the SwiGLU MLP of width intermediate_size after its mixer,
as the pure families' blocks do; the default is every kind except mamba2 (lm_mamba2's blocks have no MLP, the
others have one). So a Mamba2 + attention hybrid is Nemotron-H-like (Mamba2 layers without an MLP, attention layers
with one) and its layers are the pure stacks' layers; put "mamba2" in mlp_kinds for Jamba / Samba-like layers that
all have one. Megatron's separate MLP layer ("-") is not a layer here: MLPs belong to the layers of `mlp_kinds`.

Parameter names are the pure families': model.embed_tokens, model.layers.{i}.{norm, mixer.*, mlp_norm, mlp.*},
model.norm_f, lm_head; so a layer's weights move between a pure model and a hybrid one unchanged.

Implicit hybrids: the whole stack is the fixed-point map z <- F(z, inj(x)) as in every implicit model (LMModel).
The injection is one projection per mixer kind, shared by that kind's layers: one Linear (model.injection.proj)
whose output columns are the kinds' widths side by side (in the order the kinds first appear in the pattern), one
product per forward; each layer reads its kind's columns. A pattern of one kind has that family's injection
(the same parameter names and shape). Each kind's shared inputs (Mixer.shared_inputs: rotary tables, packed-document
tables, ...) are made once per forward and each layer receives only its own kind's.

Presets (lm/configs/models): lm_hybrid-mamba2-350m / -1.3b (35 Mamba2 + 7 attention layers, "MMMMM*" x 7, at
lm_mamba2's and lm_llama's widths), lm_hybrid-gdp-400m (Gated DeltaProduct + attention 3:1, "DDD*" x 6, fla's hybrid
layout), lm_hybrid-tiny and lm_hybrid-mamba2-tiny (tests). Each is explicit; its implicit variant is the same preset
with solver settings: load_config(name, implicit={...}), model.implicit or a curriculum in a training recipe
(lm/configs/train/*hybrid*.yaml train the implicit variants; curriculum=null the explicit ones).
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import LMConfig
from .deltaproduct import DeltaProductMixer, LMDeltaProductConfig
from .llama import Attention, LMLlamaConfig
from .lru import LMLRUConfig, LRUMixer
from .mamba2 import LMMamba2Config, Mamba2Mixer
from .modeling import Block, LMForCausalLM, LMModel, Mixer


@dataclass(frozen=True)
class Kind:
    """A layer kind: its pattern letter and its family's config and mixer classes."""

    letter: str
    config_class: type[LMConfig]
    mixer_class: type[Mixer]
    fixed: tuple = ()  # family config fields the kind itself sets ((name, value), ...)

    def settable(self) -> list[str]:
        """The family fields a kind's settings dict may hold."""
        own = dict(self.fixed)
        return sorted(k for k in self.config_class._fields if k not in own)


KINDS: dict[str, Kind] = {
    "attention": Kind("*", LMLlamaConfig, Attention),
    "mamba2": Kind("M", LMMamba2Config, Mamba2Mixer),
    "deltaproduct": Kind("D", LMDeltaProductConfig, DeltaProductMixer),
    "lru": Kind("L", LMLRUConfig, LRUMixer, (("variant", "lru"),)),
    "hlru": Kind("H", LMLRUConfig, LRUMixer, (("variant", "hlru"),)),
    "bdlru": Kind("B", LMLRUConfig, LRUMixer, (("variant", "bdlru"),)),
}
LETTERS = {k.letter: name for name, k in KINDS.items()}
DEFAULT_MLP_KINDS = [k for k in KINDS if k != "mamba2"]  # the pure families' blocks: all but Mamba2 have an MLP
# the fields every family shares, set once at the top of a hybrid config and handed to each kind's config
SHARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "initializer_range",
                 "injection_norm", "head")


def parse_pattern(pattern) -> list[str]:
    """The kind of each layer for a layer pattern: a string of letters (see the module docstring) or a list of kind
    names."""
    if isinstance(pattern, str):
        bad = sorted(set(pattern) - set(LETTERS))
        if bad or not pattern:
            hint = (" ('-', Megatron's MLP layer, is not a layer here: the layers of the kinds in mlp_kinds carry the "
                    "MLP)" if "-" in bad else "")
            letters = ", ".join(f"{c} {n}" for c, n in LETTERS.items())
            raise ValueError(f"layer_pattern: {pattern!r} has unknown letter(s) {bad}{hint}; one letter per layer of "
                             f"{letters}" if pattern else "layer_pattern: empty; give one letter per layer "
                             f"({letters}) or a list of kind names")
        return [LETTERS[c] for c in pattern]
    if isinstance(pattern, (list, tuple)) and pattern:
        bad = [p for p in pattern if not isinstance(p, str) or p not in KINDS]
        if bad:
            raise ValueError(f"layer_pattern: unknown kind(s) {sorted(set(map(str, bad)))}; a list names each "
                             f"layer's kind, one of {list(KINDS)}")
        return list(pattern)
    raise ValueError(f"layer_pattern: expected a string of layer letters (e.g. 'MMMMM*') or a non-empty list of kind "
                     f"names {list(KINDS)}, got {pattern!r}")


class LMHybridConfig(LMConfig):
    """Config of `lm_hybrid` (see the module docstring).

    layer_pattern:  a string of one letter per layer (* M D L H B) or a list of kind names; num_hidden_layers is
                    its length (given, it must agree).
    mlp_kinds:      the kinds whose layers carry the SwiGLU MLP (width intermediate_size); None = every kind but
                    mamba2.
    attention, mamba2, deltaproduct, lru, hlru, bdlru: each kind's settings, its family's own config fields.
    """

    model_type = "lm_hybrid"
    _fields = {
        "layer_pattern": "MMM*",
        "mlp_kinds": None,
        **{kind: None for kind in KINDS},
    }

    def __init__(self, **kwargs):
        kwargs.setdefault("intermediate_size", 688)
        if "num_hidden_layers" not in kwargs:
            kwargs["num_hidden_layers"] = len(parse_pattern(kwargs.get("layer_pattern", self._fields["layer_pattern"])))
        super().__init__(**kwargs)

    def validate(self):
        super().validate()
        kinds = parse_pattern(self.layer_pattern)
        self._check(len(kinds) == self.num_hidden_layers, "num_hidden_layers",
                    f"must equal the layer pattern's length {len(kinds)} (or be left out)")
        if self.mlp_kinds is None:
            self.mlp_kinds = list(DEFAULT_MLP_KINDS)
        self._check(isinstance(self.mlp_kinds, (list, tuple)) and all(k in KINDS for k in self.mlp_kinds),
                    "mlp_kinds", f"must be a list of kind names from {list(KINDS)} (or None)")
        self.mlp_kinds = list(self.mlp_kinds)
        for kind in KINDS:
            value = getattr(self, kind)
            self._check(value is None or isinstance(value, dict), kind,
                        f"must be a dict of {KINDS[kind].config_class.model_type}'s fields (or None)")
            setattr(self, kind, dict(value or {}))  # a copy: the class default is shared
        for kind in dict.fromkeys(kinds):
            self.kind_config(kind)  # each kind's settings, validated by its family's config

    @property
    def layer_kinds(self) -> list[str]:
        """Each layer's kind."""
        return parse_pattern(self.layer_pattern)

    @property
    def kinds(self) -> list[str]:
        """The kinds of the pattern, in the order they first appear."""
        return list(dict.fromkeys(self.layer_kinds))

    def kind_config(self, kind: str) -> LMConfig:
        """The family config of `kind`'s layers: the shared fields, the MLP per mlp_kinds, the kind's settings."""
        spec = KINDS[kind]
        settings = getattr(self, kind) or {}
        shared = sorted(k for k in settings if k in LMConfig._common_fields)
        if shared:
            raise ValueError(f"{kind}.{shared[0]}: set {shared} at the top of the hybrid config (shared by every "
                             f"layer), not in {kind}")
        fixed = sorted(k for k in settings if k in dict(spec.fixed))
        if fixed:
            raise ValueError(f"{kind}.{fixed[0]}: set by the kind itself (the pattern letter {spec.letter!r}); leave "
                             "it out")
        unknown = sorted(k for k in settings if k not in spec.config_class._fields)
        if unknown:
            raise ValueError(f"{kind}: unknown field(s) {unknown}; {kind} takes {spec.settable()}")
        fields = {k: getattr(self, k) for k in SHARED_FIELDS}
        fields["intermediate_size"] = self.intermediate_size if kind in self.mlp_kinds else 0
        try:
            return spec.config_class(**fields, **dict(spec.fixed), **settings, implicit=None)
        except ValueError as err:
            raise ValueError(f"{kind}.{err}") from None

    def injection_columns(self) -> dict[str, tuple[int, int]]:
        """Each kind's columns (lo, hi) of the implicit model's injection: the kinds' widths side by side."""
        out, lo = {}, 0
        for kind in self.kinds:
            w = KINDS[kind].mixer_class.injection_dim(self.kind_config(kind))
            out[kind] = (lo, lo + w)
            lo += w
        return out


class HybridBlock(Block):
    """A pure family's block (its config, mixer and MLP) that picks its kind's shared inputs and injection columns
    from the hybrid stack's."""

    def __init__(self, layer_idx: int, kind: str, family: LMConfig, inj_cols: tuple[int, int], inj_width: int):
        super().__init__(family, layer_idx, KINDS[kind].mixer_class)
        self.kind = kind
        self.mixer.family_config = family  # (Mixer.family_config: what its init_weights reads)
        # the injection's columns of this kind, or None where they are all of it (a one-kind pattern)
        self.inj_cols = None if inj_cols == (0, inj_width) else inj_cols

    def forward(self, x, *, injection=None, by_kind=None, **kw):
        if injection is not None and self.inj_cols is not None:
            injection = injection[..., self.inj_cols[0]:self.inj_cols[1]]
        return super().forward(x, injection=injection, **kw, **(by_kind[self.kind] if by_kind else {}))


class LMHybridModel(LMModel):
    config_class = LMHybridConfig
    _no_split_modules = ["HybridBlock"]

    def make_blocks(self, config: LMHybridConfig) -> list[Block]:
        families = {kind: config.kind_config(kind) for kind in config.kinds}
        cols = config.injection_columns()
        width = max(hi for _, hi in cols.values())
        return [HybridBlock(i, kind, families[kind], cols[kind], width)
                for i, kind in enumerate(config.layer_kinds)]

    def injection_width(self, config: LMHybridConfig) -> int:
        return max(hi for _, hi in config.injection_columns().values())

    def mixer_shared_inputs(self, t: int, cu_seqlens, device, **kw) -> dict:
        """Each kind's shared inputs (from its first layer's mixer), under `by_kind`: a HybridBlock hands its mixer
        its own kind's."""
        first = {}
        for layer in self.layers:
            first.setdefault(layer.kind, layer.mixer)
        return {"by_kind": {kind: m.shared_inputs(t, cu_seqlens, device, **kw) for kind, m in first.items()}}


class LMHybridForCausalLM(LMForCausalLM):
    config_class = LMHybridConfig
    model_class = LMHybridModel
    _no_split_modules = ["HybridBlock"]
