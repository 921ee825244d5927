"""One backend choice for every op: `resolve_backend(op, backend, device)`.

backend=None is automatic: the environment variable LM_<OP>_BACKEND if set, else "triton" on CUDA when triton
imports (and the op's own `fits` check passes), else "reference". An explicit "triton" on a CPU tensor needs
TRITON_INTERPRET=1 set before triton is first imported (how the CPU tests run the kernels). Ops may accept
more backends than the two (DeltaProduct: "fla").

Nothing here or in the kernel modules reads the environment at import: the backend, whether the kernels run in the
interpreter (`interpreted`) and whether they autotune (`autotuning`) are read on each call.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

DEFAULT_BACKENDS = ("reference", "triton")


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints. (triton.cdiv and triton.next_power_of_2 are constexpr functions: ~6 us of host
    time per call from Python, and every layer's launches compute their grids with them.)"""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host ints."""
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreted() -> bool:
    """Whether the Triton kernels run in triton's CPU interpreter (TRITON_INTERPRET=1), read on each call: it picks
    the interpreter's launch configs. triton.jit reads the same variable once, when a kernel is decorated (when its
    module is imported), and makes an interpreted or a compiled kernel of it; the two agree when the variable is set
    before the kernel modules are imported, as resolve_backend's message says."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotuning(op: str) -> bool:
    """Whether `op`'s Triton kernels autotune their launch configs, read on each call: on the GPU unless
    LM_<OP>_AUTOTUNE=0 (then each kernel launches the first config of its list: less compile time, e.g. in tests);
    never in the interpreter, which times nothing."""
    return not interpreted() and os.environ.get(f"LM_{op.upper()}_AUTOTUNE", "1") != "0"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (an H100's 132 elsewhere: the interpreter, grid heuristics)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def resolve_backend(op: str, backend: str | None, device: torch.device, *, fits: bool = True,
                    backends: tuple[str, ...] = DEFAULT_BACKENDS) -> str:
    """The backend `op` runs for this `backend` argument on `device`; a ValueError that says what to use instead
    for a name it does not know or a Triton call that cannot run here. `fits`: whether the Triton kernel handles
    these inputs (automatic choice only)."""
    var = f"LM_{op.upper()}_BACKEND"
    if backend is None:
        env = os.environ.get(var, "").strip().lower()
        if env:
            if env not in backends:
                raise ValueError(f"{var}={env!r} is not one of {backends}; unset it for the automatic choice")
            backend = env
        else:
            return "triton" if device.type == "cuda" and fits and triton_available() else "reference"
    if backend not in backends:
        raise ValueError(f"{op}: backend={backend!r} is not one of {backends} or None (automatic)")
    if backend == "triton":
        if not triton_available():
            raise ValueError(f"{op}: backend='triton' needs the triton package (pip install triton); "
                             "or use backend='reference'")
        if device.type != "cuda" and not interpreted():
            raise ValueError(f"{op}: backend='triton' on a {device.type} tensor needs TRITON_INTERPRET=1 set before "
                             "triton is imported; use backend='reference' on CPU")
    return backend


# The Triton ops' custom operators (lm::ssd_scan_*, lm::causal_conv1d_*) read their inputs through their strides:
# the exact-stride tag (torch >= 2.8; older: fixed stride order) makes inductor pass each input with the strides it
# had when traced, so a split view of a projection stays a view.
CUSTOM_OP_TAGS = (getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order),)


def absent(like: torch.Tensor, dtype=None) -> torch.Tensor:
    """A custom operator's absent optional output (it cannot return None): 0 elements, on `like`'s device."""
    return like.new_empty(0, dtype=dtype)


_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device):
    """A second CUDA stream of `device` (one per device, made once), for kernels that may run beside the current
    stream's; None off CUDA, where everything runs in order."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    s = _SIDE_STREAMS.get(index)
    if s is None:
        s = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return s


_EVENTS: dict[tuple[int, int], "torch.cuda.Event"] = {}


def _event(device: torch.device, which: int):
    """One reusable event per device and direction (a wait takes the event's state when it is queued, so recording
    it again later is safe): no new event objects per fork or join."""
    key = (device.index, which)
    ev = _EVENTS.get(key)
    if ev is None:
        ev = _EVENTS[key] = torch.cuda.Event()
    return ev


@contextlib.contextmanager
def on_side(side):
    """Launches inside the block go to `side`, after everything the current stream has queued so far; None: they go
    to the current stream. A tensor of the current stream's memory that they touch must stay referenced until
    `join(side)`, or be marked with `tensor.record_stream(side)` before it is dropped."""
    if side is None:
        yield
        return
    ev = _event(side.device, 0)
    ev.record(torch.cuda.current_stream(side.device))
    side.wait_event(ev)
    with torch.cuda.stream(side):
        yield


def join(side) -> None:
    """The current stream waits for what was queued on `side` (no-op for None)."""
    if side is not None:
        ev = _event(side.device, 1)
        ev.record(side)
        torch.cuda.current_stream(side.device).wait_event(ev)
