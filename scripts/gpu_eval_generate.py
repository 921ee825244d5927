"""Issue #29, deliverable 4: the time of a local lm-eval generation task (lm_local_generate: 200 greedy
generate_until requests of up to 16 tokens after a 40-word context) through `lm eval`, with the models' default
decode (CUDA-graph step on CUDA) against `--decode eager` (the per-token Python path), on random-weight 350M models.

    python scripts/gpu_eval_generate.py --tasks-dir DIR [--presets lm_mamba2-350m,lm_llama-350m] [--out JSON]

DIR holds the task files that `python -m lm.eval.local_tasks --data data/shakespeare --out DIR` writes (their data
paths are rewritten to DIR, so the folder may have moved since). Random weights: the time, not the score, is the
measurement (greedy generation of a random model rarely stops at "\\n", so every request runs its 16 tokens).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _tasks_here(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        text = f.read_text()
        if f.suffix == ".yaml":
            text = re.sub(r"(\S*/)?([a-z]+\.jsonl)", lambda m: str(dst / m.group(2)), text)
        (dst / f.name).write_text(text)
    return dst


def _direct(args) -> int:
    """What lm-eval's HFLM.generate_until does for lm_local_generate, without lm-eval: the 200 contexts in batches of
    16 (its default batch size here), left-padded, greedy `generate` of up to 16 new tokens stopping at "\\n"; the
    default decode against eager, same process, after one warm-up batch each."""
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    from lm.data import load_tokenizer
    from lm.models.presets import load_config

    tok = load_tokenizer("default")
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    docs = [json.loads(line)["context"] for line in open(Path(args.tasks_dir) / "generate.jsonl")]
    nl = torch.tensor(tok.encode("\n", add_special_tokens=False))

    class StopAtNewline(StoppingCriteria):
        def __init__(self, start):
            self.start = start

        def __call__(self, input_ids, scores, **kw):  # per row: a newline token among the generated ones
            return torch.isin(input_ids[:, self.start:], nl.to(input_ids.device)).any(1)

    rows = []
    for preset in args.presets.split(","):
        torch.manual_seed(0)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_config(load_config(preset)).to(dev, torch.bfloat16).eval()
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        for decode in ("auto", "eager"):
            def run(n_docs):
                n = 0
                for i in range(0, n_docs, 16):
                    enc = tok(docs[i:i + 16], return_tensors="pt", padding=True).to(dev)
                    stop = StoppingCriteriaList([StopAtNewline(enc.input_ids.shape[1])])
                    with torch.no_grad():
                        out = model.generate(**enc, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id,
                                             stopping_criteria=stop, decode=decode)
                    n += out.shape[0] * (out.shape[1] - enc.input_ids.shape[1])
                return n
            run(16)  # warm-up: one batch
            sync()
            t0 = time.perf_counter()
            n = run(len(docs))
            sync()
            wall = time.perf_counter() - t0
            rows.append({"preset": preset, "decode": decode, "wall_s": wall, "requests": len(docs), "tokens": n})
            print(json.dumps(rows[-1]), flush=True)
        a, e = rows[-2], rows[-1]
        print(f"{preset}: lm_local_generate's {len(docs)} requests {a['wall_s']:.2f} s with the default decode, "
              f"{e['wall_s']:.2f} s eager ({e['wall_s'] / a['wall_s']:.1f}x)")
        del model
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks-dir", required=True)
    ap.add_argument("--presets", default="lm_mamba2-350m,lm_llama-350m")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("lm-eval is not installed here: timing its generate_until work directly (see _direct)")
        return _direct(args)
    import torch
    from transformers import AutoModelForCausalLM

    from lm.data import load_tokenizer
    from lm.models.presets import load_config

    tmp = Path(tempfile.mkdtemp(prefix="evalgen-"))
    tasks = _tasks_here(Path(args.tasks_dir), tmp / "tasks")
    rows = []
    for preset in args.presets.split(","):
        torch.manual_seed(0)
        ckpt = tmp / preset
        AutoModelForCausalLM.from_config(load_config(preset)).to(torch.bfloat16).save_pretrained(ckpt)
        load_tokenizer("default").save_pretrained(str(ckpt))
        for decode in ("auto", "eager"):
            cmd = [sys.executable, "-m", "lm.cli", "eval", str(ckpt), "--tasks", "lm_local_generate",
                   "--include-path", str(tasks), "--dtype", "bfloat16", "--decode", decode,
                   "--output", str(tmp / f"{preset}-{decode}.json")]
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            row = {"preset": preset, "decode": decode, "wall_s": wall, "rc": p.returncode}
            if p.returncode != 0:
                row["error"] = (p.stdout + p.stderr)[-1500:]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
            if "error" in row:
                print(row["error"])
    for preset in args.presets.split(","):
        a, e = (next(r for r in rows if r["preset"] == preset and r["decode"] == d) for d in ("auto", "eager"))
        if a["rc"] == 0 and e["rc"] == 0:
            print(f"{preset}: lm_local_generate {a['wall_s']:.1f} s with the default decode, {e['wall_s']:.1f} s eager "
                  f"({e['wall_s'] / a['wall_s']:.2f}x; whole `lm eval` processes, model load included)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
