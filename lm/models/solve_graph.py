"""The implicit models' solver map F(z) = norm_f(blocks(z, inj)) replayed as one captured CUDA graph.

The no-grad solve of an implicit step calls F max_iter times (4 in the bounded phase, up to 24 - 32 in the free phase)
with the same shapes. Issued from Python, one call of Mamba2-350M's 48 layers costs ~65 ms of host time on an H100 host
(the compiled blocks' wrappers and launches and the Triton ops' launches), about the ~71 ms of device time it takes at
16 x 2048 tokens: the solve is as much host work as device work, and a slower host stalls the GPU. A replay of the
captured stack costs the host a few microseconds. Measured (lm/train/BENCH.md, session 36): a host-bound (4+1) step
(micro-batch 1) in about half the time, a device-bound one (micro-batch 16) unchanged, for 0.6 GB more memory (the
graph's pool and the static copies).

What a replay reads: the parameters where they are (the optimizer updates them in place; a parameter that moves
starts a new capture), static copies of the injection and of the mixers' shared inputs that each forward copies in,
and the static input that each call copies z into. Each call returns a fresh tensor (the solver keeps iterates and
Anderson histories). Graphs are kept per model and per (shapes, dtypes, autocast state, mode, parameter storage),
the two most recent ones; a key is captured the second time a forward has it (a training run's second step), so
one-off shapes (evaluation batches) cost no capture.

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

MAX_GRAPHS = 2  # per model: the training shape and an evaluation shape

_GRAPHS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[OrderedDict, OrderedDict]]" = weakref.WeakKeyDictionary()
_FAILED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


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
    def __init__(self, model, inj, shared, z):
        self.inj = inj.detach().clone()
        self.shared = tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, shared)
        self.z = z.detach().clone()
        self.f = model.fixed_point_map(self.inj, None, None, self.shared)
        self.graph = None
        self.out = None

    def capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles, autotunes and plans outside the capture (nothing cached in its pool)
                self.f(self.z)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # (thread_local: other threads of the process, e.g. a run's heartbeat, may use the CUDA API meanwhile)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.out = self.f(self.z)
        self.graph = graph

    @torch.no_grad()
    def load(self, inj, shared):
        self.inj.copy_(inj)
        for dst, src in zip(_tensors(self.shared), _tensors(shared)):
            dst.copy_(src)

    def __call__(self, z):
        self.z.copy_(z)
        self.graph.replay()
        return self.out.clone()


def solve_map(model, f, inj: torch.Tensor, shared: dict, z: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The map for the no-grad solve of `model` (an LMModel) from iterates like `z`: a captured graph's replay of
    `f` = model.fixed_point_map(inj, None, None, shared) (captured at the second call with this key), else `f`
    itself (the first call, or a failed capture). The caller checked `capturable`."""
    autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    # (inference mode in the key: buffers made under it cannot be written outside it)
    key = (_spec(inj), _spec(z), tuple(map(_spec, tree_flatten(shared)[0])), autocast, model.training,
           torch.is_inference_mode_enabled(), tuple(p.data_ptr() for p in model.parameters()))
    graphs, seen = _GRAPHS.setdefault(model, (OrderedDict(), OrderedDict()))
    entry = graphs.get(key)
    if entry is None:
        if key not in seen:  # captured at the second forward of a key: one-off shapes (evaluation) run plainly
            seen[key] = None
            while len(seen) > 8:
                seen.popitem(last=False)
            return f
        entry = _Entry(model, inj, shared, z)
        try:
            # captured as the solve calls it: without autograd (the caller may be in a training forward)
            with torch.no_grad(), torch.cuda.device(inj.device), torch.autocast(
                    "cuda", dtype=autocast[1], enabled=autocast[0], cache_enabled=False):
                entry.capture()
        except RuntimeError as e:
            _FAILED.add(model)
            graphs.clear()
            warnings.warn(f"{type(model).__name__}: the implicit solve's map could not be captured in a CUDA graph "
                          f"({e}); solving without a graph", stacklevel=3)
            return f
        while len(graphs) >= MAX_GRAPHS:
            graphs.popitem(last=False)
        graphs[key] = entry
    graphs.move_to_end(key)
    entry.load(inj, shared)
    return entry
