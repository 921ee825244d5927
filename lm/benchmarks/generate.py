"""Generation speed: prefill ms and decode ms/token of lm models beside transformers' eager Llama, same process.

    lm bench generate [--models llama,mamba2,deltaproduct,hybrid,implicit_mamba2,hf_llama] [--batch 1,16,64]
                      [--prompt 512,2048] [--new-tokens 256] [--decode auto] [--out bench_generate.json]
    lm bench generate --quick          # CPU: tiny presets, static-cache decode (tests the script)

Models (random weights, bf16 on CUDA): lm_llama-350m, lm_mamba2-350m, lm_deltaproduct-392m-nh2, the Mamba2 +
attention hybrid lm_hybrid-mamba2-350m, implicit lm_mamba2-350m (eval cap 8 iterations, tol 0.05: the issue's
setting), and transformers' LlamaForCausalLM with lm_llama-350m's dims: hf_llama with eager attention and its default
(dynamic) cache, hf_llama_static with SDPA and its static cache (generate's cache_implementation="static"). For each
batch size B and prompt length:

- prefill_ms: one forward over the prompt that fills a fresh cache (implicit: the parallel prefill, a
  simultaneous solve plus the committing pass), median of 3 after a warm-up;
- simultaneous_ms (implicit): one forward without a cache at the evaluation cap (the acceptance's yardstick:
  prefill <= 2x this);
- decode_ms_per_token: greedy `generate` of --new-tokens tokens (min = max, so none stop early) timed whole,
  minus prefill_ms, divided by the new tokens after the first; the HF generation loop is included, as users
  see it. One warm-up `generate` before (captures the CUDA graph for the shape);
- graph_step_ms (lm models, CUDA graph): one replay of the captured step alone; decode_ms_per_token minus
  this is what the generation loop around it costs;
- eager_decode_ms_per_token (lm models, B = 1, first prompt length): the same with decode="eager"
  (--eager-tokens tokens), the per-token Python path the graph replaces.

The implicit model runs at --implicit-shapes (default B 1, 16 and prompt 512: the issue's acceptance shape; at
B 64 x 2048 its prefill alone takes tens of seconds). Ratios to the transformers Llama's decode time at the same (B, prompt) are added, and the JSON (--out) holds
every row plus the device and versions.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

MODELS = {
    "llama": ("lm_llama-350m", None),
    "mamba2": ("lm_mamba2-350m", None),
    "deltaproduct": ("lm_deltaproduct-392m-nh2", None),
    "hybrid": ("lm_hybrid-mamba2-350m", None),
    "implicit_mamba2": ("lm_mamba2-350m", dict(max_iter=2, eval_factor=4.0, tol=0.05)),
    "hf_llama": ("lm_llama-350m", "hf"),
    "hf_llama_static": ("lm_llama-350m", "hf_static"),
}
HF = ("hf_llama", "hf_llama_static")  # transformers' models (the ratios' references)
QUICK = {"lm_llama-350m": "lm_llama-tiny", "lm_mamba2-350m": "lm_mamba2-tiny",
         "lm_deltaproduct-392m-nh2": "lm_deltaproduct-tiny", "lm_hybrid-mamba2-350m": "lm_hybrid-mamba2-tiny"}


def build(name: str, quick: bool, device, dtype):
    import lm  # noqa: F401  (registration)
    from lm.models.presets import load_config
    from transformers import AutoModelForCausalLM

    preset, extra = MODELS[name]
    if quick:
        preset = QUICK[preset]
    if extra in ("hf", "hf_static"):
        from transformers import LlamaConfig, LlamaForCausalLM

        ours = load_config(preset)
        cfg = LlamaConfig(vocab_size=ours.vocab_size, hidden_size=ours.hidden_size,
                          num_hidden_layers=ours.num_hidden_layers, num_attention_heads=ours.num_attention_heads,
                          num_key_value_heads=ours.num_key_value_heads, intermediate_size=ours.intermediate_size,
                          rope_theta=ours.rope_theta, max_position_embeddings=8192, tie_word_embeddings=True,
                          rms_norm_eps=ours.rms_norm_eps,
                          attn_implementation="eager" if extra == "hf" else "sdpa")
        model = LlamaForCausalLM(cfg)
    else:
        model = AutoModelForCausalLM.from_config(load_config(preset, implicit=extra))
    return model.to(device=device, dtype=dtype).eval()


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn, sync) -> float:
    """Median of 3 timed calls after two warm-up calls; a call over a second is timed once (the warm-ups' own times
    are not used: they compile / autotune, and the implicit solve captures its graphs at a key's second call,
    lm.models.solve_graph: with one warm-up the B 16 prompt 2048 prefill, over a second, was timed once with its
    capture in it)."""
    fn()
    fn()
    first = timed(fn, sync)
    if first > 1000:
        return first
    return statistics.median([first] + [timed(fn, sync) for _ in range(2)])


def measure(model, name, batch, prompt_len, new_tokens, decode, eager_tokens, sync, device) -> dict:
    from lm.models import LMCache

    ours = name not in HF
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (batch, prompt_len), device=device)
    mask = torch.ones_like(ids)
    row = {"model": name, "batch": batch, "prompt": prompt_len, "new_tokens": new_tokens}

    def prefill():
        with torch.no_grad():
            if ours:
                model(ids, cache=LMCache(model.config.num_hidden_layers), use_cache=True, logits_to_keep=1)
            else:
                model(ids, use_cache=True, logits_to_keep=1)

    row["prefill_ms"] = median_ms(prefill, sync)
    if ours and model.config.implicit:
        def simultaneous():
            with torch.no_grad():
                model(ids, logits_to_keep=1)
        row["simultaneous_ms"] = median_ms(simultaneous, sync)
        row["prefill_over_simultaneous"] = row["prefill_ms"] / row["simultaneous_ms"]
        row["eval_max_iter"] = model.config.implicit.eval_max_iter

    def generate(n, mode):
        kw = dict(decode=mode) if ours else dict(cache_implementation="static") if name == "hf_llama_static" else {}
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0, eos_token_id=None, **kw)

    # warm-up: captures the decode step for this batch size / cache capacity. transformers' static cache is sized
    # for prompt + max_new_tokens and its compiled step specialises on that size: warm it at the timed length (a
    # 2-token warm-up left the timed run recompiling: 282 ms / token at 64 new tokens, H100)
    generate(new_tokens if name == "hf_llama_static" else 2, decode)
    # the median of three timed generations (one each: 4e9175d's Mamba2-350M decode read 1.68 and 1.52 ms / token in
    # two runs on H100s)
    total = statistics.median(timed(lambda: generate(new_tokens, decode), sync) for _ in range(3))
    row["generate_ms"] = total
    row["decode_ms_per_token"] = max(total - row["prefill_ms"], 0.0) / max(new_tokens - 1, 1)
    if ours:
        row["decode"] = decode
        from lm.models import decode as D

        dec = [d for k, d in D._DECODERS.get(model, {}).items() if k[0] == batch and d.graph is not None]
        if dec:  # the captured step alone (no generation loop around it): what the HF loop adds is the rest
            dec[0].graph.replay()
            row["graph_step_ms"] = timed(lambda: [dec[0].graph.replay() for _ in range(20)], sync) / 20
        if eager_tokens:
            generate(2, "eager")
            t = timed(lambda: generate(eager_tokens, "eager"), sync)
            row["eager_decode_ms_per_token"] = max(t - row["prefill_ms"], 0.0) / max(eager_tokens - 1, 1)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lm bench generate", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--prompt", default="512,2048")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--eager-tokens", type=int, default=32,
                    help="tokens of the eager-decode comparison at B = 1 and the first prompt length (0 = skip)")
    ap.add_argument("--implicit-shapes", default="1,16:512",
                    help="B list:prompt list of the implicit model (its prefill is a solve of eval_max_iter + 1 "
                         "passes); 'all' = the shapes of the others")
    ap.add_argument("--decode", default="auto", help="decode path of the lm models: auto | graph | static | eager")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--output", "--out", dest="out", default=None, help="JSON output")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny presets, B 1,2, prompt 16, 6 tokens")
    args = ap.parse_args(argv)

    import transformers

    cuda = torch.cuda.is_available() and not args.quick
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float32)
    batches = [int(v) for v in args.batch.split(",")]
    prompts = [int(v) for v in args.prompt.split(",")]
    new_tokens, eager_tokens, decode = args.new_tokens, args.eager_tokens, args.decode
    if args.quick:
        batches, prompts, new_tokens, eager_tokens = [1, 2], [16], 6, 4
        decode = "static" if decode in ("auto", "graph") else decode
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        print(f"lm bench generate: unknown model(s) {unknown}; choose from {list(MODELS)}", file=sys.stderr)
        return 2

    imp_b, imp_p = batches, prompts
    if args.implicit_shapes != "all" and not args.quick:
        bs, ps = args.implicit_shapes.split(":")
        imp_b, imp_p = [int(v) for v in bs.split(",")], [int(v) for v in ps.split(",")]
    rows = []
    print(f"{'model':16s} {'B':>3s} {'prompt':>6s} {'prefill ms':>11s} {'decode ms/tok':>14s} {'graph step':>11s}"
          f" {'eager ms/tok':>13s} {'simult. ms':>11s}")
    for name in names:
        torch.manual_seed(0)
        model = build(name, args.quick, device, dtype)
        implicit = MODELS[name][1] not in (None, "hf", "hf_static")
        for prompt_len in (imp_p if implicit else prompts):
            for b in (imp_b if implicit else batches):
                et = eager_tokens if (b == batches[0] and prompt_len == prompts[0] and name not in HF) else 0
                row = measure(model, name, b, prompt_len, new_tokens, decode, et, sync, device)
                rows.append(row)
                print(f"{name:16s} {b:3d} {prompt_len:6d} {row['prefill_ms']:11.2f} {row['decode_ms_per_token']:14.3f}"
                      f" {row.get('graph_step_ms', float('nan')):11.3f}"
                      f" {row.get('eager_decode_ms_per_token', float('nan')):13.3f}"
                      f" {row.get('simultaneous_ms', float('nan')):11.2f}", flush=True)
        del model
        if cuda:
            torch.cuda.empty_cache()
    for ref_name in HF:
        hf = {(r["batch"], r["prompt"]): r["decode_ms_per_token"] for r in rows if r["model"] == ref_name}
        for r in rows:
            ref = hf.get((r["batch"], r["prompt"]))
            if ref and r["model"] not in HF:
                r[f"decode_vs_{ref_name}"] = r["decode_ms_per_token"] / ref
        if hf:
            print(f"decode time / transformers Llama's ({ref_name}; same B, prompt):")
            for r in rows:
                if f"decode_vs_{ref_name}" in r:
                    print(f"  {r['model']:16s} B{r['batch']:<3d} prompt {r['prompt']:<5d} "
                          f"{r[f'decode_vs_{ref_name}']:.3f}x")
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype).replace("torch.", ""),
           "torch": torch.__version__, "transformers": transformers.__version__, "decode": decode, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
        print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
