"""Device values that the host reads later without waiting for the device now.

    pending = queue_to_host(values)   # on CUDA: a copy to pinned memory queued behind the work so far, and an event
    ...                               # more work is queued
    read_host(pending)                # waits for that event only, not for the work queued after it -> Python list
"""
from __future__ import annotations

import torch


def queue_to_host(t: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """(host tensor, event): on CUDA `t` copied to pinned host memory without waiting, with a timing event recorded
    after the copy (its elapsed_time can end a measurement); elsewhere (t, None)."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return host, event


def read_host(pending: tuple[torch.Tensor, "torch.cuda.Event | None"]) -> list:
    """The values of queue_to_host's copy once it has landed."""
    t, event = pending
    if event is not None:
        event.synchronize()
    return t.tolist()
