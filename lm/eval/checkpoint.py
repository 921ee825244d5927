"""Load an exported checkpoint (a Hugging Face folder written by `lm export` / save_pretrained)."""
from __future__ import annotations

from pathlib import Path


def resolve_checkpoint(path: str | Path) -> Path:
    """A folder with config.json; a training run folder resolves to its `hf` export."""
    p = Path(path)
    for cand in (p, p / "hf", p / "export"):
        if (cand / "config.json").is_file():
            return cand
    raise ValueError(
        f"{path} is not a model folder (no config.json there or in {path}/hf). Pass the folder written by "
        "`lm export RUN_DIR` (or by save_pretrained)."
    )


def load_checkpoint(path, *, device: str | None = None, dtype: str | torch.dtype | None = None):
    """(model in eval mode, tokenizer). The tokenizer is the one saved with the model; the shipped default
    tokenizer is used (with a check of the vocabulary size) when the folder has none."""
    from lm.train.export import verify_export

    folder = resolve_checkpoint(path)  # (before the heavy imports: a wrong path is said at once)
    verify_export(folder)
    import torch
    from transformers import AutoModelForCausalLM

    import lm.models  # noqa: F401  (registers the model types)
    from lm.data.tokenizer import load_tokenizer

    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or torch.float32)
    except Exception as err:  # noqa: BLE001 - a damaged or foreign folder: one paragraph, not a traceback
        first = (str(err).strip().splitlines() or [""])[0][:300]
        raise ValueError(
            f"{folder} could not be loaded as a model ({type(err).__name__}: {first}). Its config.json or weights "
            "are damaged or incomplete, or it was not written by `lm export` / save_pretrained of an lm model: "
            "export it again with `lm export RUN_DIR`.") from None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    has_tok = (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
    tok = load_tokenizer(str(folder) if has_tok else None)
    if len(tok) > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tok)} tokens but the model's vocab_size is {model.config.vocab_size}: "
            f"{folder} was trained with another tokenizer; save it into the folder (lm export does)"
        )
    return model, tok
