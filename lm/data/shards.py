"""The on-disk format of prepared data: token shards and one metadata JSON.

A prepared folder holds, per split (``train``, ``val``), shard files ``{split}_{k:05d}.bin``: raw
little-endian token ids (``uint16`` when every id fits, else ``uint32``), documents one after another,
each followed by the EOS id. Shards end on document boundaries. ``metadata.json`` says everything
needed to read them::

    {"format": "lm-token-shards", "version": 1, "complete": true,
     "config": {"source": {...}, "tokenizer": {name, vocab_size, eos_token, eos_token_id, vocab_hash},
                "dtype": "uint16", "val_fraction": 0.05, "shard_tokens": 100000000},
     "splits": {"train": {"num_tokens": N, "num_documents": D,
                          "shards": [{"file": "train_00000.bin", "num_tokens": n, "num_documents": d}, ...],
                          "current": null}, "val": {...}},
     "next_doc": 1234, "documents_seen": 1234, "empty_documents": 0, "seconds": 12.3}

While a run is going ``complete`` is false, ``next_doc`` is the source index to resume from and each
split's ``current`` is the shard being appended ({file, num_tokens, num_documents} as of the last
checkpoint); resuming truncates it to that length.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

FORMAT = "lm-token-shards"
VERSION = 1
METADATA = "metadata.json"
SPLITS = ("train", "val")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def choose_dtype(vocab_size: int, requested: str = "auto") -> str:
    """'uint16' if every id (< vocab_size) fits in 16 bits, else 'uint32'; checks a requested dtype."""
    if requested == "auto":
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    if requested not in DTYPES:
        raise ValueError(f"dtype must be auto, uint16 or uint32, got {requested!r}")
    limit = int(np.iinfo(DTYPES[requested]).max) + 1
    if vocab_size > limit:
        raise ValueError(
            f"the tokenizer's vocabulary ({vocab_size} tokens, ids up to {vocab_size - 1}) does not fit "
            f"dtype {requested} (ids up to {limit - 1}); use --dtype uint32 or --dtype auto"
        )
    return requested


def shard_name(split: str, k: int) -> str:
    return f"{split}_{k:05d}.bin"


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metadata(data_dir: str | os.PathLike, require_complete: bool = True) -> dict:
    """Load and check ``metadata.json`` of a prepared folder; errors say what to run."""
    path = Path(data_dir) / METADATA
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(f"prepared data folder {data_dir} does not exist; run `lm prepare-data --output {data_dir} ...`")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {data_dir} is not a prepared data folder; run `lm prepare-data`")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{path}: unknown format {meta.get('format')!r} version {meta.get('version')!r} (expected {FORMAT!r} v{VERSION})")
    if require_complete and not meta.get("complete"):
        raise ValueError(f"{data_dir} holds an unfinished preparation; run the same `lm prepare-data` command again to finish it")
    return meta
