"""Warp-stall samples per SASS instruction from an Nsight Compute source page (the sass_<tag>.csv that
scripts/dev/gpu_ssd_ncu_src.sh writes): the stall reasons of one kernel in total, and its top instructions with their
index, share of all samples, execution count and main reasons. Loops show as higher execution counts; a load's
latency shows on the first instruction that uses its data (often the STS that stages it for an MMA).

    python scripts/dev/ncu_sass_stalls.py sass_dp2.csv _fwd_h_o_v2_kernel [--top 40]
"""
from __future__ import annotations

import argparse
import collections
import csv


def read_kernel(path, kernel):
    """The rows (dicts keyed by the CSV header) of `kernel` in an ncu source-page CSV with several kernels."""
    rows, cur, hdr = [], None, None
    with open(path, newline="") as f:
        for r in csv.reader(f):
            if r and r[0] == "Kernel Name":
                cur, hdr = r[1], None
            elif r and r[0] == "Address":
                hdr = r
            elif hdr and cur == kernel:
                rows.append(dict(zip(hdr, r)))
    if not rows:
        raise SystemExit(f"no rows for kernel {kernel!r} in {path}")
    return rows, hdr


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("kernel")
    p.add_argument("--top", type=int, default=40)
    a = p.parse_args(argv)
    rows, hdr = read_kernel(a.csv, a.kernel)
    reasons = [c for c in hdr if c.startswith("stall_") and "Not Issued" not in c]
    total = collections.Counter()
    for i, r in enumerate(rows):
        r["i"], r["s"] = i, int(r["Warp Stall Sampling (All Samples)"] or 0)
        for c in reasons:
            total[c] += int(r[c] or 0)
    n = max(1, sum(r["s"] for r in rows))
    print(a.kernel, "instructions", len(rows), "samples", n)
    print({k[6:]: round(v / n, 3) for k, v in total.most_common(10)})
    for r in sorted(rows, key=lambda r: -r["s"])[:a.top]:
        top = sorted(((int(r[c] or 0), c[6:]) for c in reasons), reverse=True)[:3]
        why = [(name, round(v / max(r["s"], 1), 2)) for v, name in top if v]
        print(f'{r["i"]:5d} {r["s"] / n:6.3f} ex={r["Instructions Executed"]:>8} {r["Source"].strip()[:60]:60s} {why}')


if __name__ == "__main__":
    main()
