#!/usr/bin/env python
"""The floor of a training step: per layer, each GEMM's FLOPs at the measured matmul rate and the bytes that must
move at the measured bandwidth, beside the measured per-kernel profile (a developer tool: how far a step is from what
the hardware allows).

    python scripts/dev/floor.py --cases-json bench_train.json              # GPU: measure the rates, a table per case
    python scripts/dev/floor.py --preset lm_mamba2-350m --rates 700,3000   # any machine: given TFLOP/s and GB/s

A layer is split into stages that are each either bound by its math or by its memory traffic, so a stage's floor
is max(FLOPs / matmul rate, bytes / bandwidth) and the layer's floor is their sum:
  - every Linear of the block: forward Y = X W^T (2 N in out FLOPs; reads X and W, writes Y), backward dX and dW
    (twice the FLOPs; reads dY, X, W; writes dX and a float32 dW); its matmul rate is measured at its own shape;
  - the mixer's core (conv, scan, gates, norms between in_proj and out_proj): its extra FLOPs
    (Mixer.flops_per_token, tensor-core products) at the large-GEMM rate, and bytes: forward reads in_proj's
    output and writes out_proj's input; backward reads both again (saved or recomputed) plus the gradient of
    out_proj's input, and writes the gradient of in_proj's output;
  - the block's RMSNorms and residual adds: forward reads x and writes y; backward reads x, dy and writes dx.
Outside the layers: the embedding (bandwidth) and the tied LM head with its loss (three GEMMs of N x d x vocab).
The implicit no-grad forward's floor is the forward's (nothing saved, same traffic). Everything in bf16
(2 bytes) except the float32 weight gradients. This is a floor, not a model of the kernels: real kernels read
some tensors more than once; the gap between the floor and the measured per-kernel time is the target.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

E = 2  # bytes per activation / weight element (bf16)
G = 4  # bytes per weight-gradient element (float32 accumulation)


def _bench(fn, reps: int = 20) -> float:
    """Median seconds per call of fn on the GPU (CUDA events), after warm-up."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def measure_rates(shapes=((8192, 8192, 8192),)) -> dict:
    """Measured bf16 matmul TFLOP/s per (m, k, n) shape (and the best as "matmul_tflops") and the copy bandwidth
    in GB/s (read + write of a 2 GiB tensor), on the current CUDA device."""
    import torch

    out = {"matmul": {}}
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        t = _bench(lambda: a @ b)
        out["matmul"][f"{m}x{k}x{n}"] = 2 * m * k * n / t / 1e12
    out["matmul_tflops"] = max(out["matmul"].values())
    x = torch.empty(2**30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t = _bench(lambda: y.copy_(x), reps=10)
    out["bandwidth_gbs"] = 2 * x.numel() * x.element_size() / t / 1e9
    return out


def layer_stages(config, tokens: int, seq_len: int) -> list[dict]:
    """The stages of one layer of `config` at `tokens` tokens per step: name, kind, FLOPs and bytes forward and
    backward, and the GEMM shape (m, k, n) of Linear stages (for their own matmul rate)."""
    import torch

    from lm.models.presets import build_model

    model = build_model(config)
    block = model.model.layers[0]
    mixer = block.mixer
    N = tokens
    d = config.hidden_size
    rows = []
    for name, mod in block.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        i, o = mod.in_features, mod.out_features
        rows.append({"stage": name, "kind": "gemm", "shape": (N, i, o),
                     "fwd_flops": 2 * N * i * o, "bwd_flops": 4 * N * i * o,
                     "fwd_bytes": E * (N * i + N * o + i * o),
                     "bwd_bytes": E * (N * o + i * o + N * i) + E * (N * o + N * i) + G * i * o})
    lin = {n: m for n, m in mixer.named_modules() if isinstance(m, torch.nn.Linear)}
    first, last = next(iter(lin.values()), None), list(lin.values())[-1] if lin else None
    core_in = first.out_features if first is not None else d
    core_out = last.in_features if last is not None else d
    core_flops = mixer.flops_per_token(seq_len) * N
    rows.append({"stage": "mixer core", "kind": "core", "shape": None,
                 "fwd_flops": core_flops, "bwd_flops": 2 * core_flops,
                 "fwd_bytes": E * N * (core_in + core_out),
                 "bwd_bytes": E * N * (2 * core_in + 2 * core_out)})
    n_norms = 1 + (block.mlp is not None)
    rows.append({"stage": f"{n_norms} RMSNorm + residual", "kind": "elementwise", "shape": None,
                 "fwd_flops": 0, "bwd_flops": 0,
                 "fwd_bytes": n_norms * E * N * d * (2 + 2),  # norm: read x, write y; residual add: read 2, write 1
                 "bwd_bytes": n_norms * E * N * d * (3 + 2)})
    return rows


def outside_stages(config, tokens: int) -> list[dict]:
    N, d, V = tokens, config.hidden_size, config.vocab_size
    return [{"stage": "LM head + loss", "kind": "gemm", "shape": (N, d, V),
             "fwd_flops": 2 * N * d * V, "bwd_flops": 4 * N * d * V,
             "fwd_bytes": E * (N * d + d * V), "bwd_bytes": E * (2 * N * d + d * V) + G * d * V},
            {"stage": "embedding", "kind": "elementwise", "shape": None, "fwd_flops": 0, "bwd_flops": 0,
             "fwd_bytes": E * N * d, "bwd_bytes": E * N * d + G * N * d}]


def floor_ms(row: dict, rates: dict, gemm_rate=None) -> tuple[float, float]:
    """(forward ms, backward ms) of one stage: max(FLOPs / rate, bytes / bandwidth) each."""
    rate = (gemm_rate or rates["matmul_tflops"]) * 1e12
    bw = rates["bandwidth_gbs"] * 1e9
    return (1e3 * max(row["fwd_flops"] / rate, row["fwd_bytes"] / bw),
            1e3 * max(row["bwd_flops"] / rate, row["bwd_bytes"] / bw))


def _bound(row: dict, rates: dict, gemm_rate=None) -> str:
    rate = (gemm_rate or rates["matmul_tflops"]) * 1e12
    return "math" if row["fwd_flops"] / rate > row["fwd_bytes"] / (rates["bandwidth_gbs"] * 1e9) else "memory"


def step_floor(config, tokens: int, seq_len: int, rates: dict, shape_rates: dict | None = None) -> dict:
    """Per-layer rows with their floors, and the step's floor: forward, backward, no-grad forward (ms)."""
    shape_rates = shape_rates or {}
    layers = config.num_hidden_layers
    rows = []
    for r in layer_stages(config, tokens, seq_len):
        f, b = floor_ms(r, rates, shape_rates.get(r["shape"]))
        rows.append({**r, "fwd_ms": f, "bwd_ms": b, "bound": _bound(r, rates, shape_rates.get(r["shape"]))})
    out_rows = []
    for r in outside_stages(config, tokens):
        f, b = floor_ms(r, rates, shape_rates.get(r["shape"]))
        out_rows.append({**r, "fwd_ms": f, "bwd_ms": b, "bound": _bound(r, rates, shape_rates.get(r["shape"]))})
    lf, lb = sum(r["fwd_ms"] for r in rows), sum(r["bwd_ms"] for r in rows)
    of, ob = sum(r["fwd_ms"] for r in out_rows), sum(r["bwd_ms"] for r in out_rows)
    s = config.implicit
    solves = s.max_iter if s is not None else 0
    explicit = layers * (lf + lb) + of + ob
    step = solves * layers * lf + explicit
    # an implicit (s+k) step at the floor against the explicit step at the floor: the ratio no kernel work can
    # bring below (the s no-grad forwards against a forward + backward that is ~3x a forward)
    return {"layer_rows": rows, "outside_rows": out_rows, "layer_fwd_ms": lf, "layer_bwd_ms": lb,
            "nograd_forward_ms": layers * lf, "forward_ms": layers * lf + of, "backward_ms": layers * lb + ob,
            "step_ms": step, "explicit_step_ms": explicit, "over_explicit": step / explicit, "layers": layers}


def table(fl: dict, title: str) -> str:
    lines = [f"{title}: floor per step {fl['step_ms']:.1f} ms (forward {fl['forward_ms']:.1f}, backward "
             f"{fl['backward_ms']:.1f}, no-grad forward {fl['nograd_forward_ms']:.1f}); per layer "
             f"fwd {fl['layer_fwd_ms']:.3f} ms, bwd {fl['layer_bwd_ms']:.3f} ms x {fl['layers']} layers"
             + (f"; this step / the explicit step at the floor {fl['over_explicit']:.2f}x"
                if fl["over_explicit"] > 1 else ""),
             f"  {'stage':28s} {'fwd GFLOP':>10s} {'fwd MB':>8s} {'fwd ms':>8s} {'bwd GFLOP':>10s} {'bwd MB':>8s}"
             f" {'bwd ms':>8s}  bound"]
    for r in fl["layer_rows"] + [dict(x, stage="[step] " + x["stage"]) for x in fl["outside_rows"]]:
        bound = r["bound"]
        lines.append(f"  {r['stage'][:28]:28s} {r['fwd_flops'] / 1e9:10.2f} {r['fwd_bytes'] / 1e6:8.1f} "
                     f"{r['fwd_ms']:8.3f} {r['bwd_flops'] / 1e9:10.2f} {r['bwd_bytes'] / 1e6:8.1f} "
                     f"{r['bwd_ms']:8.3f}  {bound}")
    return "\n".join(lines)


def case_config(case: dict):
    from lm.models.presets import load_config

    return load_config(case["preset"], implicit=case.get("implicit"), **(case.get("overrides") or {}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases-json", help="`lm bench train --out` results: a floor table per case beside its profile")
    ap.add_argument("--preset", help="one preset instead (with --micro, --seq-len)")
    ap.add_argument("--implicit", default=None, help="implicit settings as JSON for --preset")
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rates", default=None, help="TFLOP/s,GB/s instead of measuring (no GPU needed)")
    ap.add_argument("--top", type=int, default=25, help="measured kernels to list beside each table")
    ap.add_argument("--output", "--out", dest="out", default=None, help="JSON with the rates and the floors")
    args = ap.parse_args()

    cases = []
    if args.cases_json:
        cases = [c for c in json.load(open(args.cases_json))["results"] if "error" not in c]
    elif args.preset:
        cases = [{"case": args.preset, "preset": args.preset, "seq_len": args.seq_len, "micro_batch_size": args.micro,
                  "implicit": json.loads(args.implicit) if args.implicit else None}]
    else:
        ap.error("give --cases-json or --preset")
    configs = [(c, case_config(c)) for c in cases]
    if args.rates:
        tf, bw = (float(x) for x in args.rates.split(","))
        rates, shape_rates = {"matmul_tflops": tf, "bandwidth_gbs": bw, "matmul": {}}, {}
    else:
        shapes = {(8192, 8192, 8192)}
        for c, cfg in configs:
            n = c["micro_batch_size"] * c["seq_len"]
            shapes |= {r["shape"] for r in layer_stages(cfg, n, c["seq_len"]) + outside_stages(cfg, n) if r["shape"]}
        rates = measure_rates(sorted(shapes))
        shape_rates = {tuple(int(x) for x in k.split("x")): v for k, v in rates["matmul"].items()}
    print(f"matmul {rates['matmul_tflops']:.0f} TFLOP/s (best shape), bandwidth {rates['bandwidth_gbs']:.0f} GB/s")
    for k, v in rates["matmul"].items():
        print(f"  bf16 matmul {k}: {v:.0f} TFLOP/s")
    floors = {}
    for c, cfg in configs:
        n = c["micro_batch_size"] * c["seq_len"]
        fl = step_floor(cfg, n, c["seq_len"], rates, shape_rates)
        floors[c["case"]] = {k: v for k, v in fl.items()}
        print()
        print(table(fl, f"{c['case']} ({n} tokens per micro-step)"))
        if "step_time_s" in c:
            meas = 1e3 * c["step_time_s"] * n / c["tokens_per_step"]
            print(f"  measured: step {meas:.1f} ms = {meas / fl['step_ms']:.2f}x the floor", end="")
            if "profile" in c:
                busy = c["profile"]["device_ms_per_step"]
                print(f"; device busy {busy:.1f} ms = {busy / fl['step_ms']:.2f}x; top kernels (ms/step, calls):")
                for k in c["profile"]["kernels"][: args.top]:
                    print(f"    {k['ms_per_step']:8.2f} {k['calls_per_step']:6.0f}  {k['name']}")
            else:
                print()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rates": rates, "floors": floors}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
