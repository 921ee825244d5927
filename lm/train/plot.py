"""`lm plot RUN_DIR [--output PNG]`: the run's curves (metrics.jsonl) drawn to one PNG: training and
held-out loss against tokens, learning rate, tokens/s and MFU, fixed-point iterations and residual
(implicit models), with the curriculum switches marked."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .metrics import read_metrics


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(run_dir)
    steps = [r for r in recs if "event" not in r and isinstance(r.get("loss"), (int, float))]
    if not steps:
        raise ValueError(f"{run_dir}/metrics.jsonl has no step records yet")
    evals = [r for r in recs if r.get("event") == "eval"]
    switches = [r for r in recs if r.get("event") == "phase_switch"]
    tok = [r["tokens"] for r in steps]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0, 0]
    ax.plot(tok, [r["loss"] for r in steps], lw=1, label="train")
    if evals:
        ax.plot([r["tokens"] for r in evals], [r["val_loss"] for r in evals], "o-", label="held-out")
    ax.set(xlabel="tokens", ylabel="loss", title="loss")
    ax.legend()
    ax = axes[0, 1]
    ax.plot(tok, [r["lr"] for r in steps])
    ax.set(xlabel="tokens", ylabel="learning rate", title="schedule")
    ax = axes[1, 0]
    ax.plot(tok, [r.get("tokens_per_s", float("nan")) for r in steps], label="tokens/s")
    ax.set(xlabel="tokens", ylabel="tokens/s", title="throughput")
    ax2 = ax.twinx()
    ax2.plot(tok, [100 * r.get("mfu", float("nan")) for r in steps], color="C1", label="MFU %")
    ax2.set_ylabel("MFU %")
    ax = axes[1, 1]
    it_key = next((k for k in ("fp/iterations", "fp/layer_iterations") if any(k in r for r in steps)), None)
    if it_key is not None:  # an implicit model's solver, or the per-layer solvers of FP-Mamba
        res_key = "fp/residual_mean" if it_key == "fp/iterations" else "fp/layer_residual_mean"
        ax.plot(tok, [r.get(it_key, float("nan")) for r in steps], label="solver iterations")
        ax.set(xlabel="tokens", ylabel="iterations", title="fixed point")
        ax2 = ax.twinx()
        ax2.semilogy(tok, [r.get(res_key, float("nan")) for r in steps], color="C1", label="residual")
        ax2.set_ylabel("relative residual")
    else:
        ax.plot(tok, [r.get("grad_norm", float("nan")) for r in steps])
        ax.set(xlabel="tokens", ylabel="grad norm", title="gradient norm")
    for a in axes.flat:
        for s in switches:
            a.axvline(s["tokens"], color="gray", ls="--", lw=0.8)
    fig.suptitle(f"{Path(run_dir).name}" + (f"  (curriculum switch at {switches[0]['tokens']:,} tokens)" if switches else ""))
    fig.tight_layout()
    out = Path(output) if output else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lm plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--output", "-o", default=None, help="PNG path (default: RUN_DIR/curves.png)")
    args = ap.parse_args(argv)
    try:
        out = plot_run(args.run_dir, args.output)
    except ValueError as err:
        print(f"lm plot: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
