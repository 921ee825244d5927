"""The implicit models' solver map F(z) = norm_f(blocks(z, inj)) replayed as one captured CUDA graph.

The no-grad solve of an implicit step calls F max_iter times (4 in the bounded phase, up to 24 - 32 in the free phase)
with the same shapes. Issued from Python, one call of Mamba2-350M's 48 layers costs ~65 ms of host time on an H100 host
(the compiled blocks' wrappers and launches and the Triton ops' launches), about the ~71 ms of device time it takes at
16 x 2048 tokens: the solve is as much host work as device work, and a slower host stalls the GPU. A replay of the
captured stack costs the host a few microseconds. Measured (H100, docs/performance.md): a host-bound (4+1) step
(micro-batch 1) in about half the time, a device-bound one (micro-batch 16) unchanged, for 0.6 GB more memory (the
graph's pool and the static copies).

What a replay reads: the parameters where they are (the optimizer updates them in place; a parameter that moves
starts a new capture), static copies of the injection and of the mixers' shared inputs that each forward copies in,
and the static input that each call copies z into. Each call returns a fresh tensor (the solver keeps iterates and
Anderson histories). Graphs are kept per model and per (shapes, dtypes, autocast state, mode, parameter storage),
the two most recent ones; a key is captured the second time a forward has it (a training run's second step), so
one-off shapes (evaluation batches) cost no capture.

The parallel prefill of generation (LMModel._parallel_prefill on an empty cache) solves through the same map and
then runs one committing pass f(z*) that fills a generation cache; `commit_map` captures that pass too, on a fresh
cache made inside the capture, and hands back clones of the states it wrote. Without it the prefill is the solve's
replays plus one pass issued from Python, which at batch 1 costs more host time than the whole solve's device time.

Not captured (the plain map runs): CPU tensors, packed documents (their chunk tables are built on the host per batch),
generation caches, mixers not marked capturable (Mixer.capturable: Mamba2's, Llama's, DeltaProduct's and the LRU
family's are, each checked against the plain map on an H100; FP-Mamba's inner solve synchronises with the host),
parameters that DeepSpeed ZeRO-3 gathers per forward, and a forward already inside a capture or under torch.compile.
A capture that fails warns once and the model then solves uncaptured.
"""
from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

MAX_GRAPHS = 2  # per model and kind (solve / commit): the training shape and an evaluation shape

_GRAPHS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[OrderedDict, OrderedDict]]" = weakref.WeakKeyDictionary()
_FAILED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # the solve's map failed to capture
_FAILED_COMMIT: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()  # the prefill's committing pass did


def capturable(model, inj: torch.Tensor, cu_seqlens, cache) -> bool:
    """Whether the solve of this forward can replay a captured graph of the map (see the module docstring)."""
    if inj.device.type != "cuda" or cu_seqlens is not None or cache is not None or model in _FAILED:
        return False
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    if not all(getattr(layer.mixer, "capturable", False) for layer in model.layers):
        return False
    return not any(hasattr(p, "ds_status") for p in model.parameters())  # ZeRO-3: gathered per forward


def _tensors(tree) -> list[torch.Tensor]:
    return [v for v in tree_flatten(tree)[0] if isinstance(v, torch.Tensor)]


