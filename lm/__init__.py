"""lm: pretraining framework for expressive recurrent language models.

After `import lm`, transformers' AutoConfig / AutoModel / AutoModelForCausalLM know every model type (lm_llama,
lm_mamba2, lm_deltaproduct, lm_fp_mamba, lm_lru, lm_hybrid). `import lm` itself loads neither torch nor transformers: the
registration runs when transformers' Auto classes are first imported, or at once if they already are
(lm/_autoregister.py). `import lm.models` registers too.
"""
from ._autoregister import install as _install

__version__ = "0.1.0"

_install()
