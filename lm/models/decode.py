"""One-token decoding without per-token Python work: static cache buffers, optionally a captured CUDA graph.

A decode token through the eager model is hundreds of kernel launches issued from Python (a Mamba2-350M
token ~500), so on a GPU its cost is the host, not the ~0.7 GB of weights it reads. `StaticDecoder` runs
the step `logits = lm_head(LMModel.decode_step(ids, static_cache))` on buffers allocated once:

- "static": the step runs eagerly on the static buffers (any device; the CPU tests check that it gives
  the eager path's tokens);
- "graph": the step is captured once into a CUDA graph (after two warm-up runs that compile and
  autotune the Triton kernels; the states are restored afterwards) and each token is one replay.

Implicit models run the step's solve with its fixed iteration count (`eval_max_iter`, no early stop: a
data-dependent stop needs the host), then the committing pass.

Generation binds its (dynamic) `LMCache` to a decoder after the prefill: the states are copied into the
decoder's buffers once and stay there while tokens are decoded (see lm.models.cache). Decoders are kept
per model and batch size and reused by later `generate` calls, so a graph is captured once per shape.
Attention's K/V buffers have room for `capacity` positions; a cache that outgrows them is copied into
larger buffers (room for twice as many new tokens) and the step is captured again.

A cache of left-padded prompts (LMCache.real) decodes on a decoder of its own (the key's `padded`): its static cache
holds the pad mask as buffers, loaded when a cache binds, and its step masks each row's pad slots and rotates at each
row's own positions (a step that reads those buffers, captured apart from the unpadded one).
"""
from __future__ import annotations

import warnings
import weakref

import torch

from .cache import SEQ_DIM, LMCache

DECODE_MODES = ("auto", "eager", "static", "graph")
HEADROOM = 256  # K/V slots beyond the current length at the first allocation
MAX_DECODERS = 4  # per model (batch sizes / devices); the oldest is dropped beyond this

_DECODERS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def resolve_decode(mode: str | None, device: torch.device) -> str | None:
    """The decode path for `mode` on `device`: None (eager), "static" or "graph". "auto" is a CUDA graph on
    CUDA and eager elsewhere."""
    mode = mode or "auto"
    if mode not in DECODE_MODES:
        raise ValueError(f"decode={mode!r} is not one of {DECODE_MODES}")
    if mode == "auto":
        return "graph" if device.type == "cuda" else None
    if mode == "graph" and device.type != "cuda":
        raise ValueError(f"decode='graph' captures a CUDA graph and needs the model on a CUDA device (it is on "
                         f"{device}); use decode='static' (static buffers, no capture) or 'eager'")
    return None if mode == "eager" else mode


def decoder_for(model, batch: int, graph: bool, padded: bool = False) -> "StaticDecoder":
    """The model's decoder for this batch size and mode (made on first use); `padded` for caches of left-padded
    prompts (see the module docstring)."""
    p = model.get_input_embeddings().weight
    key = (batch, graph, padded, p.device, p.dtype, p.data_ptr(), torch.is_autocast_enabled(p.device.type))
    table = _DECODERS.setdefault(model, {})
    dec = table.get(key)
    if dec is None:
        if len(table) >= MAX_DECODERS:
            table.pop(next(iter(table))).release()
        dec = table[key] = StaticDecoder(model, batch, graph, padded)
    return dec


def release_decoders(model) -> None:
    """Drop the model's decoders (their buffers and graphs); caches bound to them get their states back."""
    for dec in _DECODERS.pop(model, {}).values():
        dec.release()


