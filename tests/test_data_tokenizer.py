"""The shipped default tokenizer, tokenizer identity, and the BPE training script."""
import importlib.util
import os
from pathlib import Path

import pytest

from lm.data import tokenizer as tk
from lm.data.tokenizer import EOS_TOKEN, load_tokenizer, tokenizer_hash, tokenizer_identity

ROOT = Path(__file__).resolve().parents[1]


def load_train_script():
    spec = importlib.util.spec_from_file_location("train_tokenizer", ROOT / "scripts" / "train_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_tokenizer_files_and_loading():
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder = tk.default_tokenizer_dir()
    assert folder.parent.parent == Path(tk.__file__).parent.parent  # package data of lm
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(os.listdir(folder))
    assert sum((folder / f).stat().st_size for f in os.listdir(folder)) < 400_000  # small enough to ship
    tok = load_tokenizer()
    assert len(tok) == 8192 and tok.eos_token == EOS_TOKEN and tok.eos_token_id == 0
    assert tok.bos_token_id == tok.pad_token_id == 0
    auto = AutoTokenizer.from_pretrained(str(folder))
    raw = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    assert tokenizer_hash(auto) == tokenizer_hash(raw) == tokenizer_hash(tok)
    assert tokenizer_identity(load_tokenizer(str(folder / "tokenizer.json")))["vocab_hash"] == tokenizer_identity(tok)["vocab_hash"]
    text = "  To be, or not to be: that is the question.\n\tÜber naïve 😀 text\r\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and auto.encode(text, add_special_tokens=False) == ids
    assert len(ids) < len(text.encode()) * 0.6  # it learned merges (Shakespeare-ish text compresses)


def test_missing_default_tokenizer_is_a_clear_error(tmp_path, monkeypatch):
    import lm.resources

    monkeypatch.setattr(lm.resources, "package_dir", lambda *parts: tmp_path.joinpath(*parts))
    with pytest.raises(FileNotFoundError, match="train_tokenizer.py"):
        load_tokenizer()


def test_identity_tells_tokenizers_apart(tmp_path):
    module = load_train_script()
    texts = ["the quick brown fox jumps over the lazy dog"] * 20 + ["pack my box with five dozen liquor jugs"] * 20
    a = module.save_for_transformers(module.build_bpe_tokenizer(texts, 300, show_progress=False), tmp_path / "a")
    b = module.save_for_transformers(module.build_bpe_tokenizer(texts[:20], 300, show_progress=False), tmp_path / "b")
    ta, tb = load_tokenizer(str(a)), load_tokenizer(str(b))
    assert ta.eos_token_id == 0 and ta.decode(ta.encode("jumps over")) == "jumps over"
    ia, ib = tokenizer_identity(ta, "a"), tokenizer_identity(tb, "b")
    assert ia["vocab_hash"] != ib["vocab_hash"]
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        tk.check_identity(ia, ib)
    tk.check_identity(ia, tokenizer_identity(load_tokenizer(str(a / "tokenizer.json")), "same, other path"))


def test_train_script_cli(tmp_path):
    (tmp_path / "c").mkdir()
    for i in range(4):
        (tmp_path / "c" / f"{i}.txt").write_text(f"document number {i}: some words, more words and words again.\n" * 5)
    module = load_train_script()
    assert module.main(["--input", str(tmp_path / "c"), "--output", str(tmp_path / "tok"), "--vocab-size", "280",
                        "--val-fraction", "0.25"]) == 0
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert 257 < len(tok) <= 280 and tok.eos_token == EOS_TOKEN
