"""Tokenizers: the shipped default and any Hugging Face tokenizer, plus the identity stored with shards.

The shipped default lives in ``lm/data/default_tokenizer/`` (package data) (a byte-level BPE with
8192 tokens trained on the training split of the default Shakespeare corpus by
``scripts/train_tokenizer.py``; ``<|endoftext|>`` is its EOS, also used as BOS and PAD).

- ``load_tokenizer(name_or_path=None)`` returns a fast tokenizer (``PreTrainedTokenizerFast``):
  ``None`` or ``"default"`` is the shipped one, a folder or a ``tokenizer.json`` file is loaded from
  disk, anything else goes to ``AutoTokenizer.from_pretrained`` (a Hub name; needs network or cache).
- ``tokenizer_identity(tok, name)`` is the dict written into the shard metadata: name, vocab size
  (``len(tok)``: base vocabulary plus added tokens), EOS id and a hash of the tokenization model
  (vocabulary, merges, added tokens, normalizer, pre-tokenizer). Two tokenizers that encode text the
  same way have the same hash, whatever path they were loaded from.
- ``check_identity(expected, actual)`` raises a ``ValueError`` naming what differs.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

DEFAULT_TOKENIZER = "default"
EOS_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192


def default_tokenizer_dir() -> Path:
    """The folder of the shipped default tokenizer (package data); FileNotFoundError with a fix if missing."""
    from ..resources import package_dir

    path = package_dir("data", "default_tokenizer")
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"the shipped default tokenizer is missing: expected {path / 'tokenizer.json'}. "
            "Reinstall lm, or train it again with `python scripts/train_tokenizer.py`, "
            "or pass a tokenizer name/path explicitly."
        )
    return path


def load_tokenizer(name_or_path: str | os.PathLike | None = None):
    """Load a fast tokenizer: None/"default" (shipped), a local folder or tokenizer.json, or a Hub name."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if name_or_path is None or str(name_or_path) == DEFAULT_TOKENIZER:
        path = default_tokenizer_dir()
        tok = AutoTokenizer.from_pretrained(str(path))
    else:
        path = Path(os.path.expanduser(str(name_or_path)))
        if path.is_file():
            if path.suffix != ".json":
                raise ValueError(f"tokenizer file {path} is not a tokenizer.json; pass its folder instead")
            if (path.parent / "tokenizer_config.json").is_file():  # the config names EOS and friends
                tok = AutoTokenizer.from_pretrained(str(path.parent))
            else:
                tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
        elif path.is_dir():
            tok = AutoTokenizer.from_pretrained(str(path))
        else:
            try:
                tok = AutoTokenizer.from_pretrained(str(name_or_path))
            except Exception as err:  # noqa: BLE001 - re-raised with what to do
                raise ValueError(
                    f"could not load tokenizer {str(name_or_path)!r}: it is not a local folder or "
                    f"tokenizer.json, and loading it from the Hugging Face Hub failed ({err}). "
                    "Check the name, or download it where the Hub is reachable and pass its folder."
                ) from err
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(f"tokenizer {str(name_or_path)!r} is not a fast (Rust `tokenizers`) tokenizer")
    if tok.eos_token_id is None:
        raise ValueError(
            f"tokenizer {str(name_or_path)!r} has no EOS token; documents are separated by EOS, "
            "so set eos_token in its tokenizer_config.json"
        )
    return tok


def tokenizer_hash(tok) -> str:
    """sha256 (hex, 16 chars) of the parts of a fast tokenizer that decide which ids text gets."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    added = sorted((t["id"], t["content"]) for t in spec.get("added_tokens") or [])
    key = {
        "model": spec.get("model"),
        "added_tokens": added,
        "normalizer": spec.get("normalizer"),
        "pre_tokenizer": spec.get("pre_tokenizer"),
    }
    blob = json.dumps(key, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def tokenizer_identity(tok, name: str | None = None) -> dict:
    """The identity recorded in shard metadata: {name, vocab_size, eos_token, eos_token_id, vocab_hash}."""
    return {
        "name": DEFAULT_TOKENIZER if name is None else str(name),
        "vocab_size": int(len(tok)),
        "eos_token": tok.eos_token,
        "eos_token_id": int(tok.eos_token_id),
        "vocab_hash": tokenizer_hash(tok),
    }


def check_identity(expected: dict, actual: dict, what: str = "shards") -> None:
    """Raise ValueError unless two identities tokenize alike (vocab size, EOS id and hash agree)."""
    for field in ("vocab_size", "eos_token_id", "vocab_hash"):
        if expected.get(field) != actual.get(field):
            raise ValueError(
                f"tokenizer mismatch: the {what} were prepared with tokenizer {expected.get('name')!r} "
                f"({field}={expected.get(field)!r}) but the given tokenizer {actual.get('name')!r} has "
                f"{field}={actual.get(field)!r}. Prepare the data again with the model's tokenizer "
                "(lm prepare-data --tokenizer ...) or use the tokenizer the data was prepared with."
            )
