#!/usr/bin/env python
"""Same-machine A/B of two source trees: the training step, decode and the kernels against their peers, run for an
old and a new tree in one call on one GPU, printed as new / old per figure (a figure more than 3% worse is flagged).

    git archive OLD_COMMIT | tar -x -C .ab/old       # the baseline tree (e.g. the last resolved commit)
    python scripts/ab_bench.py --old .ab/old --new . --parts step,decode,kernels --out ab.json

Each benchmark runs in a subprocess with the tree's directory first on PYTHONPATH (and as its working directory), so
each side imports its own `lm` and `lm_kernels`; the two sides alternate part by part. The parts:

- step: `lm bench train` of Llama-350M, Mamba2-350M and their implicit (4+1) models, compiled, bf16, micro 16 x 2048
  (tokens/s, step, memory; Mamba2 / Llama and the implicit / explicit step ratios of each side);
- decode: `lm bench generate` at B 1, prompt 512 (decode ms/token of Llama, Mamba2, DeltaProduct, implicit Mamba2)
  and the implicit prefill against one simultaneous forward at B 1 and 16, prompts 512 and 2048;
- kernels: `lm bench ssd` (against mamba_ssm) and `lm bench deltaproduct` (against fla's forward), where the peers
  import (tools: ../shared/tools/gpu-carry.sh).

Not in the package (a developer's tool): it compares trees, which a user of an installed `lm` does not have.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

STEP_CASES = "llama-explicit,mamba2-explicit,llama-implicit-4+1,mamba2-implicit-4+1"


def _run(tree: Path, args: list[str], timeout: int, extra_path: str) -> tuple[int, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree.resolve())] + ([extra_path] if extra_path else [])
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = -1
        out += f"\n[timeout after {timeout} s]"
    print(f"  [{tree}] {' '.join(args[:4])} ... rc {rc} in {time.time() - t0:.0f} s", flush=True)
    return rc, out


def part_step(tree: Path, out: Path, a, cases: str) -> dict:
    js = out / f"step-{cases}.json"
    shape = (["--size", "tiny", "--seq-len", "64", "--micro", "2", "--compile", "off"] if a.quick
             else ["--size", "350m", "--micro", "16", "--compile", "on"])
    rc, text = _run(tree, ["-m", "lm.benchmarks.train", *shape, "--steps", str(a.steps), "--warmup", str(a.warmup),
                           "--cases", cases, "--timeout", str(a.case_timeout), "--out", str(js.resolve())],
                    a.timeout, a.extra_path)
    (out / f"step-{cases}.log").write_text(text)
    if not js.exists():
        return {}
    res = json.loads(js.read_text())
    fig = {}
    for r in res["results"]:
        if "error" in r:
            continue
        name = r["case"].replace("+compile", "")
        fig[f"step {name} tok/s"] = (r["tokens_per_s"], "higher")
        fig[f"step {name} memory GB"] = (r["mem_gb"], "lower")
    return fig


def step_ratios(fig: dict) -> None:
    """The cross-case ratios of one side's step figures, added in place."""
    by = {k.split()[1]: v[0] for k, v in fig.items() if k.startswith("step ") and k.endswith("tok/s")}
    if "mamba2-explicit" in by and "llama-explicit" in by:
        fig["Mamba2 / Llama tok/s"] = (by["mamba2-explicit"] / by["llama-explicit"], "higher")
    for fam in ("mamba2", "llama"):
        if f"{fam}-explicit" in by and f"{fam}-implicit-4+1" in by:
            fig[f"{fam} implicit (4+1) / explicit step"] = (by[f"{fam}-explicit"] / by[f"{fam}-implicit-4+1"],
                                                            "lower")


def part_decode(tree: Path, out: Path, a) -> dict:
    js = out / "decode.json"
    rc, text = _run(tree, ["-m", "lm.benchmarks.generate", "--models", "llama,mamba2,deltaproduct,implicit_mamba2",
                           "--batch", "1", "--prompt", "512", "--new-tokens", "128", "--eager-tokens", "0",
                           "--implicit-shapes", "1,16:512,2048", "--out", str(js.resolve())]
                    + (["--quick"] if a.quick else []), a.timeout, a.extra_path)
    (out / "decode.log").write_text(text)
    if not js.exists():
        return {}
    fig = {}
    for r in json.loads(js.read_text())["rows"]:
        tag = f"{r['model']} B{r['batch']} prompt {r['prompt']}"
        if r["batch"] == 1 and r["prompt"] == 512:
            fig[f"decode {tag} ms/token"] = (r["decode_ms_per_token"], "lower")
        if "prefill_over_simultaneous" in r:
            fig[f"prefill {tag} ms"] = (r["prefill_ms"], "lower")
            fig[f"prefill {tag} / simultaneous forward"] = (r["prefill_over_simultaneous"], "lower")
    return fig


