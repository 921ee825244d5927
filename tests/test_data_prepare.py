"""lm prepare-data: round trip to the documents, workers, resume, dtype choice, sources and bad input."""
import json
import os

import numpy as np
import pytest

from lm.data import prepare as prep
from lm.data.reader import TokenDataset
from lm.data.shards import METADATA, choose_dtype
from lm.data.sources import SourceSpec, iter_documents, shakespeare_files, shakespeare_play, split_of
from lm.data.tokenizer import EOS_TOKEN, load_tokenizer, tokenizer_identity

WORDS = "thou art more lovely and temperate rough winds do shake the darling buds of may".split()


def make_docs(n, seed=0):
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(3, 60))).tolist()
        docs.append(f"Doc {i}: " + " ".join(words) + ("\n\n  indented\tline ünïcödé ✓" if i % 3 == 0 else "."))
    docs[4] = f"text with a literal {EOS_TOKEN} inside it"
    docs[7] = ""  # empty documents are skipped
    return docs


def write_jsonl(path, docs, field="text"):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({field: d, "meta": 1}) + "\n")
    return path


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def decode_split(tok, folder, split):
    ds = TokenDataset(folder, split)
    docs = list(ds.documents())
    assert len(docs) == ds.num_documents
    return [tok.decode(d.tolist(), clean_up_tokenization_spaces=False) for d in docs]


def expected_split(docs, val_fraction, split):
    return [d for i, d in enumerate(docs) if d and split_of(i, val_fraction) == split]


def files(folder):
    return {p: open(os.path.join(folder, p), "rb").read() for p in sorted(os.listdir(folder)) if p.endswith(".bin")}


def test_shards_decode_to_documents(tmp_path, tok):
    docs = make_docs(40)
    src = write_jsonl(tmp_path / "a.jsonl", docs[:25])
    write_jsonl(tmp_path / "b.jsonl", docs[25:])
    out = tmp_path / "out"
    meta = prep.prepare_data(str(tmp_path / "*.jsonl"), out, val_fraction=0.2, workers=0, shard_tokens=150, progress=False)
    assert src.exists() and meta["complete"] and meta["empty_documents"] == 1
    assert meta["config"]["dtype"] == "uint16" and meta["config"]["tokenizer"] == tokenizer_identity(tok)
    for split in ("train", "val"):
        assert decode_split(tok, out, split) == expected_split(docs, 0.2, split)
        info = meta["splits"][split]
        assert info["num_tokens"] == sum(s["num_tokens"] for s in info["shards"]) == TokenDataset(out, split).num_tokens
    assert len(meta["splits"]["train"]["shards"]) > 3  # shards end on document boundaries, >= shard_tokens
    assert all(s["num_tokens"] >= 150 for s in meta["splits"]["train"]["shards"][:-1])
    assert meta["splits"]["val"]["num_documents"] == 8
    eos = tok.eos_token_id
    for split in ("train", "val"):  # EOS only as the separator: the literal text stays text
        ds = TokenDataset(out, split)
        assert int((ds.read(0, ds.num_tokens) == eos).sum()) == ds.num_documents and ds.read(ds.num_tokens - 1, 1)[0] == eos


def test_workers_do_not_change_output_and_cli(tmp_path):
    docs = make_docs(60, seed=1)
    write_jsonl(tmp_path / "c.jsonl", docs)
    a, b = tmp_path / "w0", tmp_path / "w2"
    prep.prepare_data(str(tmp_path / "c.jsonl"), a, workers=0, shard_tokens=200, progress=False)
    old = (prep.CHUNK_CHARS, prep.CHUNK_DOCS)
    prep.CHUNK_CHARS, prep.CHUNK_DOCS = 500, 4  # many small chunks over 2 processes
    try:
        assert prep.main(["--input", str(tmp_path / "c.jsonl"), "--output", str(b), "--workers", "2",
                          "--shard-tokens", "200", "--no-progress"]) == 0
    finally:
        prep.CHUNK_CHARS, prep.CHUNK_DOCS = old
    assert files(a) == files(b) and len(files(a)) > 3


