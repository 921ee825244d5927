"""A seeded random permutation of range(n) evaluated pointwise, in O(1) memory.

``permute(positions, n, key)`` maps positions 0..n-1 to a shuffled order of 0..n-1 without building
the permutation: a Feistel network is a bijection on [0, 4^h) (h = ceil(bits(n-1)/2)), and
"cycle walking" (encrypting again while the value is >= n) restricts it to a bijection on [0, n).
The reader needs this because the window count of a large corpus (10^8 windows of 2048 tokens in
300B tokens) would make an explicit permutation per rank cost gigabytes.

``epoch_key(seed, epoch)`` derives the round keys for one epoch from the seed.
"""
from __future__ import annotations

import numpy as np

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast, well-mixing bijection of uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def epoch_key(seed: int, epoch: int) -> np.ndarray:
    """Round keys (uint64[ROUNDS]) for one epoch of one seed."""
    return np.random.SeedSequence([int(seed), int(epoch)]).generate_state(ROUNDS, dtype=np.uint64)


def permute(positions, n: int, key: np.ndarray) -> np.ndarray:
    """The images of ``positions`` (ints in [0, n)) under the permutation of range(n) keyed by ``key``."""
    pos = np.asarray(positions, dtype=np.int64)
    if n < 1:
        raise ValueError(f"permutation size must be >= 1, got {n}")
    if pos.size and (pos.min() < 0 or pos.max() >= n):
        raise ValueError(f"positions must lie in [0, {n})")
    if n == 1:
        return np.zeros_like(pos)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    out = pos.astype(np.uint64)
    todo = np.ones(out.shape, dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():  # cycle walking: at most a few passes (the domain is < 4n)
            x = out[todo]
            left, right = x >> shift, x & mask
            for k in key:
                left, right = right, left ^ (_mix64(right ^ k) & mask)
            out[todo] = (left << shift) | right
            todo = out >= np.uint64(n)
    return out.astype(np.int64)