def part_kernels(tree: Path, out: Path, a) -> dict:
    fig = {}
    js = out / "ssd.json"
    rc, text = _run(tree, ["-m", "lm.benchmarks.ssd", "--no-profile", "--json", str(js.resolve())]
                    + (["--tiny", "--no-peer"] if a.quick else ["--shapes", *a.ssd_shapes.split(",")]), a.timeout,
                    a.extra_path)
    (out / "ssd.log").write_text(text)
    if js.exists():
        for name, row in json.loads(js.read_text()).get("shapes", {}).items():
            for k in ("ours_fwd_ms", "ours_fwd_bwd_ms", "ours_nograd_fwd_ms", "ratio_fwd", "ratio_fwd_bwd",
                      "ratio_nograd_fwd"):
                if k in row:
                    fig[f"ssd {name} {k.replace('ratio_', 'ours/mamba_ssm ')}"] = (row[k], "lower")
    js = out / "deltaproduct.json"
    rc, text = _run(tree, ["-m", "lm.benchmarks.deltaproduct", "--json", str(js.resolve()), "--check-batch", "0"]
                    + (["--quick"] if a.quick else ["--nh", *a.deltaproduct_nh.split(",")]), a.timeout, a.extra_path)
    (out / "deltaproduct.log").write_text(text)
    if js.exists():
        for r in json.loads(js.read_text()).get("rows", []):
            for k, v in r.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and (k.startswith("ratio")
                                                                               or k.startswith("ours_")):
                    fig[f"deltaproduct nh{r.get('nh', '')} {k}"] = (v, "lower")
    return fig


def report(figs: dict) -> list[str]:
    """Print old, new and new / old per figure; the figures more than 3% worse are flagged and returned."""
    print(f"\n{'figure':64s} {'old':>10s} {'new':>10s} {'new/old':>8s}")
    worse = []
    for k in sorted(set(figs["old"]) | set(figs["new"])):
        o, n = figs["old"].get(k), figs["new"].get(k)
        ov, nv = (o[0] if o else float("nan")), (n[0] if n else float("nan"))
        better = (n or o)[1]
        r = nv / ov if o and n and ov else float("nan")
        flag = ""
        if r == r and ((better == "higher" and r < 0.97) or (better == "lower" and r > 1.03)):
            flag = "  <- worse by more than 3%"
            worse.append(k)
        print(f"{k:64s} {ov:10.4g} {nv:10.4g} {r:8.3f}{flag}")
    print(f"\n{len(worse)} figure(s) more than 3% worse" + (": " + "; ".join(worse) if worse else ""))
    return worse


PARTS = {"step": part_step, "decode": part_decode, "kernels": part_kernels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="the baseline tree (a directory)")
    ap.add_argument("--new", default=".", help="the tree under test (default: this one)")
    ap.add_argument("--parts", default="step,decode,kernels")
    ap.add_argument("--step-cases", default=STEP_CASES)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ssd-shapes", default="B8_T2048,B2_T8192", help="shapes of lm bench ssd")
    ap.add_argument("--deltaproduct-nh", default="1,2,3", help="n_h values of lm bench deltaproduct")
    ap.add_argument("--case-timeout", type=int, default=240, help="seconds per training case")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per benchmark process")
    ap.add_argument("--extra-path", default="", help="more PYTHONPATH entries (peers, carried wheels)")
    ap.add_argument("--out", default="ab_out", help="a directory for the JSON and logs")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny models and kernel shapes")
    ap.add_argument("--report", action="store_true", help="only print the table of an earlier run's --out")
    a = ap.parse_args(argv)
    trees = {"old": Path(a.old), "new": Path(a.new)}
    for side, t in trees.items():
        if not (t / "lm" / "__init__.py").exists():
            ap.error(f"--{side} {t}: not a source tree of lm (no lm/__init__.py)")
    root = Path(a.out)
    if a.report:
        report(json.loads((root / "ab.json").read_text()))
        return 0
    figs = {"old": {}, "new": {}}
    jobs = []  # (part, extra argument): the step's cases one by one, so that the sides alternate case by case
    for part in a.parts.split(","):
        if part not in PARTS:
            ap.error(f"--parts: {part!r} is not one of {list(PARTS)}")
        jobs += [(part, (c,)) for c in a.step_cases.split(",")] if part == "step" else [(part, ())]
    for part, extra in jobs:
        for side in ("old", "new"):
            d = root / side
            d.mkdir(parents=True, exist_ok=True)
            print(f"{part} {' '.join(extra)}: {side}", flush=True)
            figs[side].update(PARTS[part](trees[side], d, a, *extra))
            step_ratios(figs[side])
            (root / "ab.json").write_text(json.dumps(figs, indent=1))  # what is measured survives a cut
    report(figs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