def _spec(v):
    return (tuple(v.shape), v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else v


class _Entry:
    """A captured call of the map on static copies of its inputs. commit: the map runs with a fresh generation cache
    (made inside each warm-up and the capture) and a call returns (output, the states it wrote, cloned)."""

    def __init__(self, model, inj, shared, z, commit=False):
        self.inj = inj.detach().clone()
        self.shared = tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, shared)
        self.z = z.detach().clone()
        self.model, self.commit = model, commit
        self.graph = None
        self.out = None
        self.states = None

    def _run(self):
        cache = None
        if self.commit:
            from .cache import LMCache  # noqa: PLC0415

            cache = LMCache(len(self.model.layers))
            cache.prefill = "parallel"
        out = self.model.fixed_point_map(self.inj, cache, None, self.shared)(self.z)
        return out, (cache.layers if cache is not None else None)

    def capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles, autotunes and plans outside the capture (nothing cached in its pool)
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # (thread_local: other threads of the process, e.g. a run's heartbeat, may use the CUDA API meanwhile)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.out, self.states = self._run()
        self.graph = graph

    def replay(self):
        self.graph.replay()

    @property
    def f(self):
        """The map on the static copies (uncaptured; what a replay computes)."""
        return lambda z: self.model.fixed_point_map(self.inj, None, None, self.shared)(z)

    @torch.no_grad()
    def load(self, inj, shared):
        self.inj.copy_(inj)
        for dst, src in zip(_tensors(self.shared), _tensors(shared)):
            dst.copy_(src)

    def __call__(self, z):
        self.z.copy_(z)
        self.replay()
        if self.commit:
            return self.out.clone(), {i: {k: v.clone() for k, v in d.items()} for i, d in self.states.items()}
        return self.out.clone()


def _entry(model, inj: torch.Tensor, shared: dict, z: torch.Tensor, commit: bool) -> "_Entry | None":
    """The model's captured entry for these inputs (loaded with them), captured at the second call with this key;
    None at the first call or where the capture failed (it warns once, and that kind is not captured again for the
    model)."""
    failed = _FAILED_COMMIT if commit else _FAILED
    if model in failed:
        return None
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    # (inference mode in the key: buffers made under it cannot be written outside it)
    key = (commit, _spec(inj), _spec(z), tuple(map(_spec, tree_flatten(shared)[0])), autocast, model.training,
           torch.is_inference_mode_enabled(), tuple(p.data_ptr() for p in model.parameters()))
    graphs, seen = _GRAPHS.setdefault(model, (OrderedDict(), OrderedDict()))
    entry = graphs.get(key)
    if entry is None:
        if key not in seen:  # captured at the second forward of a key: one-off shapes (evaluation) run plainly
            seen[key] = None
            while len(seen) > 8:
                seen.popitem(last=False)
            return None
        entry = _Entry(model, inj, shared, z, commit=commit)
        try:
            # captured as the solve calls it: without autograd (the caller may be in a training forward)
            with torch.no_grad(), torch.cuda.device(inj.device), torch.autocast(
                    "cuda", dtype=autocast[1], enabled=autocast[0], cache_enabled=False):
                entry.capture()
        except RuntimeError as e:
            failed.add(model)
            for k in [k for k in graphs if k[0] == commit]:
                del graphs[k]
            what = "prefill's committing pass" if commit else "solve's map"
            warnings.warn(f"{type(model).__name__}: the implicit {what} could not be captured in a CUDA graph ({e}); "
                          "running it without a graph", stacklevel=4)
            return None
        while sum(k[0] == commit for k in graphs) >= MAX_GRAPHS:  # the oldest of this kind goes
            del graphs[next(k for k in graphs if k[0] == commit)]
        graphs[key] = entry
    graphs.move_to_end(key)
    entry.load(inj, shared)
    return entry


def solve_map(model, f, inj: torch.Tensor, shared: dict, z: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The map for the no-grad solve of `model` (an LMModel) from iterates like `z`: a captured graph's replay of
    `f` = model.fixed_point_map(inj, None, None, shared) (captured at the second call with this key), else `f`
    itself (the first call, or a failed capture). The caller checked `capturable`."""
    entry = _entry(model, inj, shared, z, commit=False)
    return f if entry is None else entry


def commit_map(model, inj: torch.Tensor, shared: dict, z: torch.Tensor):
    """The parallel prefill's committing pass on an empty cache as a captured graph: a callable z -> (h, the cache's
    per-layer states {layer: {name: tensor}}) that replays model.fixed_point_map(inj, fresh cache, None, shared),
    or None (the first call with this key, or a failed capture: the caller runs the pass itself). The caller checked
    `capturable` (for the map without a cache) and that the cache is empty."""
    return _entry(model, inj, shared, z, commit=True)
