"""Where a real training step's time goes: `lm train` with a profile, or a trace of every host wait, around a few
steps. Run it as `lm train` is run (one process, or under torchrun / deepspeed on every rank):

    python scripts/train_trace.py --out /tmp/trace -- CONFIG [overrides]
    torchrun --nproc_per_node 2 scripts/train_trace.py --sync --first 5 --steps 2 --out /tmp/trace -- CONFIG

Default: torch.profiler over steps [first, first + steps) (CPU and CUDA activities); writes OUT/rank{r}.txt with the
wall time of each profiled step (device synchronised after it), the device kernels' time and their union (streams
overlapping counted once), and the device and host tables. `--trace` also writes rank 0's Chrome trace.

`--sync` (CUDA): no profiler; every call in those steps that makes the host wait for the device is recorded with
its Python stack: torch's synchronising operations (`torch.cuda.set_sync_debug_mode`: `.item()`, `bool()` of a
device tensor, copies to or from pageable memory, ...) and explicit device, stream and event synchronizations.
Writes OUT/sync_rank{r}.txt, most frequent first, as counts per step. A step that never waits lets the host queue
the next one while the device runs (several ranks at the plain engine's tokens/s per GPU: docs/performance.md).
"""
from __future__ import annotations

import argparse
import collections
import os
import runpy
import sys
import time
import traceback
import warnings

import torch

from lm.train.step import Stepper


def _union_ms(kernels) -> float:
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    total, cur = 0, None
    for s, e in spans:
        if cur is None or s > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    if cur is not None:
        total += cur[1] - cur[0]
    return total / 1e3


class _Profile:
    def __init__(self, out: str, n: int, chrome: bool):
        self.out, self.n, self.chrome, self.walls = out, n, chrome, []
        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = torch.profiler.profile(activities=acts)

    def start(self):
        self.prof.__enter__()

    def stepped(self, seconds: float):
        self.walls.append(seconds)

    def stop(self, rank: int):
        self.prof.__exit__(None, None, None)
        kern = [e for e in self.prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kern) / 1e3 / self.n
        lines = [f"steps profiled {self.n}; wall per step (device synchronised) "
                 f"{[round(w * 1e3, 1) for w in self.walls]} ms",
                 f"device kernel time per step {busy:.1f} ms; union {_union_ms(kern) / self.n:.1f} ms per step"]
        table = self.prof.key_averages()
        if kern:
            lines += ["== device", table.table(sort_by="self_device_time_total", row_limit=50,
                                               max_name_column_width=90)]
        lines += ["== host", table.table(sort_by="self_cpu_time_total", row_limit=50, max_name_column_width=90)]
        with open(os.path.join(self.out, f"rank{rank}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
        if self.chrome and rank == 0:
            self.prof.export_chrome_trace(os.path.join(self.out, "trace0.json"))


class _Waits:
    """Stacks of the calls that wait for the device, while active."""

    def __init__(self, out: str, n: int):
        self.out, self.n, self.active, self.stacks = out, n, False, collections.Counter()
        show = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if self.active and "synchroniz" in str(message):
                self.record("synchronising op")
                return
            show(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"),
                            (torch.cuda.Event, "synchronize")):
            orig = getattr(owner, name)
            label = f"{getattr(owner, '__name__', 'torch.cuda').split('.')[-1]}.{name}"
            setattr(owner, name, self._wrap(orig, label))

    def _wrap(self, orig, label):
        def call(*a, **k):
            self.record(label)
            return orig(*a, **k)
        return call

    def record(self, kind: str):
        if not self.active:
            return
        frames = traceback.extract_stack()[:-2]
        where = tuple(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}" for f in frames[-10:])
        self.stacks[(kind, where)] += 1

    def start(self):
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        self.active = True

    def stop(self, rank: int):
        self.active = False
        torch.cuda.set_sync_debug_mode(0)
        lines = [f"{c / self.n:.1f} per step: {kind}\n    " + "\n    ".join(where)
                 for (kind, where), c in self.stacks.most_common()] or ["no waits for the device"]
        with open(os.path.join(self.out, f"sync_rank{rank}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: train_trace.py [--sync] [--first K] [--steps N] [--out DIR] [--trace] -- CONFIG "
                         "[overrides]  (the arguments after -- are lm train's)")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--first", type=int, default=5, help="first traced step (0-based; compile and warm-up before it)")
    ap.add_argument("--steps", type=int, default=2, help="how many steps to trace")
    ap.add_argument("--out", default="train_trace", help="output folder")
    ap.add_argument("--sync", action="store_true", help="trace the host's waits for the device instead (CUDA)")
    ap.add_argument("--trace", action="store_true", help="also write rank 0's Chrome trace (profile mode)")
    args = ap.parse_args(argv[:cut])
    if args.sync and not torch.cuda.is_available():
        raise SystemExit("train_trace.py --sync: needs CUDA (it records the waits for a CUDA device)")
    os.makedirs(args.out, exist_ok=True)
    rec = _Waits(args.out, args.steps) if args.sync else _Profile(args.out, args.steps, args.trace)
    step_fn, count = Stepper._run, [0]
    rank = int(os.environ.get("RANK", "0"))

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def traced(*a, **k):
        i = count[0]
        count[0] += 1
        if i == args.first:
            sync()
            rec.start()
        t0 = time.perf_counter()
        out = step_fn(*a, **k)
        if args.first <= i < args.first + args.steps and not args.sync:  # (the profile's synced wall times)
            sync()
            rec.stepped(time.perf_counter() - t0)
        if i == args.first + args.steps - 1:
            rec.stop(rank)
        return out

    Stepper._run = traced  # the stepper looks it up at each step
    sys.argv = ["lm.train"] + argv[cut + 1:]
    runpy.run_module("lm.train", run_name="__main__")


if __name__ == "__main__":
    main()
