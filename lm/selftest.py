"""`lm selftest`: does this installation work? Every family through what users do with it, on tiny models.

Per family (explicit Mamba2, Llama, DeltaProduct, FP-Mamba, LRU, a Mamba2 + DeltaProduct + attention hybrid, and
implicit Mamba2): forward + backward (finite loss and gradients), greedy `generate` (explicit models: the generated
tokens equal the argmax of one full forward), `save_pretrained` / `from_pretrained` (equal logits); then one
training step through the trainer on a small prepared corpus (written here, default tokenizer) with its Hugging Face
export, and lm-eval's HFLM on a local task built from that corpus. Prints the versions of the dependencies and one
line per check as it finishes; a check whose optional dependency is not installed (lm-eval: the `eval` extra) is
listed as skipped with the command that installs it. Exits 1 if any check failed.
`scripts/check_latest.sh` runs it in a fresh environment with the newest release of every dependency.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import importlib.util
import io
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

PACKAGES = ["python", "torch", "triton", "transformers", "tokenizers", "safetensors", "deepspeed", "lm-eval",
            "accelerate", "datasets", "numpy", "flash-linear-attention"]
FAMILIES = [  # (name, preset, implicit settings)
    ("mamba2", "lm_mamba2-tiny", None),
    ("llama", "lm_llama-tiny", None),
    ("deltaproduct", "lm_deltaproduct-tiny", None),
    ("fp_mamba", "lm_fp_mamba-tiny", None),
    ("lru", "lm_lru-tiny", None),
    ("hybrid", "lm_hybrid-tiny", None),
    ("mamba2-implicit", "lm_mamba2-tiny", {"max_iter": 3, "phantom_steps": 1}),
]


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for p in PACKAGES[1:]:
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = "-"
    return out


def _family_checks(preset: str, implicit: dict | None, tmp: Path) -> dict[str, callable]:
    import torch
    from transformers import AutoModelForCausalLM

    from lm.models.presets import load_config

    state = {}

    def model():
        if "model" not in state:
            torch.manual_seed(0)
            state["model"] = AutoModelForCausalLM.from_config(load_config(preset, implicit=implicit))
            state["ids"] = torch.randint(1, state["model"].config.vocab_size, (2, 24))
        return state["model"], state["ids"]

    def forward_backward():
        m, ids = model()
        m.train()
        out = m(ids, labels=ids)
        assert torch.isfinite(out.loss), f"loss {out.loss}"
        out.loss.backward()
        bad = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
        assert not bad, f"missing or non-finite gradients: {bad[:3]}"
        m.zero_grad(set_to_none=True)

    def generate():
        m, ids = model()
        m.eval()
        with torch.no_grad():
            g = m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert g.shape == (2, 30), f"generated shape {tuple(g.shape)}"
            if implicit is None:  # implicit models decode in sequential mode, which may differ from one forward
                full = m(g[:, :-1]).logits[:, ids.shape[1] - 1:].argmax(-1)
                assert torch.equal(full, g[:, ids.shape[1]:]), "generated tokens differ from one full forward"

    def save_load():
        m, ids = model()
        m.eval()
        d = tmp / preset
        m.save_pretrained(d)
        m2 = AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            assert torch.allclose(m(ids).logits, m2(ids).logits, atol=1e-5), "logits differ after save/load"

    return {"forward+backward": forward_backward, "generate": generate, "save/load": save_load}


def _corpus(tmp: Path) -> Path:
    from lm.data.prepare import prepare_data

    src = tmp / "txt"
    src.mkdir()
    lines = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer",
             "The slings and arrows of outrageous fortune,", "Or to take arms against a sea of troubles"]
    for d in range(12):
        (src / f"doc{d:02d}.txt").write_text("\n".join(lines[(d + i) % 4] for i in range(400)))
    out = tmp / "data"
    prepare_data(str(src / "*.txt"), out, val_fraction=0.34, workers=0, progress=False)
    return out


def _train_step(tmp: Path, data: Path) -> Path:
    from lm.train.config import config_from_dict
    from lm.train.trainer import train

    run = tmp / "run"
    cfg = config_from_dict({
        "run_dir": str(run),
        "model": {"preset": "lm_mamba2-tiny", "overrides": {"num_hidden_layers": 2},
                  "implicit": {"max_iter": 2, "phantom_steps": 1}},
        "data": {"path": str(data), "seq_len": 32},
        "train": {"steps": 2, "global_batch_tokens": 128, "micro_batch_size": 4, "engine": "torch", "num_threads": 1},
        "checkpoint": {"every_steps": 0, "export": True},
        "log": {"progress": False},
        "eval": {"batches": 1, "sample_tokens": 0, "at_end": False},
    })
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train(cfg)
    assert summary["steps"] == 2 and summary["final_loss"] == summary["final_loss"], summary
    assert (run / "hf" / "config.json").is_file(), "no Hugging Face export written"
    return run / "hf"


def _lm_eval(tmp: Path, data: Path, export: Path) -> None:
    from lm.eval.checkpoint import load_checkpoint
    from lm.eval.harness import run_lm_eval
    from lm.eval.local_tasks import build_local_tasks

    tasks = build_local_tasks(data, tmp / "tasks", n_lastword=12, n_continuation=12)
    model, tok = load_checkpoint(export, device="cpu")
    import logging

    import datasets

    datasets.disable_progress_bars()
    quiet = io.StringIO()  # lm-eval's progress bars and notices (a failure is reported with its error)
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            res = run_lm_eval(model, tok, ["lm_local_lastword", "lm_local_continuation"], batch_size=4, limit=4,
                              include_path=tasks)
    finally:
        logging.disable(level)
    acc = res["results"]["lm_local_continuation"]["acc"]
    assert 0 <= acc <= 1, res["results"]


# optional checks: (module, what it is, how to install it)
OPTIONAL = {"lm-eval": ("lm_eval", "lm-eval", "pip install -e '.[eval]'")}


def missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def run(families: list[str] | None = None, trainer: bool = True, lm_eval: bool = True, report=None) -> list[dict]:
    """Run the checks; returns one record per check: {"what", "check", "ok", "seconds", "error"} (+ "skipped":
    the reason, for a check whose optional dependency is missing). `report(rec)` is called as each one ends."""
    import warnings

    from transformers.utils import logging as hf_logging

    import lm  # noqa: F401  (registers the model types)

    warnings.filterwarnings("ignore")
    hf_logging.disable_progress_bar()  # transformers' load / save bars and notices would break up the check lines
    hf_logging.set_verbosity_error()
    records = []

    def check(what, name, fn):
        t0 = time.time()
        rec = {"what": what, "check": name, "ok": True, "seconds": 0.0, "error": ""}
        try:
            fn()
        except (Exception, SystemExit) as err:  # a selftest reports every failure instead of stopping at the first
            rec.update(ok=False, error=f"{type(err).__name__}: {err}".splitlines()[0][:300],
                       traceback=traceback.format_exc())
        rec["seconds"] = round(time.time() - t0, 2)
        records.append(rec)
        if report is not None:
            report(rec)
        return rec["ok"]

    def skip(what, name, reason):
        rec = {"what": what, "check": name, "ok": True, "seconds": 0.0, "error": "", "skipped": reason}
        records.append(rec)
        if report is not None:
            report(rec)

    with tempfile.TemporaryDirectory(prefix="lm-selftest-") as d:
        tmp = Path(d)
        for name, preset, implicit in FAMILIES:
            if families and name not in families:
                continue
            for check_name, fn in _family_checks(preset, implicit, tmp).items():
                check(name, check_name, fn)
        if trainer or lm_eval:
            box = {}
            if check("trainer", "prepare-data", lambda: box.update(data=_corpus(tmp))) and trainer:
                ok = check("trainer", "train 2 steps + export", lambda: box.update(hf=_train_step(tmp, box["data"])))
                module, label, install = OPTIONAL["lm-eval"]
                if ok and lm_eval and missing(module):
                    skip("lm-eval", "HFLM on local tasks", f"{label} not installed: {install}")
                elif ok and lm_eval:
                    check("lm-eval", "HFLM on local tasks", lambda: _lm_eval(tmp, box["data"], box["hf"]))
    return records


def line(r: dict) -> str:
    """A check's result as one line."""
    if r.get("skipped"):
        return f"skip {r['what']:16s} {r['check']:24s} {'':7s} {r['skipped']}"
    return f"{'ok  ' if r['ok'] else 'FAIL'} {r['what']:16s} {r['check']:24s} {r['seconds']:6.1f}s  {r['error']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lm selftest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=None, help=f"comma list of {[f[0] for f in FAMILIES]} (default all)")
    ap.add_argument("--no-trainer", action="store_true", help="skip the training step and lm-eval")
    ap.add_argument("--no-lm-eval", action="store_true")
    ap.add_argument("--json", default=None, help="also write versions and results to this file")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the traceback of each failure")
    args = ap.parse_args(argv)
    vers = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()), flush=True)

    def report(r):
        print(line(r), flush=True)
        if args.verbose and not r["ok"]:
            print(r["traceback"], flush=True)

    records = run(args.families.split(",") if args.families else None, trainer=not args.no_trainer,
                  lm_eval=not args.no_lm_eval, report=report)
    failed = [r for r in records if not r["ok"]]
    skipped = [r for r in records if r.get("skipped")]
    print(f"{len(records) - len(failed) - len(skipped)} passed, {len(failed)} failed"
          + (f", {len(skipped)} skipped" if skipped else ""))
    for r in skipped:
        print(f"missing: {r['skipped']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": vers, "results": [
            {k: v for k, v in r.items() if k != "traceback"} for r in records]}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
