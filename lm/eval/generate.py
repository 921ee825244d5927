"""`lm generate CKPT "prompt"`: sampling from a checkpoint; implicit models prefill the prompt in parallel and
generate in sequential mode (each token iterated against the frozen cache; on CUDA in a captured step with
the fixed eval_max_iter iterations) and report iterations per token."""
from __future__ import annotations

import argparse
import time

import torch


def generate_text(model, tok, prompt: str, *, max_new_tokens: int = 100, temperature: float = 0.8,
                  top_k: int | None = 50, top_p: float | None = 0.95, seed: int = 0) -> tuple[str, dict]:
    """(completion text, stats {tokens, seconds, mean_iterations (implicit)})."""
    torch.manual_seed(seed)
    dev = next(model.parameters()).device
    ids = tok(prompt, return_tensors="pt").input_ids.to(dev)
    if ids.shape[1] == 0:
        ids = torch.tensor([[tok.eos_token_id]], device=dev)
    iters: list[float] = []
    hook = model.model.register_forward_hook(
        lambda m, args, out: iters.append(out[1]["iterations"]) if out[1] and "iterations" in out[1] else None)
    t0 = time.time()
    try:
        with torch.no_grad():
            kw = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p) if temperature > 0 \
                else dict(do_sample=False)
            out = model.generate(ids, max_new_tokens=max_new_tokens, pad_token_id=tok.eos_token_id,
                                 eos_token_id=None, **kw)
    finally:
        hook.remove()
    new = out[0, ids.shape[1]:]
    stats = {"tokens": int(new.numel()), "seconds": time.time() - t0}
    if iters:  # the first forward is the prompt's; the eager decode path calls the model for every token
        stats["prefill_iterations"] = iters[0]
        if len(iters) > 1:
            stats["mean_iterations"] = sum(iters[1:]) / len(iters[1:])
        elif stats["tokens"] > 1:  # static / graph decode: a fixed number of iterations per token
            stats["mean_iterations"] = float(model.config.implicit.eval_max_iter)
    return tok.decode(new, skip_special_tokens=True), stats


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="lm generate", description="sample text from a checkpoint")
    ap.add_argument("checkpoint")
    ap.add_argument("prompt", nargs="?", default="")
    ap.add_argument("--max-new-tokens", type=int, default=100)
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)

    import sys

    from .checkpoint import load_checkpoint

    try:
        model, tok = load_checkpoint(args.checkpoint, device=args.device)
    except ValueError as err:
        print(f"lm generate: {err}", file=sys.stderr)
        return 2
    text, st = generate_text(model, tok, args.prompt, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    print(args.prompt + text)
    line = f"[{st['tokens']} tokens in {st['seconds']:.1f}s"
    if "mean_iterations" in st:
        line += f", {st['mean_iterations']:.1f} fixed-point iterations per token (sequential mode)"
    print(line + "]")
    return 0
