"""The batch every synthetic generator returns, and the conventions they share."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

IGNORE = -100  # target value where a position has no target (torch cross_entropy's ignore_index)


class Batch(NamedTuple):
    """One batch of a synthetic task; all arrays are (batch, length) numpy arrays.

    inputs:  int64 token ids fed to the model.
    targets: int64 class per position (what the model's output at that position must be), IGNORE where
             there is none. The loss uses every position whose target is not IGNORE.
    mask:    bool, the positions that are scored by the metrics (a subset of the positions with a
             target; equal to `targets != IGNORE` except for tasks that train on more positions than
             they score, e.g. MAD associative recall trains on every next token).
    """

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray

    def to_torch(self, device=None):
        import torch

        return (torch.as_tensor(self.inputs, dtype=torch.long, device=device),
                torch.as_tensor(self.targets, dtype=torch.long, device=device),
                torch.as_tensor(self.mask, dtype=torch.bool, device=device))


def make_batch(inputs, targets, mask=None) -> Batch:
    inputs = np.ascontiguousarray(inputs, dtype=np.int64)
    targets = np.ascontiguousarray(targets, dtype=np.int64)
    if mask is None:
        mask = targets != IGNORE
    mask = np.ascontiguousarray(mask, dtype=bool)
    if not (inputs.shape == targets.shape == mask.shape) or inputs.ndim != 2:
        raise ValueError(f"inputs/targets/mask must share one (batch, length) shape, got "
                         f"{inputs.shape}, {targets.shape}, {mask.shape}")
    if np.any(targets[mask] == IGNORE):
        raise ValueError("mask marks a position that has no target")
    return Batch(inputs, targets, mask)


def check_rng(rng) -> np.random.Generator:
    """Generators take a numpy Generator (seeded by the caller); an int seed is accepted too."""
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)):
        return np.random.default_rng(int(rng))
    raise ValueError(f"rng must be a numpy Generator or an int seed, got {type(rng).__name__}")
