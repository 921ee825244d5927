"""Configuration shared by every model type: HF-standard sizes, validation, and the `implicit` field.

`implicit` is None for the explicit model, or the solver settings (`ImplicitSettings`, one typed object from
the training YAML to `solve`): the whole block stack is then the fixed-point map z <- F(z, inj(x)) (paper 003).
A dict assigned to it (config.json, a preset, user code) is validated into `ImplicitSettings`; config.json
stores it as a dict. It is the model's saved default: a model runs with the settings `set_solver` gave it (a
curriculum phase), else these (LMModel.solver).
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


class InvalidSetting(ValueError):
    """A solver setting out of range: `field`, why, and the value (the message names the config field that holds
    the settings, `implicit` unless `named` says another)."""

    def __init__(self, field: str, why: str, value: Any, holder: str = "implicit"):
        self.field, self.why, self.value = field, why, value
        super().__init__(f"{holder}.{field}: {why} (got {value!r})")

    def named(self, holder: str) -> "InvalidSetting":
        return InvalidSetting(self.field, self.why, self.value, holder)


@dataclasses.dataclass(frozen=True)
class ImplicitSettings:
    """Fixed-point solver settings, one typed object from the training YAML / CLI (model.implicit, a curriculum
    phase) or config.json to `lm.fixed_point.solve` (`solve_args`): those of an implicit model's stack (config
    `implicit`, paper 003, sec. 2-3) and of FP-Mamba's solve inside each layer (its config's `layer_solver`, paper
    000), with the same names and meanings; a dict given for either is completed from that field's defaults.

    max_iter:      training iteration cap (the no-grad self-iterations: the "s" of (s+k)).
    tol:           stop when the relative residual ||F(z)-z|| / ||F(z)|| < tol; None = always max_iter.
    phantom_steps: k damped steps with autograd from the detached fixed point (phantom gradient, eq. 5).
    damping:       lambda in (0, 1]: z <- lambda F(z) + (1 - lambda) z, in the solve and the phantom steps.
    eval_factor:   evaluation/generation iteration cap = ceil(eval_factor * max_iter) (paper 003: 4x).
    eval_cap:      the evaluation/generation cap as a number of iterations instead (FP-Mamba: 1000); None =
                   eval_factor * max_iter (a dict that gives eval_factor and no eval_cap sets it None).
    eval_tol:      tolerance in evaluation and generation; None = tol.
    stop_quantile: the solve stops once this fraction of the batch's sequences has converged (1.0 = all);
                   converged sequences are frozen, so results do not depend on the batch.
    eval_stop_quantile: stop_quantile in evaluation and generation; None = stop_quantile.
    norm:          residual norm: "l2" or "inf" over the whole sequence, "inf_rows" (max over tokens of
                   each token's relative inf-norm).
    anderson:      Anderson-acceleration history size (0 = plain damped iteration).
    patience:      a sample's damping is multiplied by `damping_decay` after this many iterations without a better
    damping_decay: residual (FP-Mamba's optimiser); None / 1.0 = constant damping.
    train_iter_gamma: [shape, scale]: each training solve's cap is drawn as ceil(Gamma(shape, scale)), at most
                   max_iter (paper 000); None = max_iter.
    """

    max_iter: int = 4
    tol: float | None = None
    phantom_steps: int = 1
    damping: float = 1.0
    eval_factor: float = 4.0
    eval_cap: int | None = None
    eval_tol: float | None = None
    stop_quantile: float = 1.0
    eval_stop_quantile: float | None = None
    norm: str = "l2"
    anderson: int = 0
    patience: int | None = None
    damping_decay: float = 1.0
    train_iter_gamma: tuple | None = None

    @classmethod
    def from_value(cls, value: Any, defaults: "ImplicitSettings | None" = None,
                   holder: str = "implicit") -> "ImplicitSettings | None":
        """None, an ImplicitSettings, or a dict of its fields (validated; unknown keys rejected), the fields it
        leaves out taken from `defaults` (None: the class defaults). `holder`: the config field, for the messages."""
        if value is None:
            return None
        if isinstance(value, ImplicitSettings):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{holder}: expected None or a dict of solver settings, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"{holder}: unknown key(s) {unknown}; valid keys are {sorted(names)}")
        try:
            return cls(**update_settings(defaults.to_dict(), value)) if defaults is not None else cls(**value)
        except InvalidSetting as err:
            raise err.named(holder) from None

    def __post_init__(self) -> None:
        if isinstance(self.train_iter_gamma, list):  # (from JSON / YAML: a tuple keeps the settings hashable)
            object.__setattr__(self, "train_iter_gamma", tuple(self.train_iter_gamma))
        self.validate()

    def validate(self) -> None:
        def bad(field, why):
            raise InvalidSetting(field, why, getattr(self, field))

        def integer(v, minimum):
            return isinstance(v, int) and not isinstance(v, bool) and v >= minimum

        def fraction(v):  # in (0, 1]
            return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1

        if not integer(self.max_iter, 1):
            bad("max_iter", "must be an integer >= 1")
        if self.tol is not None and not (0 < self.tol < 1):
            bad("tol", "must be None or in (0, 1)")
        if self.eval_tol is not None and not (0 < self.eval_tol < 1):
            bad("eval_tol", "must be None or in (0, 1)")
        if not integer(self.phantom_steps, 0):
            bad("phantom_steps", "must be an integer >= 0")
        if not fraction(self.damping):
            bad("damping", "must be in (0, 1]")
        if not (isinstance(self.eval_factor, (int, float)) and self.eval_factor >= 1):
            bad("eval_factor", "must be >= 1")
        if self.eval_cap is not None and not integer(self.eval_cap, 1):
            bad("eval_cap", "must be None or an integer >= 1")
        if not fraction(self.stop_quantile):
            bad("stop_quantile", "must be in (0, 1]")
        if self.eval_stop_quantile is not None and not fraction(self.eval_stop_quantile):
            bad("eval_stop_quantile", "must be None or in (0, 1]")
        if self.norm not in ("l2", "inf", "inf_rows"):
            bad("norm", "must be 'l2', 'inf' or 'inf_rows'")
        if not integer(self.anderson, 0):
            bad("anderson", "must be an integer >= 0")
        if self.patience is not None and not integer(self.patience, 1):
            bad("patience", "must be None or an integer >= 1")
        if not fraction(self.damping_decay):
            bad("damping_decay", "must be in (0, 1]")
        g = self.train_iter_gamma
        if g is not None and not (isinstance(g, tuple) and len(g) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in g)):
            bad("train_iter_gamma", "must be None or [shape > 0, scale > 0]")

    @property
    def eval_max_iter(self) -> int:
        """The evaluation / generation cap."""
        return self.eval_cap if self.eval_cap is not None else int(math.ceil(self.eval_factor * self.max_iter))

    @property
    def eval_tolerance(self) -> float | None:
        return self.eval_tol if self.eval_tol is not None else self.tol

    @property
    def eval_quantile(self) -> float:
        return self.eval_stop_quantile if self.eval_stop_quantile is not None else self.stop_quantile

    def solve_args(self, training: bool) -> dict:
        """The keyword arguments of `lm.fixed_point.solve` for a training solve (the cap drawn from train_iter_gamma
        anew at every call) or an evaluation / generation one."""
        if training:
            cap, tol, quantile = self.max_iter, self.tol, self.stop_quantile
            if self.train_iter_gamma is not None:
                import torch

                shape, scale = self.train_iter_gamma
                sample = torch.distributions.Gamma(float(shape), 1.0 / float(scale)).sample()
                cap = min(cap, max(1, int(math.ceil(float(sample)))))
        else:
            cap, tol, quantile = self.eval_max_iter, self.eval_tolerance, self.eval_quantile
        return dict(max_iter=cap, tol=tol, damping=self.damping, stop_quantile=quantile, norm=self.norm,
                    anderson=self.anderson, patience=self.patience, damping_decay=self.damping_decay)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if self.train_iter_gamma is not None:
            out["train_iter_gamma"] = list(self.train_iter_gamma)
        return out


def update_settings(base: dict, update: dict) -> dict:
    """Solver settings `base` (a dict of ImplicitSettings fields) with the fields of `update`; an evaluation cap given
    one way replaces the other (eval_factor without eval_cap drops base's eval_cap)."""
    out = {**base, **update}
    if "eval_factor" in update and "eval_cap" not in update:
        out["eval_cap"] = None
    return out


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
    # fields that hold solver settings (ImplicitSettings) -> the defaults that complete a dict given for them
    # (None: ImplicitSettings' own)
    _solver_fields = {"implicit": None}

    def __init_subclass__(cls, **kwargs):
        own_init = "__init__" in cls.__dict__
        super().__init_subclass__(**kwargs)
        if not own_init:  # transformers >= 5.2x generated a dataclass __init__: keep our validating one
            cls.__init__ = LMConfig.__init__

    def __init__(self, **kwargs):
        kwargs = self._read_legacy(kwargs)
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

    @classmethod
    def _read_legacy(cls, kwargs: dict) -> dict:
        """Fields of older config.json files in today's form (a model type that renamed fields overrides this)."""
        return kwargs

    def __setattr__(self, key, value):
        if key in self._solver_fields:
            value = ImplicitSettings.from_value(value, self._solver_fields[key], key)
        super().__setattr__(key, value)

    def to_dict(self) -> dict:
        out = super().to_dict()
        for key in self._solver_fields:  # config.json holds plain JSON
            if isinstance(out.get(key), ImplicitSettings):
                out[key] = out[key].to_dict()
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
