#!/usr/bin/env python
"""End-to-end training throughput through the real trainer (lm.train, bf16; the plain engine on one GPU, DeepSpeed with
--engine deepspeed): tokens/s, MFU and peak memory for explicit and implicit (4+1) models, and the implicit/explicit
step-time ratio. The current figures and their commands: docs/performance.md.

    lm bench train --out bench_train.json                      # H100: 350M Mamba2 + Llama
    lm bench train --cases mamba2-explicit,llama-explicit,hybrid-explicit     # the Mamba2 + attention hybrid
    lm bench train --size tiny --seq-len 64 --micro 2 --steps 3 --warmup 1   # CPU smoke

Hybrid cases (lm_hybrid-mamba2-{size}) run beside the pure stacks of their layer kinds: where a run has the hybrid
and, for each of its kinds, the pure case (same implicit setting and compile mode), the summary adds the layer-weighted
mix of the pure stacks' per-layer times (`layer_weighted_mix`) and the hybrid's tokens/s over the mix's.

Each case runs in its own process (`--case NAME`) on synthetic tokens (a random walk over the
vocabulary; the data path costs nothing), `--warmup` steps are dropped (Triton compilation,
autotuning) and the median step of the rest is reported. MFU = tokens/s x
lm.models.presets.flops_per_token(config, seq_len)["train"] / peak (989e12: H100 bf16 dense). A case
that runs out of memory is retried with half the micro-batch (the same tokens per step, by accumulation).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {  # name -> (preset, "{size}" filled from --size; implicit settings or None)
    "mamba2-explicit": ("lm_mamba2-{size}", None),
    "mamba2-implicit-4+1": ("lm_mamba2-{size}", {"max_iter": 4, "phantom_steps": 1}),
    "llama-explicit": ("lm_llama-{size}", None),
    "llama-implicit-4+1": ("lm_llama-{size}", {"max_iter": 4, "phantom_steps": 1}),
    # Mamba2 + attention (about 1 attention layer in 6), the layers of the two stacks above at the same width
    "hybrid-explicit": ("lm_hybrid-mamba2-{size}", None),
    "hybrid-implicit-4+1": ("lm_hybrid-mamba2-{size}", {"max_iter": 4, "phantom_steps": 1}),
    # the other families at their papers' sizes (not in the default --cases)
    "deltaproduct-392m-nh2": ("lm_deltaproduct-392m-nh2", None),
    "deltaproduct-392m-nh2-gated": ("lm_deltaproduct-392m-nh2-gated", None),
    "fp_mamba-200m": ("lm_fp_mamba-200m", None),
}
DEFAULT_CASES = "mamba2-explicit,mamba2-implicit-4+1,llama-explicit,llama-implicit-4+1"
# the layer kind of a hybrid whose layers are a pure model type's
PURE_KIND = {"lm_llama": "attention", "lm_mamba2": "mamba2", "lm_deltaproduct": "deltaproduct"}


def layer_weighted_mix(layer_kinds: list[str], pure: dict[str, tuple[int, float]]) -> float:
    """The time per token a hybrid of these layers would take at its pure stacks' per-layer speed: the sum over its
    layers of (pure stack's time per token / its layer count) of the layer's kind. `pure`: kind -> (the pure stack's
    layer count, its time per token). Each pure time includes its embedding, LM head and loss, so the mix counts
    those sum(n_kind / L_kind) times (Mamba2-350M + Llama-350M for the 35 + 7 layer hybrid: 35/48 + 7/24 = 1.02)."""
    missing = sorted(set(layer_kinds) - set(pure))
    if missing:
        raise ValueError(f"layer_weighted_mix: no pure stack timed for the layer kind(s) {missing}")
    return sum(pure[k][1] / pure[k][0] for k in layer_kinds)


def hybrid_mix_ratios(results: list[dict]) -> dict[str, float]:
    """For each hybrid result with every kind's pure result (same implicit settings and compile mode) in `results`:
    the hybrid's tokens/s over the layer-weighted mix's (`layer_weighted_mix`), and the mix's tokens/s."""
    from lm.models.presets import load_config

    out = {}
    ok = [r for r in results if "error" not in r]
    for h in ok:
        cfg = load_config(h["preset"], implicit=h["implicit"], **h.get("overrides", {}))
        if cfg.model_type != "lm_hybrid":
            continue
        pure = {}
        for r in ok:
            pc = load_config(r["preset"], implicit=r["implicit"], **r.get("overrides", {}))
            kind = PURE_KIND.get(pc.model_type)
            if kind and r["implicit"] == h["implicit"] and r["compile"] == h["compile"]:
                pure[kind] = (pc.num_hidden_layers, r["step_time_s"] / r["tokens_per_step"])
        if not set(cfg.layer_kinds) <= set(pure):
            continue
        mix = layer_weighted_mix(cfg.layer_kinds, pure)
        out[f"{h['case']}_mix_tokens_per_s"] = 1.0 / mix
        out[f"{h['case']}_over_layer_mix"] = h["tokens_per_s"] * mix
    return out


def _overrides(args) -> dict:
    """--override KEY=VALUE (VALUE read as JSON, else a string) as model config fields."""
    out = {}
    for item in args.override or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--override expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run_case(args) -> dict:
    import torch

    from lm.resources import configs_dir
    from lm.train.config import config_from_dict
    from lm.train.trainer import train

    template, implicit = CASES[args.case]
    preset = template.format(size=args.size)
    overrides = _overrides(args)
    vocab = json.loads(configs_dir("models").joinpath(f"{preset}.json").read_text())["vocab_size"]
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{args.case}-"))
    tokens_per_step = args.micro * args.accum * args.seq_len
    cfg = config_from_dict({
        "run_dir": str(run_dir),
        "model": {"preset": preset, "implicit": implicit, "activation_checkpointing": args.act_ckpt,
                  "compile": args.compile == "on", "overrides": overrides},
        "data": {"source": "synthetic", "seq_len": args.seq_len, "synthetic_vocab": vocab},
        "optim": {"lr": 1e-3},
        "schedule": {"kind": "constant", "warmup": 0},
        "train": {"steps": args.warmup + args.steps, "global_batch_tokens": tokens_per_step,
                  "micro_batch_size": args.micro, "precision": args.precision, "engine": args.engine,
                  "zero_stage": args.zero_stage, "deepspeed_config": args.deepspeed_config,
                  "device": args.device},
        "checkpoint": {"at_end": False, "export": False},
        "log": {"progress": False, "peak_flops": args.peak_flops},
        "eval": {"at_end": False, "sample_tokens": 0},
    })
    hooks, prof = {}, None
    if args.profile:
        # profile `--profile` steps after the warmup: the hook runs after each micro-batch's forward, so
        # prof.step() at micro 0 marks a training-step boundary for the profiler's schedule
        from torch.profiler import ProfilerActivity, profile, schedule

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = profile(activities=acts, schedule=schedule(wait=max(0, args.warmup - 1), warmup=1,
                                                          active=args.profile, repeat=1))
        prof.start()

        def _mark(step, micro, out):
            if micro == 0:
                prof.step()
            return out

        hooks["after_forward"] = _mark
    t0 = time.perf_counter()
    summary = train(cfg, hooks=hooks)
    wall = time.perf_counter() - t0
    prof_rows = None
    if prof is not None:
        prof.stop()
        prof_rows = _profile_rows(prof, args.profile)
    recs = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    steps = [r for r in recs if "event" not in r][args.warmup:]
    start = next(r for r in recs if r.get("event") == "start")
    st = statistics.median(r["step_time"] for r in steps)
    from lm.models.presets import flops_per_token, load_config

    fpt = flops_per_token(load_config(preset, implicit=implicit, **overrides), args.seq_len)["train"]
    out = {
        "case": args.case + ("+compile" if args.compile == "on" else ""), "compile": args.compile == "on",
        "preset": preset, "implicit": implicit, "overrides": overrides, "params": start["params"],
        "engine": start["engine"], "device": start["device"], "precision": args.precision,
        "seq_len": args.seq_len, "micro_batch_size": args.micro, "accumulation": args.accum,
        "tokens_per_step": tokens_per_step, "measured_steps": len(steps), "step_time_s": st,
        "tokens_per_s": tokens_per_step / st, "train_flops_per_token": fpt,
        "mfu": tokens_per_step / st * fpt / args.peak_flops,
        "mem_gb": max(r["mem_gb"] for r in steps), "final_loss": summary["final_loss"],
        "fp_iterations": steps[-1].get("fp/iterations"), "wall_s": wall,
        "step_times": [r["step_time"] for r in steps],
    }
    if prof_rows is not None:
        out["profile"] = prof_rows
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
        # allocator retries (cudaFree + retry on fragmentation) stall every stream: near-full memory shows here
        out["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        out["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def _profile_rows(prof, n_steps: int, top: int = 40) -> dict:
    """Per-step device time by kernel (self time, sorted) and the device-busy total, from a torch.profiler
    run over `n_steps` training steps. Step wall time minus device-busy time is host-bound time."""
    rows = []
    total = 0.0
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0.0)
        if (dev and dev > 0 and e.device_type is not None and "cuda" in str(e.device_type).lower()
                and not e.key.startswith("ProfilerStep")):  # the step annotation spans the step: not a kernel
            rows.append({"name": e.key[:120], "ms_per_step": dev / 1e3 / n_steps, "calls_per_step": e.count / n_steps})
            total += dev / 1e3 / n_steps
    rows.sort(key=lambda r: -r["ms_per_step"])
    return {"device_ms_per_step": total, "kernels": rows[:top], **_host_rows(prof, n_steps),
            **_idle_rows(prof.events(), n_steps)}


_SYNC = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def _host_rows(prof, n_steps: int, top: int = 25) -> dict:
    """Where the host's time goes per step: the waits on the device (synchronize calls and tensor-to-Python
    reads, each a drain after which the device idles until the host has launched new work) and the host
    events (aten ops, runtime calls, user annotations) with the most self CPU time."""
    rows, sync_ms, sync_calls = [], 0.0, 0.0
    for e in prof.key_averages():
        if e.device_type is not None and "cuda" in str(e.device_type).lower():
            continue
        ms = e.self_cpu_time_total / 1e3 / n_steps
        if e.key.startswith("ProfilerStep"):
            continue
        if e.key in _SYNC:
            sync_ms += ms
            sync_calls += e.count / n_steps
        rows.append({"name": e.key[:120], "self_ms_per_step": ms, "calls_per_step": e.count / n_steps})
    rows.sort(key=lambda r: -r["self_ms_per_step"])
    return {"host_sync_ms_per_step": sync_ms, "host_sync_calls_per_step": sync_calls, "host": rows[:top]}


def _is_device(e) -> bool:
    return e.device_type is not None and "cuda" in str(e.device_type).lower()


def idle_gaps(device_intervals, min_gap_us: float = 20.0) -> list[tuple[float, float]]:
    """The device's idle intervals (start, end) between its kernels (intervals in us, any order, overlapping
    streams merged): gaps shorter than `min_gap_us` (launch spacing) are not idle time."""
    gaps, end = [], None
    for s, e in sorted(device_intervals):
        if end is not None and s - end >= min_gap_us:
            gaps.append((end, s))
        end = e if end is None else max(end, e)
    return gaps


def attribute_gaps(gaps, host_events) -> dict[str, float]:
    """Host time spent inside the device's idle gaps, by event name, as self time: each host event (name, start,
    end, children [(start, end)]) is charged the part of the gaps it covers minus what its children cover. What
    the host was doing while the device waited: the code to shorten (or to overlap) for a device-bound step."""
    import bisect

    gaps = sorted(gaps)
    starts = [g[0] for g in gaps]

    def covered(s, e):
        tot = 0.0
        for gs, ge in gaps[max(0, bisect.bisect_right(starts, s) - 1):bisect.bisect_left(starts, e)]:
            tot += max(0.0, min(e, ge) - max(s, gs))
        return tot

    out: dict[str, float] = {}
    for name, s, e, children in host_events:
        own = covered(s, e) - sum(covered(cs, ce) for cs, ce in children)
        if own > 0:
            out[name] = out.get(name, 0.0) + own
    return out


def _idle_rows(events, n_steps: int, top: int = 20) -> dict:
    """Device idle time per step inside the profiled window and the host events running during it (self time
    within the gaps, `attribute_gaps`): a step whose device is idle N ms waits on the host code listed here."""
    dev = [(e.time_range.start, e.time_range.end) for e in events
           if _is_device(e) and not e.name.startswith("ProfilerStep")]
    if not dev:
        return {}
    gaps = idle_gaps(dev)
    host = [(e.name, e.time_range.start, e.time_range.end,
             [(c.time_range.start, c.time_range.end) for c in e.cpu_children])
            for e in events if not _is_device(e) and not e.name.startswith("ProfilerStep")]
    by = attribute_gaps(gaps, host)
    rows = sorted(({"name": k[:120], "idle_ms_per_step": v / 1e3 / n_steps} for k, v in by.items()),
                  key=lambda r: -r["idle_ms_per_step"])
    return {"device_idle_ms_per_step": sum(ge - gs for gs, ge in gaps) / 1e3 / n_steps,
            "device_idle_gaps_per_step": len(gaps) / n_steps, "idle_host": rows[:top]}


def forward_ratio(args) -> dict:
    """time(no-grad forward) / time(grad forward) of the implicit model's map f(z) = norm_f(blocks(z, inj)) (the
    work of one solver iteration vs the phantom step's forward), and forward + backward of f, at --micro x
    --seq-len, bf16 autocast, blocks compiled with --compile on (as the trainer). The (s+1) implicit step costs
    about s no-grad forwards plus one forward + backward beyond the explicit step's, so the ratio implied for
    (4+1) is 1 + 4 t(no-grad) / t(forward + backward) (the embedding, injection and head are left out of both).
    Each time also as the host's (until the call returns); on CUDA, where the solve replays a captured graph of f
    (lm.models.solve_graph), that replay's times too."""
    import torch
    from transformers import AutoModelForCausalLM

    from lm.models.presets import load_config

    template, _ = CASES[args.case or "mamba2-explicit"]
    preset = template.format(size=args.size)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config(preset, implicit={"max_iter": 4, "phantom_steps": 1}, **_overrides(args))
    model = AutoModelForCausalLM.from_config(cfg).to(dev).train()
    if args.compile == "on":
        for layer in model.model.layers:
            layer.compile()
    amp = (torch.autocast(dev.type, dtype=torch.bfloat16) if args.precision == "bf16"
           else torch.autocast(dev.type, enabled=False))
    ids = torch.randint(0, cfg.vocab_size, (args.micro, args.seq_len), device=dev)
    with torch.no_grad(), amp:
        emb = model.model.embed_tokens(ids)
        inj = model.model.injection(emb)
        shared = model.model._shared(emb, None, None)
    f = model.model.fixed_point_map(inj, None, None, shared)
    z = torch.randn_like(emb)

    def nograd():
        with torch.no_grad(), amp:
            return f(z)

    def grad_forward():
        with amp:
            return f(z)

    def forward_backward():
        with amp:
            out = f(z)
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    def timed(fn, reps):
        """Medians of (wall, host): until the device is done, and until the call returns (the host's work where the
        device keeps up; at a small --micro the device waits for the host and the two meet)."""
        for _ in range(max(2, args.warmup)):
            fn()
        walls, hosts = [], []
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            hosts.append(time.perf_counter() - t0)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
            del out
        return statistics.median(walls), statistics.median(hosts)

    reps = max(3, args.steps)
    (t_ng, h_ng), (t_gf, h_gf), (t_fb, h_fb) = (timed(nograd, reps), timed(grad_forward, reps),
                                                timed(forward_backward, reps))
    out = {"mode": "forward_ratio", "preset": preset, "compile": args.compile == "on", "micro": args.micro,
           "seq_len": args.seq_len, "precision": args.precision, "device": str(dev),
           "nograd_forward_ms": 1e3 * t_ng, "grad_forward_ms": 1e3 * t_gf, "forward_backward_ms": 1e3 * t_fb,
           "nograd_forward_host_ms": 1e3 * h_ng, "grad_forward_host_ms": 1e3 * h_gf,
           "forward_backward_host_ms": 1e3 * h_fb,
           "nograd_over_grad_forward": t_ng / t_gf, "nograd_over_forward_backward": t_ng / t_fb,
           "implied_implicit_4p1_over_explicit": 1 + 4 * t_ng / t_fb}
    from lm.models import solve_graph

    if solve_graph.capturable(model.model, inj, None, None):  # the solve's captured map (lm.models.solve_graph)
        with torch.no_grad(), amp:
            for _ in range(2):  # captured at the second sighting of the shape
                g = solve_graph.solve_map(model.model, f, inj, shared, z)

        def captured():
            with torch.no_grad(), amp:
                return g(z)

        t_cg, h_cg = timed(captured, reps)
        out.update(captured_nograd_forward_ms=1e3 * t_cg, captured_nograd_forward_host_ms=1e3 * h_cg)
    if dev.type == "cuda":
        from lm.benchmarks import kernel_times

        out["gpu"] = torch.cuda.get_device_name()
        out["kernels"] = {name: dict(list(kernel_times(fn, iters=3).items())[:25])
                          for name, fn in (("nograd_forward", nograd), ("grad_forward", grad_forward),
                                           ("forward_backward", forward_backward))}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES), help="run one case in this process (internal)")
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated cases to run, of {', '.join(CASES)}")
    ap.add_argument("--size", default="350m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--engine", default="auto", choices=["auto", "deepspeed", "torch"],
                    help="train.engine (auto: plain PyTorch in one process)")
    ap.add_argument("--zero-stage", type=int, default=2, help="train.zero_stage (DeepSpeed engine)")
    ap.add_argument("--deepspeed-config", default=None,
                    help="train.deepspeed_config: a DeepSpeed json or a packaged one (zero1, zero2)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--act-ckpt", action="store_true", help="activation checkpointing")
    ap.add_argument("--compile", default="off", choices=["off", "on", "both"],
                    help="model.compile (torch.compile per block); both: each case eager, then compiled")
    ap.add_argument("--peak-flops", type=float, default=989e12)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per case")
    ap.add_argument("--output", "--out", dest="out", default=None, help="JSON file for the results")
    ap.add_argument("--profile", type=int, default=0,
                    help="torch.profiler over this many steps after the warmup: per-kernel device ms per step")
    ap.add_argument("--forward-ratio", action="store_true",
                    help="time the implicit map's no-grad forward vs grad forward vs forward+backward (--case, "
                         "default mamba2-explicit's preset at --size) instead of training")
    ap.add_argument("--override", action="append", metavar="KEY=VALUE",
                    help="a model config field for every case (model.overrides), e.g. chunk_size=128; repeatable")
    args = ap.parse_args()
    if args.forward_ratio:
        r = forward_ratio(args)
        print(f"{r['preset']} micro {r['micro']} x {r['seq_len']}: no-grad forward {r['nograd_forward_ms']:.1f} ms, "
              f"grad forward {r['grad_forward_ms']:.1f} ms, forward+backward {r['forward_backward_ms']:.1f} ms; "
              f"no-grad / grad forward {r['nograd_over_grad_forward']:.3f}; implied (4+1) / explicit "
              f"{r['implied_implicit_4p1_over_explicit']:.2f}")
        print(f"  host (until the call returns): no-grad forward {r['nograd_forward_host_ms']:.1f} ms, grad forward "
              f"{r['grad_forward_host_ms']:.1f} ms, forward+backward {r['forward_backward_host_ms']:.1f} ms"
              + (f"; captured no-grad forward {r['captured_nograd_forward_ms']:.1f} ms (host "
                 f"{r['captured_nograd_forward_host_ms']:.2f} ms)" if "captured_nograd_forward_ms" in r else ""))
        for name, ks in r.get("kernels", {}).items():
            print(f"  {name} (ms per call):")
            for k, v in list(ks.items())[:15]:
                print(f"    {v:8.3f}  {k[:110]}")
        if args.out:
            Path(args.out).write_text(json.dumps(r, indent=1))
        return 0
    if args.case:
        print("RESULT " + json.dumps(run_case(args)), flush=True)
        return 0

    results = []
    modes = ["off", "on"] if args.compile == "both" else [args.compile]
    for case, mode in [(c, m) for c in args.cases.split(",") for m in modes]:
        micro, accum = args.micro, args.accum
        while True:
            cmd = [sys.executable, "-m", "lm.benchmarks.train", "--case", case, "--size", args.size, "--seq-len", str(args.seq_len),
                   "--micro", str(micro), "--accum", str(accum), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--precision", args.precision, "--engine", args.engine,
                   "--zero-stage", str(args.zero_stage)] + (["--deepspeed-config", args.deepspeed_config]
                                                            if args.deepspeed_config else []) + [
                   "--device", args.device, "--peak-flops", str(args.peak_flops), "--compile", mode, "--profile", str(args.profile)] + (["--act-ckpt"] if args.act_ckpt else []) + [
                   f"--override={o}" for o in args.override or []]
            t0 = time.time()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                text, rc = p.stdout + p.stderr, p.returncode
            except subprocess.TimeoutExpired as e:
                text, rc = f"timeout after {args.timeout}s\n{(e.stdout or b'')[-2000:]!r}", -1
            line = next((x for x in text.splitlines() if x.startswith("RESULT ")), None)
            if line:
                r = json.loads(line[7:])
                results.append(r)
                print(f"{r['case']:30s} {r['tokens_per_s']:>10,.0f} tok/s  MFU {100 * r['mfu']:5.1f}%  step "
                      f"{1e3 * r['step_time_s']:8.1f} ms  mem {r['mem_gb']:5.1f} GB"
                      + (f"  alloc retries {r['alloc_retries']}" if "alloc_retries" in r else "")
                      + f"  (case wall {time.time() - t0:.0f}s)",
                      flush=True)
                if "profile" in r:
                    pr = r["profile"]
                    print(f"  device busy {pr['device_ms_per_step']:.1f} ms of {1e3 * r['step_time_s']:.1f} ms per step; "
                          "top kernels (ms/step, calls/step):")
                    for k in pr["kernels"][:25]:
                        print(f"    {k['ms_per_step']:8.2f} {k['calls_per_step']:6.0f}  {k['name']}")
                    print(f"  host: waits on the device {pr['host_sync_ms_per_step']:.1f} ms in "
                          f"{pr['host_sync_calls_per_step']:.0f} calls per step; top host events (self ms/step, calls/step):")
                    for k in pr["host"][:15]:
                        print(f"    {k['self_ms_per_step']:8.2f} {k['calls_per_step']:6.0f}  {k['name']}")
                    if "device_idle_ms_per_step" in pr:
                        print(f"  device idle {pr['device_idle_ms_per_step']:.1f} ms per step in "
                              f"{pr['device_idle_gaps_per_step']:.0f} gaps; host events during them (self ms/step):")
                        for k in pr["idle_host"][:15]:
                            print(f"    {k['idle_ms_per_step']:8.2f}  {k['name']}")
                break
            if "out of memory" in text.lower() and micro > 1:
                micro, accum = micro // 2, accum * 2
                print(f"{case} (compile {mode}): out of memory, retrying with micro-batch {micro} x {accum}", flush=True)
                continue
            print(f"{case} (compile {mode}): FAILED (rc {rc})\n{text[-4000:]}", flush=True)
            results.append({"case": case + ("+compile" if mode == "on" else ""), "error": text[-4000:]})
            break
        if args.out:  # after every case: a run cut short by a time limit keeps what it measured
            Path(args.out).write_text(json.dumps({"results": results, "ratios": {}}, indent=1))
    by = {r["case"]: r for r in results if "error" not in r}
    ratios = {}
    for fam, sfx in [(f, s) for f in ("mamba2", "llama", "hybrid") for s in ("", "+compile")]:
        e, i = by.get(f"{fam}-explicit{sfx}"), by.get(f"{fam}-implicit-4+1{sfx}")
        if e and i:
            ratios[f"{fam}{sfx}_implicit_over_explicit_step_time"] = (
                i["step_time_s"] / i["tokens_per_step"]) / (e["step_time_s"] / e["tokens_per_step"])
    ratios.update(hybrid_mix_ratios(results))
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results, "ratios": ratios}, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
