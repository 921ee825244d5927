"""Model types, registered with transformers' Auto classes on import.

    lm_llama, lm_mamba2 (here), and the families added beside them (lm_deltaproduct, lm_fp_mamba, lm_lru).
Each family file defines `<Family>Config`, its mixer, `<Family>Model` and `<Family>ForCausalLM`.
"""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import LMCache
from .config import ImplicitSettings, LMConfig
from .llama import LMLlamaConfig, LMLlamaForCausalLM, LMLlamaModel
from .mamba2 import LMMamba2Config, LMMamba2ForCausalLM, LMMamba2Model
from .modeling import LMForCausalLM, LMModel, LMOutput, Mixer

MODEL_TYPES: dict[str, tuple] = {}


def register(config_cls, model_cls, lm_cls) -> None:
    """Register one model type with AutoConfig / AutoModel / AutoModelForCausalLM."""
    AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
    AutoModel.register(config_cls, model_cls, exist_ok=True)
    AutoModelForCausalLM.register(config_cls, lm_cls, exist_ok=True)
    MODEL_TYPES[config_cls.model_type] = (config_cls, model_cls, lm_cls)


register(LMLlamaConfig, LMLlamaModel, LMLlamaForCausalLM)
register(LMMamba2Config, LMMamba2Model, LMMamba2ForCausalLM)

# Families added in their own files register themselves here when present.
for _mod in ("deltaproduct", "fp_mamba", "lru"):
    try:
        _m = __import__(f"{__name__}.{_mod}", fromlist=["MODEL_CLASSES"])
    except ModuleNotFoundError as e:  # family not built yet
        if e.name != f"{__name__}.{_mod}":
            raise
        continue
    register(*_m.MODEL_CLASSES)
    for _cls in _m.MODEL_CLASSES:
        globals()[_cls.__name__] = _cls

__all__ = [
    "ImplicitSettings", "LMCache", "LMConfig", "LMForCausalLM", "LMModel", "LMOutput", "Mixer",
    "LMLlamaConfig", "LMLlamaForCausalLM", "LMLlamaModel",
    "LMMamba2Config", "LMMamba2ForCausalLM", "LMMamba2Model", "MODEL_TYPES", "register",
]
