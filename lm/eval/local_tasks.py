"""Offline lm-eval tasks built from a prepared corpus's held-out split.

    python -m lm.eval.local_tasks --data data/shakespeare --output data/lm_tasks
    lm eval CKPT --tasks lm_local_lastword,lm_local_continuation --include-path data/lm_tasks
    lm eval CKPT --tasks lm_local_generate --include-path data/lm_tasks [--decode eager]   (generation)
    lm_eval --model hf --model_args pretrained=CKPT,trust_remote_code=True \
        --tasks lm_local_lastword --include_path data/lm_tasks --batch_size 16

The task YAMLs ship in this package (lm/eval/tasks/) as templates; building writes the JSONL data and
copies of the YAMLs pointing at it. The standard tasks (lambada_openai, hellaswag, ...) need their
datasets: where the Hub is unreachable, download them elsewhere and point a copy of the task YAML at
local files (`dataset_path: json` + `dataset_kwargs: {data_files: ...}`), or set HF_DATASETS_OFFLINE=1
with a pre-filled datasets cache.
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "tasks"
TASKS = ("lm_local_lastword", "lm_local_continuation", "lm_local_generate")


def _passages(texts: list[str], words_per_passage: int) -> list[list[str]]:
    out = []
    for text in texts:
        words = [w for w in re.split(r"\s+", text) if w]
        for i in range(0, len(words) - words_per_passage, words_per_passage):
            out.append(words[i:i + words_per_passage])
    return out


def build_local_tasks(data_dir, out_dir, *, n_lastword: int = 200, n_continuation: int = 200,
                      context_words: int = 40, continuation_words: int = 8, seed: int = 0,
                      split: str = "val") -> Path:
    """Write lastword.jsonl, continuation.jsonl, generate.jsonl (the continuation passages' contexts and the
    word after each) and the task YAMLs into out_dir; return it."""
    from lm.data.reader import TokenDataset
    from lm.data.tokenizer import load_tokenizer

    ds = TokenDataset(data_dir, split)
    ident = ds.tokenizer_identity
    tok = load_tokenizer(ident.get("name"))
    texts = [tok.decode(doc.tolist()) for doc in ds.documents()]
    if not texts:
        raise ValueError(f"the {split} split of {data_dir} has no documents; prepare the data with --val-fraction > 0")
    rng = random.Random(seed)

    lastword = []
    for words in _passages(texts, context_words + 1):
        last = re.sub(r"[^\w'-]+$", "", words[-1])
        last = re.sub(r"^[^\w']+", "", last)
        if len(last) >= 3 and last.isalpha():
            lastword.append({"text": " ".join(words[:-1] + [last])})
    rng.shuffle(lastword)
    lastword = lastword[:n_lastword]

    span = context_words + continuation_words
    passages = _passages(texts, span)
    rng.shuffle(passages)
    continuation, generate = [], []
    pool = [p[context_words:] for p in passages]
    for i, words in enumerate(passages[:n_continuation]):
        true = " " + " ".join(words[context_words:])
        distractors = []
        while len(distractors) < 3:
            j = rng.randrange(len(pool))
            if j != i:
                distractors.append(" " + " ".join(pool[j]))
        label = rng.randrange(4)
        choices = distractors[:label] + [true] + distractors[label:]
        continuation.append({"context": " ".join(words[:context_words]), "choices": choices, "label": label})
        first = re.sub(r"[^\w'-]+", "", words[context_words])
        if first.isalpha():  # the generation task: the word after the context
            generate.append({"context": " ".join(words[:context_words]), "target": first})
    if len(lastword) < 10 or len(continuation) < 10:
        raise ValueError(f"the {split} split of {data_dir} is too small to build the local tasks "
                         f"({len(lastword)} last-word, {len(continuation)} continuation examples)")

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("lastword", lastword), ("continuation", continuation), ("generate", generate)):
        with open(out / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    for task in TASKS:
        text = (TEMPLATES / f"{task}.yaml").read_text().replace("__DATA_DIR__", str(out))
        (out / f"{task}.yaml").write_text(text)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lm.eval.local_tasks", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/shakespeare", help="prepared data folder (lm prepare-data)")
    ap.add_argument("--output", "--out", dest="out", default="data/lm_tasks", help="folder to write the tasks to")
    ap.add_argument("--n", type=int, default=200, help="examples per task")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = build_local_tasks(args.data, args.out, n_lastword=args.n, n_continuation=args.n, seed=args.seed)
    print(f"wrote {', '.join(TASKS)} to {out} (use --include-path {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
