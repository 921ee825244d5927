#!/usr/bin/env python
"""LM-head cross-entropy, forward+backward: the "recompute" path (PyTorch, fp32 softmax passes, the head
matmul again in the backward) against "grad_in_forward" (Triton row kernel, gradient formed in the forward),
and the unfused logits path where it fits. bf16, do_bench median (ms); prints a table, --json writes it.

    python scripts/dev/loss.py --tokens 32768 --hidden 1024 --vocab 50304 --json loss.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path



def main() -> int:
    import torch
    import triton.testing

    from lm.models.loss import linear_cross_entropy, reference_cross_entropy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    h = torch.randn(a.tokens, a.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (0.02 * torch.randn(a.vocab, a.hidden, device=dev)).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, a.vocab, (a.tokens,), device=dev)
    rows = {}

    def fb(fn):
        def run():
            loss = fn()
            torch.autograd.grad(loss, [h, w])
        return run

    cases = {
        "recompute": lambda: linear_cross_entropy(h, w, t, chunk_tokens=a.chunk, impl="recompute"),
        "grad_in_forward": lambda: linear_cross_entropy(h, w, t, chunk_tokens=a.chunk, impl="grad_in_forward"),
        "unfused": lambda: reference_cross_entropy(h, w, t),
    }
    for name, fn in cases.items():
        try:
            torch.cuda.reset_peak_memory_stats()
            ms = triton.testing.do_bench(fb(fn), warmup=25, rep=100, return_mode="median")
            mem = torch.cuda.max_memory_allocated() / 2**30
            rows[name] = {"ms": ms, "peak_gb": mem}
        except torch.OutOfMemoryError:
            rows[name] = {"ms": None, "peak_gb": None}
            torch.cuda.empty_cache()
        r = rows[name]
        print(f"{name:16s} f+b {r['ms'] if r['ms'] is None else round(r['ms'], 3)} ms  peak {r['peak_gb'] and round(r['peak_gb'], 2)} GB",
              flush=True)
    head = 6 * a.tokens * a.hidden * a.vocab
    print(f"head matmul floor (3 products): {head / 766e12 * 1e3:.2f} ms at 766 TFLOP/s")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
