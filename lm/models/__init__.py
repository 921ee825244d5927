"""Model types, registered with transformers' Auto classes on import.

    lm_llama, lm_mamba2, lm_deltaproduct, lm_fp_mamba, lm_lru, and lm_hybrid (layers of several of them).
Each family file defines `<Family>Config`, its mixer, `<Family>Model` and `<Family>ForCausalLM`.
"""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import LMCache
from .config import ImplicitSettings, LMConfig
from .deltaproduct import LMDeltaProductConfig, LMDeltaProductForCausalLM, LMDeltaProductModel
from .fp_mamba import LMFPMambaConfig, LMFPMambaForCausalLM, LMFPMambaModel
from .hybrid import LMHybridConfig, LMHybridForCausalLM, LMHybridModel
from .llama import LMLlamaConfig, LMLlamaForCausalLM, LMLlamaModel
from .lru import LMLRUConfig, LMLRUForCausalLM, LMLRUModel
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
register(LMDeltaProductConfig, LMDeltaProductModel, LMDeltaProductForCausalLM)
register(LMFPMambaConfig, LMFPMambaModel, LMFPMambaForCausalLM)
register(LMLRUConfig, LMLRUModel, LMLRUForCausalLM)
register(LMHybridConfig, LMHybridModel, LMHybridForCausalLM)

__all__ = [
    "ImplicitSettings", "LMCache", "LMConfig", "LMForCausalLM", "LMModel", "LMOutput", "Mixer", "MODEL_TYPES",
    "register",
    "LMDeltaProductConfig", "LMDeltaProductForCausalLM", "LMDeltaProductModel",
    "LMFPMambaConfig", "LMFPMambaForCausalLM", "LMFPMambaModel",
    "LMHybridConfig", "LMHybridForCausalLM", "LMHybridModel",
    "LMLlamaConfig", "LMLlamaForCausalLM", "LMLlamaModel",
    "LMLRUConfig", "LMLRUForCausalLM", "LMLRUModel",
    "LMMamba2Config", "LMMamba2ForCausalLM", "LMMamba2Model",
]
