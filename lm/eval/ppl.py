"""Held-out perplexity by context length (paper 003, Table 3): JSON and a PNG plot.

    lm ppl CKPT --data data/shakespeare --lengths 2048,4096,8192,16384

For each length L the held-out split is cut into consecutive windows of L tokens; the perplexity is
exp(mean next-token loss) over every target in the windows used. Implicit models run in simultaneous
mode at the evaluation cap; their mean solver iterations per length are reported too.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F


@torch.no_grad()
def perplexity_by_length(model, dataset, lengths: list[int], *, max_tokens: int = 65536,
                         batch_size: int = 1) -> list[dict]:
    """[{length, ppl, loss, tokens, windows, iterations}] for each length."""
    from lm.data.reader import ValReader

    device = next(model.parameters()).device
    rows = []
    for length in lengths:
        if dataset.num_tokens < length + 1:
            rows.append({"length": length, "ppl": None, "skipped": f"held-out split has {dataset.num_tokens} tokens"})
            continue
        n_batches = max(1, max_tokens // (length * batch_size))
        total, count, windows, iters = 0.0, 0, 0, []
        for batch in ValReader(dataset, length, batch_size, max_batches=n_batches):
            ids, tgt = batch["input_ids"].to(device), batch["targets"].to(device)
            if (tgt != -100).sum(1).min() < length:  # only full windows: every row has L targets
                keep = (tgt != -100).sum(1) == length
                if not keep.any():
                    continue
                ids, tgt = ids[keep], tgt[keep]
            out = model(ids)
            loss = F.cross_entropy(out.logits.float().flatten(0, 1), tgt.flatten(), ignore_index=-100,
                                   reduction="sum")
            total += float(loss)
            count += int((tgt != -100).sum())
            windows += ids.shape[0]
            if out.fixed_point_stats:
                iters.append(out.fixed_point_stats.get("iterations", float("nan")))
        if count == 0:
            rows.append({"length": length, "ppl": None, "skipped": "no full window"})
            continue
        mean = total / count
        rows.append({"length": length, "loss": mean, "ppl": math.exp(mean), "tokens": count, "windows": windows,
                     "iterations": (sum(iters) / len(iters)) if iters else None})
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(r["length"], r["ppl"]) for r in rows if r.get("ppl") is not None]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="lm ppl", description="held-out perplexity by context length")
    ap.add_argument("checkpoint")
    ap.add_argument("--data", default="data/shakespeare", help="prepared data folder (its val split)")
    ap.add_argument("--split", default="val")
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--max-tokens", type=int, default=65536, help="tokens evaluated per length")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    ap.add_argument("--output", "--out", dest="out", default=None, help="output folder (default: CKPT)")
    args = ap.parse_args(argv)

    from lm.data.reader import TokenDataset

    from .checkpoint import load_checkpoint, resolve_checkpoint

    model, tok = load_checkpoint(args.checkpoint, device=args.device, dtype=args.dtype)
    ds = TokenDataset(args.data, args.split)
    ds.check_tokenizer(tok)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    rows = perplexity_by_length(model, ds, lengths, max_tokens=args.max_tokens, batch_size=args.batch_size)
    out = Path(args.out) if args.out else resolve_checkpoint(args.checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ppl_by_length.json").write_text(json.dumps({"checkpoint": str(args.checkpoint), "rows": rows}, indent=2))
    plot(rows, out / "ppl_by_length.png", f"{Path(args.checkpoint).name} ({args.data}, {args.split})")
    print(f"{'length':>8s} {'ppl':>10s} {'tokens':>9s} {'iters':>6s}")
    for r in rows:
        if r.get("ppl") is None:
            print(f"{r['length']:8d} {'-':>10s}  ({r['skipped']})")
        else:
            it = f"{r['iterations']:.1f}" if r["iterations"] is not None else "-"
            print(f"{r['length']:8d} {r['ppl']:10.3f} {r['tokens']:9d} {it:>6s}")
    print(f"written {out / 'ppl_by_length.json'} and {out / 'ppl_by_length.png'}")
    return 0
