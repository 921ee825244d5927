"""Train a byte-level BPE tokenizer with Hugging Face `tokenizers` and save it for transformers.

The shipped default (lm/data/default_tokenizer/) was made by

    python scripts/train_tokenizer.py            # = --input shakespeare --vocab-size 8192 --output lm/data/default_tokenizer

It learns from the *training* split only (the held-out plays of `lm prepare-data --input shakespeare`
with the same --val-fraction are left out), so validation text is new to the tokenizer too.
Any SOURCE that `lm prepare-data` accepts works (local .txt/.jsonl/.parquet, a Hub dataset); use
--max-documents to learn from a sample of a large corpus.

The tokenizer: byte-level pre-tokenizer (GPT-2 regex) and decoder, no normalizer (decoding gives the
exact text back), `<|endoftext|>` as EOS/BOS/PAD (id 0). Saved as tokenizer.json, tokenizer_config.json
and special_tokens_map.json, loadable by `AutoTokenizer.from_pretrained(dir)`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lm.data.sources import DEFAULT_VAL_FRACTION, SourceSpec, iter_documents, split_of
from lm.data.tokenizer import DEFAULT_VOCAB_SIZE, EOS_TOKEN


def build_bpe_tokenizer(texts, vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2, show_progress: bool = True) -> Tokenizer:
    """A byte-level BPE learned from an iterable of strings; `<|endoftext|>` gets id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_for_transformers(tok: Tokenizer, output: str | Path, model_max_length: int = 1 << 20) -> Path:
    """Save as a transformers fast tokenizer folder (tokenizer.json + config + special tokens map)."""
    from transformers import PreTrainedTokenizerFast

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    # Compact JSON (less than half the size of the pretty-printed file) and a class name that every
    # transformers version maps to its fast tokenizer.
    fast.backend_tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/train_tokenizer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", default="shakespeare", help="SOURCE as for lm prepare-data (default: shakespeare)")
    p.add_argument("--output", default=str(Path(__file__).resolve().parents[1] / "lm" / "data" / "default_tokenizer"))
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                   help="held-out groups left out of training, as in lm prepare-data")
    p.add_argument("--text-field", default="text")
    p.add_argument("--hf-name", default=None)
    p.add_argument("--hf-split", default="train")
    p.add_argument("--streaming", action="store_true")
    p.add_argument("--data-files", default=None)
    p.add_argument("--max-documents", type=int, default=None)
    args = p.parse_args(argv)

    spec = SourceSpec(args.input, args.text_field, args.hf_name, args.hf_split, args.streaming,
                      args.data_files, args.max_documents)
    counts = {"train": 0, "val": 0}

    def texts():
        for doc in iter_documents(spec):
            split = split_of(doc.group, args.val_fraction)
            counts[split] += 1
            if split == "train" and doc.text:
                yield doc.text

    t0 = time.time()
    tok = build_bpe_tokenizer(texts(), args.vocab_size, args.min_frequency)
    if counts["train"] == 0:
        print(f"error: {args.input!r} gave no training documents", file=sys.stderr)
        return 2
    out = save_for_transformers(tok, args.output)
    print(f"trained byte-level BPE (vocab {tok.get_vocab_size()}) on {counts['train']} documents "
          f"({counts['val']} held out) in {time.time() - t0:.1f}s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