class StaticDecoder:
    def __init__(self, model, batch: int, graph: bool, padded: bool = False):
        self._model = weakref.ref(model)
        self.batch = batch
        self.use_graph = graph
        self.padded = padded
        self.cache: LMCache | None = None  # the static cache (buffers)
        self.ids: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.graph = None
        self._owner = None  # weakref to the dynamic cache bound to this decoder
        self._signature = None

    @property
    def model(self):
        m = self._model()
        if m is None:
            raise RuntimeError("the model of this decoder was deleted")
        return m

    # --- buffers ------------------------------------------------------------------------------------
    @staticmethod
    def _layout(layers: dict) -> tuple:
        return tuple(sorted((i, k, tuple(s for j, s in enumerate(v.shape) if j != SEQ_DIM.get(k)), v.dtype)
                            for i, d in layers.items() for k, v in d.items()))

    def _allocate(self, layers: dict, needed: int) -> None:
        dev = next(iter(next(iter(layers.values())).values())).device
        cap = 0
        if any(k in SEQ_DIM for d in layers.values() for k in d):
            old = self.cache.capacity if self.cache is not None else 0
            cap = -(-max(needed + HEADROOM, 2 * old) // 64) * 64
        self.cache = LMCache.static_like(layers, cap, dev, padded=self.padded)
        self.ids = torch.zeros(self.batch, 1, dtype=torch.long, device=dev)
        self.graph = self.logits = None
        self._signature = self._layout(layers)

    def _fits(self, layers: dict, needed: int) -> bool:
        return (self.cache is not None and self._signature == self._layout(layers)
                and (self.cache.capacity >= needed or not self.cache.capacity))

    def _load(self, cache: LMCache) -> None:
        """Bind `cache`: copy its states into the buffers (reallocating when they do not fit)."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner is not cache and owner._bound is self:
            owner._unbind()  # another cache still lives in these buffers: give it its states back
        if cache._bound is not None:
            cache._unbind()
        layers, seen = cache.layers, cache.seen_tokens
        if not self._fits(layers, seen + 1):
            self._allocate(layers, seen + 1)
        for i, d in layers.items():
            for k, v in d.items():
                buf = self.cache.layers[i][k]
                (buf.narrow(SEQ_DIM[k], 0, v.shape[SEQ_DIM[k]]) if k in SEQ_DIM else buf).copy_(v)
        self.cache.load_mask(cache.key_mask(0))
        cache.layers = {}
        cache._bound = self
        self._owner = weakref.ref(cache)

    def export(self, cache: LMCache) -> dict:
        """The bound cache's states as fresh tensors (K/V cut to its length)."""
        seen = cache.seen_tokens
        return {i: {k: (v.narrow(SEQ_DIM[k], 0, seen) if k in SEQ_DIM else v).clone() for k, v in d.items()}
                for i, d in self.cache.layers.items()}

    def release(self) -> None:
        owner = self._owner() if self._owner is not None else None
        if owner is not None and owner._bound is self:
            owner._unbind()
        self.cache = self.ids = self.logits = self.graph = None

    # --- the step -----------------------------------------------------------------------------------
    def _run(self) -> torch.Tensor:
        model = self.model
        h = model.model.decode_step(self.ids, self.cache)
        return model.lm_head(h)

    def _capture(self) -> None:
        with torch.cuda.device(self.ids.device):  # the model's GPU, not necessarily the current one
            self._capture_on_device()

    def _capture_on_device(self) -> None:
        bufs = [v for d in self.cache.layers.values() for v in d.values()]
        saved = [v.clone() for v in bufs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles / autotunes the Triton kernels outside the capture
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.logits = self._run()
        except RuntimeError as e:  # an op in the step synchronises with the host (e.g. Anderson's linalg.solve)
            warnings.warn(f"{type(self.model).__name__}: the decode step could not be captured in a CUDA graph "
                          f"({e}); decoding with static buffers without a graph instead", stacklevel=3)
            self.use_graph = False
        finally:
            for v, s in zip(bufs, saved):
                v.copy_(s)
        if self.use_graph:
            self.graph = graph

    @torch.no_grad()
    def step(self, cache: LMCache, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (b, 1, vocab) of the next token for `cache` (bound on first use), and advance the cache."""
        if cache._bound is not self or (self.cache.capacity and cache.seen_tokens + 1 > self.cache.capacity):
            if cache._bound is self:
                cache._unbind()
            self._load(cache)
        self.ids.copy_(input_ids)
        self.cache.position.fill_(cache.seen_tokens)
        if self.use_graph:
            if self.graph is None:
                self._capture()
        if self.use_graph:
            self.graph.replay()
            logits = self.logits.clone()
        else:
            logits = self._run()
        cache.seen_tokens += 1
        return logits