def test_resume_keeps_finished_shards(tmp_path, monkeypatch):
    docs = make_docs(60, seed=2)
    write_jsonl(tmp_path / "d.jsonl", docs)
    clean, out = tmp_path / "clean", tmp_path / "out"
    kw = dict(val_fraction=0.1, workers=0, shard_tokens=120, progress=False)
    prep.prepare_data(str(tmp_path / "d.jsonl"), clean, **kw)
    monkeypatch.setattr(prep, "CHUNK_DOCS", 5)

    def interrupt(split, count):
        if count == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_after_shard", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare_data(str(tmp_path / "d.jsonl"), out, **kw)
    meta = json.loads((out / METADATA).read_text())
    assert not meta["complete"] and 0 < meta["next_doc"] < 60
    with pytest.raises(ValueError, match="unfinished"):
        TokenDataset(out)
    kept = {s["file"]: (out / s["file"]).stat().st_ino for s in meta["splits"]["train"]["shards"]}
    assert len(kept) >= 2
    (out / "train_00099.bin").write_bytes(b"junk")  # a stray shard past the checkpoint is removed

    seen = []
    real = prep._encode_chunk
    monkeypatch.setattr(prep, "_after_shard", lambda split, count: None)
    monkeypatch.setattr(prep, "_encode_chunk", lambda chunk: (seen.extend(chunk[0]), real(chunk))[1])
    prep.prepare_data(str(tmp_path / "d.jsonl"), out, **kw)
    assert min(seen) == meta["next_doc"]  # only the rest was tokenized again
    assert files(out) == files(clean)
    assert {f: (out / f).stat().st_ino for f in kept} == kept  # finished shards kept, not rewritten
    assert json.loads((out / METADATA).read_text())["splits"] == json.loads((clean / METADATA).read_text())["splits"]

    seen.clear()  # a finished folder: nothing to do
    prep.prepare_data(str(tmp_path / "d.jsonl"), out, **kw)
    assert seen == []
    with pytest.raises(ValueError, match="val_fraction"):  # other settings are refused ...
        prep.prepare_data(str(tmp_path / "d.jsonl"), out, **{**kw, "val_fraction": 0.3})
    prep.prepare_data(str(tmp_path / "d.jsonl"), out, **{**kw, "val_fraction": 0.3}, overwrite=True)  # ... or replace
    assert json.loads((out / METADATA).read_text())["config"]["val_fraction"] == 0.3


