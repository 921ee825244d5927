"""Helpers of the context-parallel tests: run a function on N gloo ranks (torch.multiprocessing spawn) and compare
a sharded run with the unsharded one."""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a collective that one rank misses fails the test in two minutes (gloo's default waits 30)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args) -> None:
    """fn(rank, world, *args) on `world` processes of one gloo group; an exception on any rank fails the caller."""
    mp.spawn(_entry, args=(world, _port(), fn, args), nprocs=world, join=True)


def close(name, got, want, dtype, tight: float = 1e-10, loose: float = 1e-5):
    """got == want to `tight` (float64) or `loose` (float32) relative to want's largest entry."""
    tol = tight if dtype == torch.float64 else loose
    got, want = got.detach().double(), want.detach().double()
    assert got.shape == want.shape, (name, tuple(got.shape), tuple(want.shape))
    scale = want.abs().max().clamp_min(1e-30)
    err = float((got - want).abs().max() / scale)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.1g} (rank {dist.get_rank()})"


def summed(t: torch.Tensor) -> torch.Tensor:
    """t summed over the ranks (a parameter's gradient: each rank holds its slice's part)."""
    t = t.detach().clone()
    dist.all_reduce(t)
    return t
