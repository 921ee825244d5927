"""Configuration shared by every model type: HF-standard sizes, validation, and the `implicit` field.

`implicit` is None for the explicit model, or the solver settings (`ImplicitSettings`, one typed object from
the training YAML to `solve`): the whole block stack is then the fixed-point map z <- F(z, inj(x)) (paper 003).
A dict assigned to it (config.json, a preset, user code) is validated into `ImplicitSettings`; config.json
stores it as a dict.
Every config rejects unknown keys and out-of-range values with a ValueError that names the field.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from transformers import PretrainedConfig

# Keys that transformers itself writes into config.json or passes to config constructors.
_HF_KEYS = set(PretrainedConfig().__dict__) | {
    "model_type", "transformers_version", "architectures", "auto_map", "torch_dtype", "dtype",
    "_name_or_path", "name_or_path", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id",
    "tie_word_embeddings", "return_dict", "output_hidden_states", "output_attentions", "torchscript",
    "id2label", "label2id", "num_labels", "problem_type", "is_encoder_decoder", "is_decoder",
    "_attn_implementation", "attn_implementation", "_commit_hash", "tokenizer_class", "prefix",
    "task_specific_params", "chunk_size_feed_forward", "_experts_implementation", "experts_implementation",
}


@dataclasses.dataclass(frozen=True)
class ImplicitSettings:
    """Fixed-point solver settings of an implicit model (paper 003, sec. 2-3).

    max_iter:      no-grad self-iterations in training (the "s" of (s+k)).
    tol:           stop when the relative residual ||F(z)-z|| / ||F(z)|| < tol; None = always max_iter.
    phantom_steps: k damped steps with autograd from the detached fixed point (phantom gradient, eq. 5).
    damping:       lambda in (0, 1]: z <- lambda F(z) + (1 - lambda) z, in the solve and the phantom steps.
    eval_factor:   evaluation/generation iteration cap = eval_factor * max_iter (paper: 4x).
    eval_tol:      tolerance in evaluation and generation; None = tol.
    stop_quantile: the solve stops once this fraction of the batch's sequences has converged (1.0 = all);
                   converged sequences are frozen, so results do not depend on the batch.
    norm:          residual norm: "l2" or "inf" over the whole sequence, "inf_rows" (max over tokens of
                   each token's relative inf-norm).
    anderson:      Anderson-acceleration history size (0 = plain damped iteration).
    """

    max_iter: int = 4
    tol: float | None = None
    phantom_steps: int = 1
    damping: float = 1.0
    eval_factor: float = 4.0
    eval_tol: float | None = None
    stop_quantile: float = 1.0
    norm: str = "l2"
    anderson: int = 0

    @classmethod
    def from_value(cls, value: Any) -> "ImplicitSettings | None":
        """None, an ImplicitSettings, or a dict of its fields (validated; unknown keys rejected)."""
        if value is None:
            return None
        if isinstance(value, ImplicitSettings):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"implicit: expected None or a dict of solver settings, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"implicit: unknown key(s) {unknown}; valid keys are {sorted(names)}")
        return cls(**value)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(field, why):
            raise ValueError(f"implicit.{field}: {why} (got {getattr(self, field)!r})")

        if not isinstance(self.max_iter, int) or self.max_iter < 1:
            bad("max_iter", "must be an integer >= 1")
        if self.tol is not None and not (0 < self.tol < 1):
            bad("tol", "must be None or in (0, 1)")
        if self.eval_tol is not None and not (0 < self.eval_tol < 1):
            bad("eval_tol", "must be None or in (0, 1)")
        if not isinstance(self.phantom_steps, int) or self.phantom_steps < 0:
            bad("phantom_steps", "must be an integer >= 0")
        if not (0 < self.damping <= 1):
            bad("damping", "must be in (0, 1]")
        if not (self.eval_factor >= 1):
            bad("eval_factor", "must be >= 1")
        if not (0 < self.stop_quantile <= 1):
            bad("stop_quantile", "must be in (0, 1]")
        if self.norm not in ("l2", "inf", "inf_rows"):
            bad("norm", "must be 'l2', 'inf' or 'inf_rows'")
        if not isinstance(self.anderson, int) or self.anderson < 0:
            bad("anderson", "must be an integer >= 0")

    @property
    def eval_max_iter(self) -> int:
        return int(math.ceil(self.eval_factor * self.max_iter))

    @property
    def eval_tolerance(self) -> float | None:
        return self.eval_tol if self.eval_tol is not None else self.tol

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class LMConfig(PretrainedConfig):
    """Base of every `lm_*` config. Subclasses list their own fields in `_fields` (name -> default).

    Class attributes carry no annotations on purpose: transformers >= 5.2x turns config subclasses into
    dataclasses, and annotated class attributes would become dataclass fields.
    """

    model_type = "lm_base"
    # field name -> default, shared by every model type
    _common_fields = {
        "vocab_size": 8192,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "intermediate_size": 0,  # SwiGLU width; 0 = no MLP in the block (pure Mamba2 stacks)
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "implicit": None,
        "injection_norm": True,
        # "lm": logits per position from the LM head; "compression": the MAD compression decoder (every
        # position decoded from the last position's state and a position code; lm.eval.synthetic's tasks)
        "head": "lm",
    }
    _fields = {}
    _positive_int_fields = ("vocab_size", "hidden_size", "num_hidden_layers")

    def __init_subclass__(cls, **kwargs):
        own_init = "__init__" in cls.__dict__
        super().__init_subclass__(**kwargs)
        if not own_init:  # transformers >= 5.2x generated a dataclass __init__: keep our validating one
            cls.__init__ = LMConfig.__init__

    def __init__(self, **kwargs):
        fields = {**self._common_fields, **self._fields}
        unknown = sorted(k for k in kwargs if k not in fields and k not in _HF_KEYS)
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: unknown config key(s) {unknown}. Valid model keys: {sorted(fields)}"
            )
        values = {k: kwargs.pop(k, v) for k, v in fields.items()}
        kwargs.setdefault("tie_word_embeddings", True)
        kwargs.setdefault("eos_token_id", 0)
        kwargs.setdefault("bos_token_id", 0)
        kwargs.setdefault("pad_token_id", 0)
        kwargs.pop("use_cache", None)
        for k, v in values.items():
            setattr(self, k, v)  # implicit: validated into ImplicitSettings by __setattr__
        super().__init__(**kwargs)
        self.validate()

    def __setattr__(self, key, value):
        if key == "implicit":
            value = ImplicitSettings.from_value(value)
        super().__setattr__(key, value)

    def to_dict(self) -> dict:
        out = super().to_dict()
        if isinstance(out.get("implicit"), ImplicitSettings):  # config.json holds plain JSON
            out["implicit"] = out["implicit"].to_dict()
        return out

    @property
    def is_implicit(self) -> bool:
        return self.implicit is not None

    def validate(self) -> None:
        for name in self._positive_int_fields:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: must be a positive integer (got {v!r})")
        if not isinstance(self.intermediate_size, int) or self.intermediate_size < 0:
            raise ValueError(f"intermediate_size: must be an integer >= 0 (got {self.intermediate_size!r})")
        if not (self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps: must be > 0 (got {self.rms_norm_eps!r})")
        if self.head not in ("lm", "compression"):
            raise ValueError(f"head: must be 'lm' or 'compression' (got {self.head!r})")

    def _check(self, cond: bool, field: str, why: str) -> None:
        if not cond:
            raise ValueError(f"{field}: {why} (got {getattr(self, field)!r})")
