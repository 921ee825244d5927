"""Generation cache shared by every model type.

One dict of tensors per layer (Mamba2: conv and SSM state; attention: K and V; DeltaProduct: recurrent
and conv states; ...). Mixers read their layer's dict and write it back through `update`, which does
nothing while the cache is `frozen`: implicit models iterate each new token to convergence against a
frozen cache, then run one committing pass (paper 003, sequential mode).
"""
from __future__ import annotations

import contextlib

import torch


class LMCache:
    is_compileable = False

    def __init__(self, num_layers: int | None = None):
        self.layers: dict[int, dict[str, torch.Tensor]] = {}
        self.seen_tokens = 0
        self.frozen = False
        self.num_layers = num_layers

    # --- used by mixers -----------------------------------------------------------------------------
    def get(self, layer_idx: int) -> dict[str, torch.Tensor]:
        return self.layers.get(layer_idx, {})

    def update(self, layer_idx: int, **state: torch.Tensor) -> None:
        if self.frozen:
            return
        self.layers.setdefault(layer_idx, {}).update(state)

    @contextlib.contextmanager
    def freeze(self):
        old = self.frozen
        self.frozen = True
        try:
            yield self
        finally:
            self.frozen = old

    # --- used by generation -------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def __len__(self) -> int:
        return len(self.layers)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for d in self.layers.values():
            for k, v in d.items():
                d[k] = v.index_select(0, beam_idx.to(v.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for d in self.layers.values():
            for k, v in d.items():
                d[k] = v.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for d in self.layers.values():
            for k, v in d.items():
                d[k] = v[indices]
