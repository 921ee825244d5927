"""Helpers of the context-parallel tests: run many cases on N gloo ranks of one process group and compare a sharded
run with the unsharded one.

A rank's start (a fresh interpreter importing torch, lm_kernels and lm: ~5 s of CPU) costs more than most cases, so a
test module starts its ranks once per group size and runs every case in them (`run_cases`), and the ranks are forked
from a server process that imported those modules once (multiprocessing's forkserver, shared by every start of the
pytest process; it has the environment of its own start): a rank starts in a fraction of a second, from a process
that has run nothing else. A case's failed comparisons are recorded (`close`, `check`), not raised, so that every rank
still runs the case's collectives to the end and the next case starts in step; the failures of all ranks are gathered
after each case and reported per case. An exception in a case stops every rank at once (torch.multiprocessing
terminates the others) and is raised with every rank's exception and the case it ran.

    CASES = {2: {"llama": (fn, args), ...}, 4: {...}}                 # fn(rank, world, *args)
    @pytest.fixture(scope="module")
    def reports(request): return run_selected(request, CASES)         # one start per group size, the selected cases
    @pytest.mark.parametrize("world, case", case_params(CASES))
    def test_x(reports, world, case): assert_passed(reports, world, case)
"""
from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import os
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# what the forkserver imports before it forks any rank (an import that fails there is left to the rank)
PRELOAD = ["context_parallel_checks", "lm_kernels.context_parallel", "lm.models", "lm.models.context_parallel",
           "lm.models.presets"]
_FAILURES: list[str] = []  # this rank's failed checks in the case that runs
_LABEL: list[str] = []  # what the case is comparing now (dtype, packing), prefixed to its failures


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, cases, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a collective that one rank misses fails the test in two minutes (gloo's default waits 30)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        reports = {}
        for name, fn, args in cases:
            _FAILURES.clear()
            _LABEL.clear()
            start = time.perf_counter()
            try:
                fn(rank, world, *args)
            except Exception as err:  # for run_cases to report: the other ranks then fail too, with a lost peer
                with open(f"{out}.rank{rank}", "w") as f:
                    f.write(f"case {name!r}, rank {rank}: {type(err).__name__}: {err}\n"
                            f"{traceback.format_exc(limit=-4)}")
                raise
            seconds = time.perf_counter() - start
            every = [None] * world
            dist.all_gather_object(every, list(_FAILURES))
            reports[name] = {"failures": [f"rank {r}: {m}" for r, ms in enumerate(every) for m in ms],
                             "seconds": round(seconds, 2)}
        if rank == 0:
            with open(out, "w") as f:
                json.dump(reports, f)
    finally:
        dist.destroy_process_group()


def run_cases(world: int, cases: list) -> dict:
    """Each case (name, fn, args) in turn, fn(rank, world, *args) on `world` gloo ranks of one process group (one
    start of `world` processes). Returns {name: {"failures": ["rank r: ...", ...], "seconds": s}}; an exception in a
    case raises here, with every rank's exception and its case."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "reports.json")
        multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
        try:
            mp.start_processes(_entry, args=(world, _port(), cases, out), nprocs=world, join=True,
                               start_method="forkserver")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            # every rank's exception: the one torch reports may be a rank that lost its peer, not the cause
            errors = [open(os.path.join(tmp, n)).read() for n in sorted(os.listdir(tmp)) if ".rank" in n]
            raise RuntimeError(f"a context-parallel case raised on {world} ranks:\n" + "\n".join(errors)) from err
        with open(out) as f:
            return json.load(f)


def case_params(cases: dict) -> list:
    """The (world, case) parameters of a test over `cases` = {world: {name: (fn, args)}}."""
    return [(world, name) for world, named in cases.items() for name in named]


def run_selected(request, cases: dict) -> dict:
    """The module's selected tests' cases (their (world, case) parameters), one spawn per group size: {(world, name):
    report}. Cases whose tests are deselected (-k) do not run."""
    wanted = {(item.callspec.params["world"], item.callspec.params["case"]) for item in request.session.items
              if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})}
    reports = {}
    for world, named in cases.items():
        todo = [(name, *named[name]) for name in named if (world, name) in wanted]
        if todo:
            reports.update({(world, name): r for name, r in run_cases(world, todo).items()})
    return reports


def assert_passed(reports: dict, world: int, case: str) -> None:
    report = reports[(world, case)]
    failures = report["failures"]
    shown = "\n".join(failures[:20]) + (f"\n... {len(failures) - 20} more" if len(failures) > 20 else "")
    assert not failures, f"case {case!r} on {world} ranks ({report['seconds']} s):\n{shown}"


@contextlib.contextmanager
def label(text: str):
    """Prefix the failures recorded inside with `text` (what the case compares there: dtype, packing)."""
    _LABEL.append(text)
    try:
        yield
    finally:
        _LABEL.pop()


def check(ok: bool, message) -> bool:
    """Record `message` as a failure of the running case unless ok (the case goes on: its collectives stay in step
    with the other ranks')."""
    if not ok:
        _FAILURES.append(" ".join(_LABEL + [str(message)]))
    return ok


def close(name, got, want, dtype, tight: float = 1e-10, loose: float = 1e-5) -> bool:
    """got == want to `tight` (float64) or `loose` (float32) relative to want's largest entry."""
    tol = tight if dtype == torch.float64 else loose
    got, want = got.detach().double(), want.detach().double()
    if not check(got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, want {tuple(want.shape)}"):
        return False
    scale = want.abs().max().clamp_min(1e-30)
    err = float((got - want).abs().max() / scale)
    return check(err <= tol, f"{name}: relative error {err:.3g} > {tol:.1g}")  # a NaN fails too


def summed(t: torch.Tensor, group=None) -> torch.Tensor:
    """t summed over the ranks (a parameter's gradient: each rank holds its slice's part)."""
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t
