"""``lm prepare-data``: documents -> tokens (worker processes) -> sharded binary token files.

    lm prepare-data --input shakespeare --output data/shakespeare          # the default corpus
    lm prepare-data --input 'corpus/*.jsonl' --tokenizer EleutherAI/gpt-neox-20b --output data/x --workers 8
    python -m lm.data.prepare ...                                           # the same, without the CLI

SOURCE (``--input``) is described in ``lm.data.sources``. Each document is tokenized without special
tokens (a literal ``<|endoftext|>`` in the text stays text) and followed by the tokenizer's EOS id.
Documents are split into ``train`` and ``val`` by ``lm.data.sources.split_of`` (whole documents; for
Shakespeare whole plays). The format is described in ``lm.data.shards``.

Workers tokenize chunks of documents in parallel; the main process writes them in source order, so
the output does not depend on ``--workers``. Whenever a shard is finished, all open shards are
flushed and ``metadata.json`` records a checkpoint; running the same command again after an
interruption keeps everything up to the last checkpoint and goes on from there. Running it on a
finished folder does nothing; different settings on an existing folder are refused (``--overwrite``).
A streamed source is read again from its start on resume (without tokenizing what is already done).

Python API: ``prepare_data(source, output, tokenizer=None, ...) -> metadata`` and ``main(argv) -> int``.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np

from lm.data.shards import (
    DTYPES,
    FORMAT,
    METADATA,
    SPLITS,
    VERSION,
    choose_dtype,
    read_metadata,
    shard_name,
    write_json_atomic,
)
from lm.data.sources import DEFAULT_VAL_FRACTION, SourceSpec, check_source, iter_documents, split_of
from lm.data.tokenizer import load_tokenizer, tokenizer_identity

DEFAULT_SHARD_TOKENS = 100_000_000
CHUNK_CHARS = 1 << 20  # text sent to a worker at once
CHUNK_DOCS = 4096
_SHARD_RE = re.compile(r"^(train|val)_\d{5}\.bin$")


# ------------------------------------------------------------------------------------- workers

_WORKER: dict = {}


def _init_worker(tokenizer_json: str, eos_id: int, dtype: str, single_thread: bool) -> None:
    """Build the Rust tokenizer once per worker (from its JSON: no transformers import needed)."""
    if single_thread:  # a worker process: one core each, and Ctrl-C is the main process's business
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["RAYON_NUM_THREADS"] = "1"
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True  # special-token text inside documents is encoded as plain text
    _WORKER.update(tok=tok, eos=eos_id, dtype=DTYPES[dtype])


def _encode_chunk(chunk: tuple[list[int], list[str], list[str]]):
    """Tokenize documents; returns (indices, splits, lengths incl. EOS, 0 for empty docs, tokens)."""
    indices, splits, texts = chunk
    tok, eos, dtype = _WORKER["tok"], _WORKER["eos"], _WORKER["dtype"]
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    encodings = encode(texts, add_special_tokens=False)
    lengths = np.zeros(len(texts), dtype=np.int64)
    flat: list[int] = []
    for i, enc in enumerate(encodings):
        ids = enc.ids
        if ids:
            flat.extend(ids)
            flat.append(eos)
            lengths[i] = len(ids) + 1
    tokens = np.asarray(flat, dtype=np.int64)
    if tokens.size and int(tokens.max()) > np.iinfo(dtype).max:
        raise ValueError(f"token id {int(tokens.max())} does not fit {np.dtype(dtype).name}; use --dtype uint32")
    return indices, splits, lengths, tokens.astype(dtype)


def _chunks(spec: SourceSpec, start: int, val_fraction: float):
    indices, splits, texts, chars = [], [], [], 0
    for doc in iter_documents(spec):
        if doc.index < start:
            continue
        indices.append(doc.index)
        splits.append(split_of(doc.group, val_fraction))
        texts.append(doc.text)
        chars += len(doc.text)
        if chars >= CHUNK_CHARS or len(texts) >= CHUNK_DOCS:
            yield indices, splits, texts
            indices, splits, texts, chars = [], [], [], 0
    if texts:
        yield indices, splits, texts


def _run_pool(chunks, workers: int, initargs: tuple):
    """Yield encoded chunks in order, at most 2*workers in flight (the source may be a huge stream)."""
    if workers <= 0:
        _init_worker(*initargs[:3], single_thread=False)
        for chunk in chunks:
            yield _encode_chunk(chunk)
        return
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with mp.get_context(method).Pool(workers, initializer=_init_worker, initargs=initargs) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_chunk, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# -------------------------------------------------------------------------------------- writing


class _SplitWriter:
    """Appends documents to the shards of one split; a shard is closed after it reaches shard_tokens."""

    def __init__(self, out: Path, split: str, dtype: str, shard_tokens: int, state: dict | None = None):
        self.out, self.split, self.dtype, self.shard_tokens = out, split, np.dtype(dtype), shard_tokens
        self.finished: list[dict] = []
        self.file = None
        self.cur_tokens = self.cur_docs = 0
        if state:
            self._restore(state)

    def _restore(self, state: dict) -> None:
        for shard in state["shards"]:
            path = self.out / shard["file"]
            want = shard["num_tokens"] * self.dtype.itemsize
            if not path.is_file() or path.stat().st_size != want:
                raise ValueError(f"finished shard {path} is missing or has the wrong size (want {want} bytes); "
                                 "the folder is damaged: run again with --overwrite")
            self.finished.append(dict(shard))
        cur = state.get("current")
        if cur:
            path = self.out / cur["file"]
            want = cur["num_tokens"] * self.dtype.itemsize
            if not path.is_file() or path.stat().st_size < want:
                raise ValueError(f"shard {path} is shorter than its checkpoint ({want} bytes); run again with --overwrite")
            self.file = open(path, "r+b")  # noqa: SIM115 - closed in _close
            self.file.truncate(want)
            self.file.seek(want)
            self.cur_tokens, self.cur_docs = cur["num_tokens"], cur["num_documents"]

    def files(self) -> set[str]:
        names = {s["file"] for s in self.finished}
        if self.file is not None:
            names.add(shard_name(self.split, len(self.finished)))
        return names

    def add(self, tokens: np.ndarray) -> bool:
        """Append one document (ending in EOS); True when this closed a shard."""
        if self.file is None:
            self.file = open(self.out / shard_name(self.split, len(self.finished)), "wb")  # noqa: SIM115
        self.file.write(tokens.tobytes())
        self.cur_tokens += len(tokens)
        self.cur_docs += 1
        if self.cur_tokens >= self.shard_tokens:
            self._close()
            return True
        return False

    def _close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.finished.append({"file": shard_name(self.split, len(self.finished)),
                              "num_tokens": self.cur_tokens, "num_documents": self.cur_docs})
        self.file, self.cur_tokens, self.cur_docs = None, 0, 0

    def state(self) -> dict:
        cur = None
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            cur = {"file": shard_name(self.split, len(self.finished)),
                   "num_tokens": self.cur_tokens, "num_documents": self.cur_docs}
        return {"num_tokens": sum(s["num_tokens"] for s in self.finished) + self.cur_tokens,
                "num_documents": sum(s["num_documents"] for s in self.finished) + self.cur_docs,
                "shards": list(self.finished), "current": cur}

    def finish(self) -> dict:
        if self.file is not None:
            self._close()
        return self.state()


def _after_shard(split: str, count: int) -> None:
    """Called after each finished shard (a hook for tests that simulate an interruption)."""


def _remove_prepared_files(out: Path) -> None:
    for p in out.iterdir():
        if _SHARD_RE.match(p.name) or p.name in (METADATA, METADATA + ".tmp"):
            p.unlink()


def _config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} (folder) vs {b!r} (now)")
    return diffs


# ------------------------------------------------------------------------------------------ main


def prepare_data(
    source: SourceSpec | str,
    output: str | os.PathLike,
    tokenizer: str | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    dtype: str = "auto",
    overwrite: bool = False,
    progress: bool = True,
    max_tokens: int | None = None,
) -> dict:
    """Tokenize SOURCE into shards under ``output``; returns the metadata (see ``lm.data.shards``)."""
    spec = SourceSpec(source) if isinstance(source, str) else source
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be positive, got {shard_tokens}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--max-tokens must be positive, got {max_tokens}")
    workers = min(8, os.cpu_count() or 1) if workers is None else workers
    if workers < 0:
        raise ValueError(f"--workers must be >= 0, got {workers}")
    check_source(spec)
    tok = load_tokenizer(tokenizer)
    identity = tokenizer_identity(tok, tokenizer)
    dtype = choose_dtype(identity["vocab_size"], dtype)
    config = json.loads(json.dumps({"source": spec.describe(), "tokenizer": identity, "dtype": dtype,
                                    "val_fraction": val_fraction, "shard_tokens": shard_tokens,
                                    "max_tokens": max_tokens}))
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / METADATA

    state = None
    if overwrite:
        _remove_prepared_files(out)
    elif meta_path.exists():
        old = read_metadata(out, require_complete=False)
        started = old.get("complete") or old.get("next_doc", 0) > 0
        diffs = _config_diff(old.get("config", {}), config)
        if diffs and not started:  # an earlier run failed before its first document: start afresh
            _remove_prepared_files(out)
            old = None
        elif diffs:
            raise ValueError(f"{out} already holds data prepared with other settings ({'; '.join(diffs)}); "
                             "use another --output, or --overwrite to replace it")
        if old and old.get("complete"):
            _log(progress, f"{out} is already prepared ({_summary(old)}); nothing to do")
            return old
        if old:
            state = old
            _log(progress, f"resuming {out} from document {old['next_doc']}")
    elif any(_SHARD_RE.match(p.name) for p in out.iterdir()):
        raise ValueError(f"{out} holds shard files but no {METADATA}; use another --output or --overwrite")

    writers = {s: _SplitWriter(out, s, dtype, shard_tokens, state and state["splits"].get(s)) for s in SPLITS}
    keep = set().union(*(w.files() for w in writers.values()))
    for p in out.iterdir():  # shards written after the last checkpoint
        if (_SHARD_RE.match(p.name) and p.name not in keep) or p.name == METADATA + ".tmp":
            p.unlink()
    meta = {"format": FORMAT, "version": VERSION, "complete": False, "config": config,
            "splits": {}, "next_doc": 0, "empty_documents": 0, "seconds": 0.0}
    if state:
        meta.update(next_doc=state["next_doc"], empty_documents=state["empty_documents"], seconds=state["seconds"])
    t0 = time.time() - meta["seconds"]

    def checkpoint(complete: bool = False) -> None:
        meta["splits"] = {s: (w.finish() if complete else w.state()) for s, w in writers.items()}
        meta["seconds"] = round(time.time() - t0, 3)
        meta["complete"] = complete
        if complete:
            meta["documents_seen"] = meta["next_doc"]
        write_json_atomic(meta_path, meta)

    checkpoint()
    done = sum(meta["splits"][s]["num_tokens"] for s in SPLITS)
    initargs = (tok.backend_tokenizer.to_str(), identity["eos_token_id"], dtype, True)
    results = _run_pool(_chunks(spec, meta["next_doc"], val_fraction), workers, initargs)
    first = next(results, None)  # starts the workers (fork) before the progress bar starts its thread
    pbar = _progress_bar(progress, done, out.name)
    shards_closed, total = 0, done
    try:
        for indices, splits, lengths, tokens in itertools.chain([first] if first else [], results):
            if max_tokens is not None and total >= max_tokens:
                break
            offset = 0
            for index, split, n in zip(indices, splits, lengths):
                meta["next_doc"] = index + 1
                if n == 0:
                    meta["empty_documents"] += 1
                    continue
                closed = writers[split].add(tokens[offset:offset + n])
                offset += n
                total += int(n)
                if closed:
                    checkpoint()
                    shards_closed += 1
                    _after_shard(split, shards_closed)
                if max_tokens is not None and total >= max_tokens:
                    break
            pbar.update(offset)
            pbar.set_postfix(docs=meta["next_doc"], refresh=False)
    finally:
        pbar.close()
        results.close()  # stops the worker pool now, also on errors and Ctrl-C
    if writers["train"].state()["num_tokens"] == 0:
        _remove_prepared_files(out)
        what = "no documents" if meta["next_doc"] == 0 else f"{meta['next_doc']} documents, none with text in the train split"
        raise ValueError(f"empty corpus: input {spec.input!r} gave {what}; check --input and --text-field")
    checkpoint(complete=True)
    if meta["splits"]["val"]["num_tokens"] == 0 and val_fraction > 0:
        _log(progress, f"warning: the val split is empty ({meta['next_doc']} documents, --val-fraction {val_fraction}); "
                       "raise --val-fraction to hold some documents out")
    _log(progress, f"prepared {out}: {_summary(meta)} in {meta['seconds']:.1f}s")
    return meta


def _summary(meta: dict) -> str:
    parts = []
    for s in SPLITS:
        info = meta["splits"].get(s, {})
        parts.append(f"{s} {info.get('num_tokens', 0):,} tokens / {info.get('num_documents', 0):,} docs / "
                     f"{len(info.get('shards', []))} shards")
    return ", ".join(parts) + f", {meta['config']['dtype']}"


def _log(enabled: bool, msg: str) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


def _progress_bar(enabled: bool, initial: int, name: str):
    """The tokenizing progress bar, on a terminal only: written to a job's log file its carriage returns make one
    long line (the closing summary line says what was prepared either way)."""
    from tqdm.auto import tqdm

    return tqdm(desc=f"prepare {name}", unit="tok", unit_scale=True, initial=initial,
                disable=not (enabled and sys.stderr.isatty()), dynamic_ncols=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lm prepare-data",
        description="Tokenize a corpus into sharded binary token files with a train/val split.",
        epilog="Default corpus: lm prepare-data --input shakespeare --output data/shakespeare",
    )
    p.add_argument("--input", required=True, metavar="SOURCE",
                   help="'shakespeare', local files (file, folder or glob of .txt/.jsonl/.parquet; comma-separated), "
                        "or a Hugging Face dataset name")
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="tokenizer folder, tokenizer.json or Hub name (default: the shipped tokenizer/default)")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                   help=f"fraction of documents held out as 'val' (default {DEFAULT_VAL_FRACTION})")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenizer processes (default: min(8, CPUs); 0 tokenizes in this process)")
    p.add_argument("--text-field", default="text", help="JSON field / column holding the text (default: text)")
    p.add_argument("--hf-name", default=None, help="Hugging Face dataset config name (e.g. sample-10BT)")
    p.add_argument("--hf-split", default="train", help="Hugging Face dataset split to read (default: train)")
    p.add_argument("--streaming", action="store_true", help="stream the Hugging Face dataset instead of downloading it")
    p.add_argument("--data-files", default=None, help="data_files for a Hugging Face builder such as json/parquet")
    p.add_argument("--max-documents", type=int, default=None, help="stop after this many source documents")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="stop after the document that brings the prepared tokens (train + val) to this many")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help=f"tokens per shard before a new one is started (default {DEFAULT_SHARD_TOKENS:,})")
    p.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"],
                   help="token dtype on disk (auto: uint16 when the vocabulary fits)")
    p.add_argument("--overwrite", action="store_true", help="replace data already prepared in DIR")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or messages")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    spec = SourceSpec(args.input, args.text_field, args.hf_name, args.hf_split, args.streaming,
                      args.data_files, args.max_documents)
    try:
        prepare_data(spec, args.output, tokenizer=args.tokenizer, val_fraction=args.val_fraction, workers=args.workers,
                shard_tokens=args.shard_tokens, dtype=args.dtype, overwrite=args.overwrite,
                progress=not args.no_progress, max_tokens=args.max_tokens)
    except (ValueError, FileNotFoundError) as err:
        print(f"lm prepare-data: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lm prepare-data: interrupted; run the same command again to resume {args.output}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
