"""lm: pretraining framework for expressive recurrent language models.

`import lm` registers every model type (lm_llama, lm_mamba2, lm_deltaproduct, lm_fp_mamba, lm_lru) with
transformers' AutoConfig / AutoModel / AutoModelForCausalLM.
"""

__version__ = "0.1.0"

from . import models  # noqa: E402,F401  (registration)
