"""Generation cache shared by every model type.

One dict of tensors per layer (Mamba2: conv and SSM state; attention: K and V; DeltaProduct: recurrent
and conv states; ...). Mixers read their layer's dict and write it back through `update` (attention
through `append_kv`), which does nothing while the cache is `frozen`: implicit models iterate each new
token to convergence against a frozen cache, then run one committing pass (paper 003, sequential mode).

Two kinds of cache:

- dynamic (the default): entries are replaced by new tensors; attention's K/V grow by concatenation.
- static (`LMCache.static_like`, used by `lm.models.decode.StaticDecoder`): every entry is a buffer
  allocated once; `update` copies into it and `append_kv` writes the new keys/values at `position` (a
  device tensor, so that no Python integer enters the step) into (b, h, capacity, d) buffers that attention
  reads whole under an additive mask (0 on the written slots each new token sees, -inf on the others, computed
  once per step). Attention's one-token decode step writes its keys/values itself (`kv_buffers`, one kernel with
  the rotary embedding: lm_kernels.rope). A one-token step on a static cache touches no Python-side state, which is
  what CUDA-graph capture needs.

A dynamic cache that generation is decoding with a static decoder is *bound* to it: its states live in the
decoder's buffers between steps. Any other use of the cache (a mixer reading it, reordering beams, ...)
first copies them back (`_unbind`).

Left padding (`attention_mask` with zeros, transformers' convention): pads are identity steps of every recurrent
state, so a recurrent state needs nothing more; attention's cached keys of pads stay in the K/V tensors and are
masked. The cache keeps which of its tokens are real (`real`, recorded by the model's forward for each new chunk of
tokens), from which attention's key mask and each row's token positions (rotary embedding: a row's first real token
is at position 0, as that prompt alone) follow. A static cache holds the same as device buffers (`real` over its
K/V slots and the pad count of each row, filled when a decoder binds a cache), which a captured step reads.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

# Cache entries that grow with the sequence, and along which dim: attention's keys and values (b, h, s, d).
# Every other entry is a fixed-size recurrent state.
SEQ_DIM = {"k": 2, "v": 2}


def mask_positions(real: torch.Tensor) -> torch.Tensor:
    """Each token's position in its row (b, s) from the row's real-token mask: the count of real tokens before it
    (pads, before a row's first real token, at 0), so that a left-padded prompt's tokens have the positions they
    have alone."""
    return (real.long().cumsum(-1) - 1).clamp_(min=0)


class LMCache:
    is_compileable = False

    def __init__(self, num_layers: int | None = None):
        self.layers: dict[int, dict[str, torch.Tensor]] = {}
        self.seen_tokens = 0
        self.frozen = False
        self.num_layers = num_layers
        # how implicit models process t > 1 new tokens ("parallel" | "sequential"); set by the model's forward
        self.prefill: str | None = None
        # "static" | "graph" | None: the one-token decode path generation asked for (see lm.models.decode)
        self.decode: str | None = None
        self._bound = None  # the StaticDecoder holding this cache's states between decode steps
        # (b, n) bool, True at real tokens, over the first n tokens (every later one is real); None: no pads.
        # Static caches: (b, capacity) over the K/V slots, with `pads` (b,) long, each row's count of pad slots
        self.real: torch.Tensor | None = None
        self.pads: torch.Tensor | None = None
        # static caches only
        self.static = False
        self.position: torch.Tensor | None = None  # (1,) long: position of the first new token
        self.capacity = 0  # K/V slots
        self._step_tensors = None  # (positions, {(dtype, window): attention mask}) of the current step, see begin_step

    @classmethod
    def static_like(cls, layers: dict, capacity: int, device, padded: bool = False) -> "LMCache":
        """A static cache with buffers shaped like `layers` (a dynamic cache's entries); K/V get `capacity`
        slots along their sequence dim. Buffers start at zero. `padded`: for caches of left-padded prompts, also
        the pad buffers `real` and `pads` (where there are K/V slots to mask; see `load_mask`)."""
        st = cls(len(layers))
        st.static = True
        st.capacity = capacity
        st.position = torch.zeros(1, dtype=torch.long, device=device)
        batch = None
        for i, d in layers.items():
            st.layers[i] = {}
            for k, v in d.items():
                shape = list(v.shape)
                batch = shape[0]
                if k in SEQ_DIM:
                    shape[SEQ_DIM[k]] = capacity
                st.layers[i][k] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        if padded and capacity and batch is not None:
            st.real = torch.ones(batch, capacity, dtype=torch.bool, device=device)
            st.pads = torch.zeros(batch, dtype=torch.long, device=device)
        return st

    def load_mask(self, real: torch.Tensor | None) -> None:
        """Static caches with pad buffers: take the real-token mask (b, n) of a dynamic cache's n tokens (None: all
        real); the slots after them are real (decode tokens)."""
        if self.real is None:
            return
        self.real.fill_(True)
        if real is not None:
            self.real[:, :real.shape[1]].copy_(real)
        torch.sum(~self.real, dim=1, out=self.pads)

    def record_mask(self, mask: torch.Tensor | None, t: int) -> None:
        """Dynamic caches: note which of the next t tokens are real (mask (b, t) bool, None: all), before they are
        processed."""
        if mask is None:
            return
        if self.static:
            raise ValueError("a static cache takes decode tokens only, which are never pads: run a left-padded "
                             "prompt on a dynamic cache (generate does)")
        seen = self.seen_tokens
        prev = self.key_mask(0)
        if prev is None:
            prev = mask.new_ones(mask.shape[0], seen)
        self.real = torch.cat([prev, mask], dim=1)

    def key_mask(self, t: int) -> torch.Tensor | None:
        """Dynamic caches: (b, seen + t) bool, True at the real tokens among the cached ones and the next t, or None
        where all are real. (A static cache masks its pad slots in `attention_mask`: None.)"""
        if self.real is None or self.static:
            return None
        n = self.seen_tokens + t
        real = self.real[:, :n]
        return F.pad(real, (0, n - real.shape[1]), value=True) if real.shape[1] < n else real

    # --- used by mixers -----------------------------------------------------------------------------
    def get(self, layer_idx: int) -> dict[str, torch.Tensor]:
        if self._bound is not None:
            self._unbind()
        return self.layers.get(layer_idx, {})

    def update(self, layer_idx: int, **state: torch.Tensor) -> None:
        if self.frozen:
            return
        if self.static:
            bufs = self.layers[layer_idx]
            for k, v in state.items():
                bufs[k].copy_(v)
            return
        if self._bound is not None:
            self._unbind()
        self.layers.setdefault(layer_idx, {}).update(state)

    def buffer(self, layer_idx: int, key: str) -> torch.Tensor | None:
        """Static caches that are not frozen: the buffer of state `key`, for a mixer to write its new state into
        directly (in place, instead of a new tensor that `update` then copies); None otherwise (then `update`)."""
        if self.static and not self.frozen:
            return self.layers[layer_idx].get(key)
        return None

    def append_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, window: int | None = None):
        """Attention: append the new keys/values (b, h, t, d) after the cached ones. Returns (keys, values, mask):
        all keys/values to attend to (b, h, s, d) and mask (t, s), additive in k's dtype (see `attention_mask`; a
        sliding `window` masks the keys behind it), of what each new token sees, or None for the plain case (the
        cached s - t positions and the new ones causally: the caller applies its window there).

        Dynamic: concatenation, stored unless frozen. Static: written at slots position .. position + t - 1 of
        the (b, h, capacity, d) buffers, also while frozen (an implicit model's iterations rewrite the same
        slots and its committing pass writes them last), and the whole buffers are returned under a mask."""
        if not self.static:
            past = self.get(layer_idx)
            if "k" in past:
                k = torch.cat([past["k"], k], dim=2)
                v = torch.cat([past["v"], v], dim=2)
            self.update(layer_idx, k=k, v=v)
            return k, v, None
        bufs = self.layers[layer_idx]
        q_pos = self._step(k.shape[2], k.device)[0]
        bufs["k"].index_copy_(2, q_pos, k)
        bufs["v"].index_copy_(2, q_pos, v)
        return bufs["k"], bufs["v"], self.attention_mask(k.shape[2], k.dtype, k.device, window)

    def kv_buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Static caches: attention's (b, h, capacity, d) K and V buffers, for a step that writes the new keys and
        values at slots `positions(t)` itself (instead of through `append_kv`; also while frozen, as there)."""
        bufs = self.layers[layer_idx]
        return bufs["k"], bufs["v"]

    def attention_mask(self, t: int, dtype, device, window: int | None = None) -> torch.Tensor:
        """Static caches: the (t, capacity) additive mask of this step in `dtype`: 0 where new token i (at position
        `position` + i) sees slot j <= its position, -inf on the later (unwritten) slots and, with a sliding window
        w, on the slots j <= its position - w; with pad buffers (b, 1, t, capacity), -inf also on each row's pad
        slots. Made once per step, dtype and window: additive rather than bool, since SDPA turns a bool mask into this
        one on every call (3 kernels per layer)."""
        q_pos, masks = self._step(t, device)
        mask = masks.get((dtype, window))
        if mask is None:
            slots = torch.arange(self.capacity, device=device).unsqueeze(0)
            seen = slots <= q_pos.unsqueeze(1)
            if window is not None:
                seen = seen & (slots > q_pos.unsqueeze(1) - window)
            if self.real is not None:  # (b, 1, t, capacity)
                seen = (seen.unsqueeze(0) & self.real.unsqueeze(1)).unsqueeze(1)
            mask = masks[(dtype, window)] = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(
                ~seen, float("-inf"))
        return mask

    def positions(self, t: int, device) -> torch.Tensor:
        """Positions of the next t tokens: (t,) from `seen_tokens` (dynamic) or the `position` tensor (static); where
        the cache holds pads (b, t), each row's own (`mask_positions`), the slot less the row's pads."""
        if self.static:
            slots = self._step(t, device)[0]
            return slots if self.real is None else slots.unsqueeze(0) - self.pads.unsqueeze(1)
        real = self.key_mask(t)
        if real is not None:
            return mask_positions(real)[:, -t:] if t else real.new_zeros(real.shape[0], 0, dtype=torch.long)
        return torch.arange(self.seen_tokens, self.seen_tokens + t, device=device)

    def begin_step(self, t: int) -> None:
        """Static caches: forget the positions / attention masks of the previous step (they are computed once
        per step from `position`, not once per layer)."""
        self._step_tensors = None

    def _step(self, t: int, device):
        st = self._step_tensors
        if st is None or st[0].shape[0] != t:
            st = self._step_tensors = (self.position + torch.arange(t, device=device), {})
        return st

    @contextlib.contextmanager
    def freeze(self):
        old = self.frozen
        self.frozen = True
        try:
            yield self
        finally:
            self.frozen = old

    # --- binding to a static decoder ------------------------------------------------------------------
    def _unbind(self) -> None:
        """Copy the states back from the static decoder this cache is bound to (see module docstring)."""
        dec, self._bound = self._bound, None
        if dec is not None:
            self.layers = dec.export(self)

    # --- used by generation -------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def __len__(self) -> int:
        if self._bound is not None:
            self._unbind()
        return len(self.layers)

    def _map(self, fn) -> None:
        if self._bound is not None:
            self._unbind()
        for d in self.layers.values():
            for k, v in d.items():
                d[k] = fn(v)
        if self.real is not None:
            self.real = fn(self.real)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda v: v.index_select(0, beam_idx.to(v.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda v: v.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda v: v[indices])
