"""lm: pretraining framework for expressive recurrent language models.

`import lm` registers every model type (lm_llama, lm_mamba2, lm_deltaproduct, lm_fp_mamba, lm_lru) with
transformers' AutoConfig / AutoModel / AutoModelForCausalLM. The `lm` command imports this package first
(its entry point is lm.cli): there the registration waits for the code that needs it (which imports
lm.models), so `lm --help`, `lm CMD --help` and early argument errors come without loading torch and
transformers.
"""
import os as _os
import sys as _sys

__version__ = "0.1.0"

if _os.path.basename((getattr(_sys, "argv", None) or [""])[0]) != "lm":
    from . import models  # noqa: E402,F401  (registration)