def big_vocab_tokenizer(folder, size=70_000):
    """A word-level tokenizer whose ids pass 65535 (words 'w0'..), EOS last."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size - 2)}
    vocab["[UNK]"] = size - 2
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", unk_token="[UNK]")
    fast.add_special_tokens({"eos_token": "<eos>"})
    fast.save_pretrained(str(folder))
    return fast


def test_dtype_choice(tmp_path):
    assert choose_dtype(8192) == "uint16" and choose_dtype(65536) == "uint16" and choose_dtype(65537) == "uint32"
    with pytest.raises(ValueError, match="does not fit dtype uint16"):
        choose_dtype(70_000, "uint16")
    big = big_vocab_tokenizer(tmp_path / "bigtok")
    assert len(big) == 70_000
    docs = ["w1 w65535 w69000", "w65536 w3", "w69997 w2 w68000 w1"]
    write_jsonl(tmp_path / "e.jsonl", docs)
    out = tmp_path / "out32"
    meta = prep.prepare_data(str(tmp_path / "e.jsonl"), out, tokenizer=str(tmp_path / "bigtok"), val_fraction=0.0,
                             workers=0, progress=False)
    assert meta["config"]["dtype"] == "uint32" and meta["config"]["tokenizer"]["vocab_size"] == 70_000
    assert (out / "train_00000.bin").stat().st_size == 4 * meta["splits"]["train"]["num_tokens"]
    got = [[f"w{i}" if i < 69_998 else "?" for i in d] for d in TokenDataset(out).documents()]
    assert [" ".join(d) for d in got] == docs
    with pytest.raises(ValueError, match="does not fit dtype uint16"):
        prep.prepare_data(str(tmp_path / "e.jsonl"), tmp_path / "out16", tokenizer=str(tmp_path / "bigtok"),
                          dtype="uint16", workers=0, progress=False)
    # the shards know their tokenizer: the default one is refused for them
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        TokenDataset(out).check_tokenizer(None)
    TokenDataset(out).check_tokenizer(str(tmp_path / "bigtok"))


def test_bad_input(tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match="no such file"):
        prep.prepare_data(str(tmp_path / "missing" / "*.txt"), tmp_path / "o1", workers=0, progress=False)
    assert prep.main(["--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o2"), "--no-progress"]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    for i in range(3):
        (tmp_path / "empty" / f"{i}.txt").write_text("")
    with pytest.raises(ValueError, match="empty corpus"):
        prep.prepare_data(str(tmp_path / "empty"), tmp_path / "o3", workers=0, progress=False)
    assert not (tmp_path / "o3" / METADATA).exists()
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unsupported file type"):
        prep.prepare_data(str(tmp_path / "x.csv"), tmp_path / "o4", workers=0, progress=False)
    write_jsonl(tmp_path / "f.jsonl", ["a", "b"], field="content")
    with pytest.raises(ValueError, match="text-field"):
        prep.prepare_data(str(tmp_path / "f.jsonl"), tmp_path / "o5", workers=0, progress=False)
    # a run that failed before its first document does not block a corrected command
    meta = prep.prepare_data(SourceSpec(str(tmp_path / "f.jsonl"), text_field="content"), tmp_path / "o5",
                             val_fraction=0.0, workers=0, progress=False)
    assert meta["splits"]["train"]["num_documents"] == 2
    with monkeypatch.context() as m:  # a Hub dataset name without `datasets` installed
        m.setitem(__import__("sys").modules, "datasets", None)
        with pytest.raises(ValueError, match="pip install datasets"):
            prep.prepare_data("someone/some-dataset", tmp_path / "o7", workers=0, progress=False)
    with pytest.raises(ValueError, match="could not load tokenizer"):
        prep.prepare_data(str(tmp_path / "f.jsonl"), tmp_path / "o6", tokenizer=str(tmp_path / "no_such_tokenizer"),
                          workers=0, progress=False)


def test_txt_and_parquet_sources(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = make_docs(12, seed=3)
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(d, encoding="utf-8")
    pq.write_table(pa.table({"body": docs}), tmp_path / "p.parquet")
    got_txt = [d.text for d in iter_documents(SourceSpec(str(tmp_path / "txt")))]
    got_pq = [d.text for d in iter_documents(SourceSpec(str(tmp_path / "p.parquet"), text_field="body"))]
    assert got_txt == got_pq == docs
    prep.prepare_data(SourceSpec(str(tmp_path / "p.parquet"), text_field="body"), tmp_path / "o", val_fraction=0.25,
                      workers=0, progress=False)
    assert decode_split(tok, tmp_path / "o", "val") == expected_split(docs, 0.25, "val")


def test_hf_dataset_builder_on_local_files(tmp_path, tok, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    docs = make_docs(10, seed=4)
    write_jsonl(tmp_path / "g.jsonl", docs)
    spec = SourceSpec("json", data_files=str(tmp_path / "g.jsonl"), streaming=True, max_documents=6)
    prep.prepare_data(spec, tmp_path / "o", val_fraction=0.0, workers=0, progress=False)
    assert decode_split(tok, tmp_path / "o", "train") == [d for d in docs[:6] if d]


def test_shakespeare_source_and_split():
    files = shakespeare_files()
    assert len(files) == 77 and all(f.name != "metadata.txt" for f in files)
    docs = list(iter_documents(SourceSpec("shakespeare")))
    val = [files[d.index] for d in docs if split_of(d.group, 0.05) == "val"]
    plays = {shakespeare_play(f) for f in val}
    # whole plays are held out, both editions of each, about 5% of the texts
    assert 3 <= len(val) <= 8 and all(sum(shakespeare_play(f) == p for f in files) == sum(shakespeare_play(f) == p for f in val) for p in plays)
    assert shakespeare_play(files[0]) == shakespeare_play(files[1])  # all_is_well / alls_well
    assert [d.text for d in docs[:2]] == [f.read_text(encoding="utf-8-sig") for f in files[:2]]


def test_shakespeare_prepare_small(tmp_path, tok):
    meta = prep.prepare_data(SourceSpec("shakespeare", max_documents=3), tmp_path / "s", val_fraction=0.5,
                             workers=0, progress=False)
    texts = [f.read_text(encoding="utf-8-sig") for f in shakespeare_files()[:3]]
    # files 0, 1 are one play (group 0: train), file 2 is group 1 (val at fraction 0.5)
    assert meta["splits"]["train"]["num_documents"] == 2 and meta["splits"]["val"]["num_documents"] == 1
    assert decode_split(tok, tmp_path / "s", "val") == texts[2:]
    assert decode_split(tok, tmp_path / "s", "train") == texts[:2]


def test_max_tokens(tmp_path, tok):
    docs = make_docs(40, seed=5)
    write_jsonl(tmp_path / "h.jsonl", docs)
    meta = prep.prepare_data(str(tmp_path / "h.jsonl"), tmp_path / "o", val_fraction=0.2, workers=0, max_tokens=300,
                             shard_tokens=100, progress=False)
    total = sum(meta["splits"][s]["num_tokens"] for s in ("train", "val"))
    n = meta["next_doc"]
    assert 300 <= total and n < 40
    assert decode_split(tok, tmp_path / "o", "train") == expected_split(docs[:n], 0.2, "train")
    last = len(tok.encode(docs[n - 1], add_special_tokens=False)) + 1
    assert total - last < 300  # it stopped at the document that reached max_tokens


@pytest.mark.parametrize("tty", [False, True])
def test_progress_bar_only_on_a_terminal(tmp_path, tok, capsys, monkeypatch, tty):
    """A job's log file (stderr not a terminal) gets no bar, whose carriage returns would make one long line; a
    terminal gets it."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty, raising=False)
    write_jsonl(tmp_path / "a.jsonl", make_docs(10))
    prep.prepare_data(str(tmp_path / "a.jsonl"), tmp_path / "out", workers=0, progress=True)
    err = capsys.readouterr().err
    assert ("prepare out: " in err) == tty, err
    assert ("\r" in err) == tty
