"""Data: corpora -> tokenized shards (``lm prepare-data``) -> packed, resumable training batches.

- ``lm.data.tokenizer``: ``load_tokenizer``, ``tokenizer_identity`` (the shipped default: tokenizer/default)
- ``lm.data.sources``: what SOURCE means (shakespeare, local files, Hugging Face datasets), the val split
- ``lm.data.prepare``: ``prepare(...)`` and ``main(argv)`` behind ``lm prepare-data``
- ``lm.data.shards``: the on-disk format (shards + metadata.json)
- ``lm.data.reader``: ``TokenDataset``, ``TrainReader``, ``ValReader``
- ``lm.data.synthetic``: synthetic tasks (separate module)

``prepare_data`` and ``prepare_main`` (``lm.data.prepare.prepare_data`` / ``.main``) are imported on
first use, so that ``python -m lm.data.prepare`` does not import its own module twice.
"""
from lm.data.reader import IGNORE_INDEX, TokenDataset, TrainReader, ValReader, packed_cu_seqlens
from lm.data.shards import read_metadata
from lm.data.sources import DEFAULT_VAL_FRACTION, SourceSpec, iter_documents, split_of
from lm.data.tokenizer import (
    DEFAULT_TOKENIZER,
    EOS_TOKEN,
    check_identity,
    default_tokenizer_dir,
    load_tokenizer,
    tokenizer_identity,
)

__all__ = [
    "DEFAULT_TOKENIZER", "DEFAULT_VAL_FRACTION", "EOS_TOKEN", "IGNORE_INDEX", "SourceSpec", "TokenDataset",
    "TrainReader", "ValReader", "check_identity", "default_tokenizer_dir", "iter_documents", "load_tokenizer",
    "packed_cu_seqlens", "prepare_data", "prepare_main", "read_metadata", "split_of", "tokenizer_identity",
]


def __getattr__(name):
    if name in ("prepare_data", "prepare_main"):
        import importlib

        module = importlib.import_module("lm.data.prepare")
        return module.prepare_data if name == "prepare_data" else module.main
    raise AttributeError(f"module 'lm.data' has no attribute {name!r}")
