"""Benchmark the data pipeline: preparation tokens/s by worker count, reader tokens/s per rank.

    lm bench data                        # the default corpus, 1 and 2 workers
    lm bench data --workers 1 2 4 --input 'corpus/*.jsonl' --json out/bench_data.json

Preparation is timed around `prepare_data` (tokenizer load, worker start, tokenization and writing;
not the Python start-up); each worker count writes a fresh folder in a temporary directory. The reader
is timed over `--seconds` of `next(reader)` per configuration, on the train split just prepared, as
one rank would see it (rank 0 of 8, so the permutation and stride of a data-parallel run are paid).
This is a benchmark for the report, not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from lm.data.prepare import prepare_data
from lm.data.reader import TokenDataset, TrainReader, ValReader
from lm.data.sources import SourceSpec


def bench_prepare(spec: SourceSpec, tokenizer, workers: int, root: str) -> dict:
    out = os.path.join(root, f"w{workers}")
    t0 = time.perf_counter()
    meta = prepare_data(spec, out, tokenizer=tokenizer, workers=workers, progress=False)
    seconds = time.perf_counter() - t0
    tokens = sum(meta["splits"][s]["num_tokens"] for s in meta["splits"])
    return {"workers": workers, "tokens": tokens, "documents": meta["next_doc"], "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds), "dir": out}


def bench_encode_cpu(spec: SourceSpec, tokenizer, max_chars: int = 4_000_000) -> dict:
    """Tokens per CPU-second of one worker (single-threaded encode + packing), independent of machine load."""
    from lm.data import prepare as prep
    from lm.data.sources import iter_documents
    from lm.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by `tokenizers` at each batch encode
    prep._init_worker(tok.backend_tokenizer.to_str(), tok.eos_token_id, "uint32", single_thread=False)
    texts, chars = [], 0
    for doc in iter_documents(spec):
        texts.append(doc.text)
        chars += len(doc.text)
        if chars >= max_chars:
            break
    c0 = time.process_time()
    _, _, _, tokens = prep._encode_chunk((list(range(len(texts))), ["train"] * len(texts), texts))
    cpu = time.process_time() - c0
    return {"chars": chars, "tokens": int(tokens.size), "cpu_seconds": round(cpu, 3),
            "tokens_per_cpu_s": round(tokens.size / cpu), "mb_text_per_cpu_s": round(chars / cpu / 1e6, 3)}


def bench_reader(reader, seconds: float) -> dict:
    next(iter(reader))  # warm the page cache and the permutation block
    n, batches, t0 = 0, 0, time.perf_counter()
    it = iter(reader)
    while time.perf_counter() - t0 < seconds:
        try:
            batch = next(it)
        except StopIteration:
            it = iter(reader)
            continue
        n += batch["input_ids"].numel()
        batches += 1
    elapsed = time.perf_counter() - t0
    return {"tokens_per_s": round(n / elapsed), "batches_per_s": round(batches / elapsed, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", default="shakespeare")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--max-documents", type=int, default=None)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seconds", type=float, default=3.0, help="time per reader configuration")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    spec = SourceSpec(args.input, max_documents=args.max_documents)
    results = {"cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "prepare": [], "reader": []}
    with tempfile.TemporaryDirectory(prefix="bench_data_") as root:
        for w in args.workers:
            r = bench_prepare(spec, args.tokenizer, w, root)
            results["prepare"].append(r)
            print(f"prepare  workers={w}: {r['tokens']:,} tokens in {r['seconds']:.1f}s = {r['tokens_per_s']:,} tokens/s",
                  flush=True)
        r = results["encode_cpu"] = bench_encode_cpu(spec, args.tokenizer)
        print(f"encode   one worker: {r['tokens_per_cpu_s']:,} tokens per CPU-second ({r['mb_text_per_cpu_s']} MB text)",
              flush=True)
        folder = results["prepare"][0]["dir"]
        train, val = TokenDataset(folder, "train"), TokenDataset(folder, "val")
        configs = [(256, 8, False), (1024, 8, False), (2048, 8, False), (2048, 8, True), (4096, 4, True)]
        for seq_len, b, cu in configs:
            reader = TrainReader(train, seq_len, b, seed=0, rank=0, world_size=8, cu_seqlens=cu)
            r = {"reader": "train", "seq_len": seq_len, "micro_batch_size": b, "cu_seqlens": cu, **bench_reader(reader, args.seconds)}
            results["reader"].append(r)
            print(f"train reader T={seq_len} B={b} cu_seqlens={cu}: {r['tokens_per_s']:,} tokens/s per rank", flush=True)
        if val.num_tokens > 1:
            r = {"reader": "val", "seq_len": 2048, "micro_batch_size": 8, "cu_seqlens": False,
                 **bench_reader(ValReader(val, 2048, 8), args.seconds)}
            results["reader"].append(r)
            print(f"val reader T=2048 B=8: {r['tokens_per_s']:,} tokens/s", flush=True)
    results["load_avg_1m_end"] = os.getloadavg()[0]
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps({k: v for k, v in results.items() if k.startswith(("cpu", "load"))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
