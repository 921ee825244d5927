"""Copying (Jelassi et al. 2024, "Repeat after me"), as in the FP-RNN paper: vocabulary 29.

Tokens: 26 letters 0..25, BOS 26, COPY 27 (start-copy), EOS 28. The full sequence is
    BOS x_1 .. x_n COPY x_1 .. x_n EOS
fed teacher-forced (inputs = sequence[:-1]); the targets are the next tokens inside the copy region:
x_1 at the COPY position, ..., x_n, then EOS. `length` is n, the string length (train 5-50, test to
100). Character accuracy = per-token accuracy over those n + 1 targets; string accuracy = all right.
"""
from __future__ import annotations

import numpy as np

from .batch import IGNORE, Batch, check_rng, make_batch

N_LETTERS = 26
BOS, COPY, EOS = 26, 27, 28
VOCAB_SIZE = 29


def copying(rng, batch_size: int, length: int) -> Batch:
    rng = check_rng(rng)
    if length < 1:
        raise ValueError(f"length (string length to copy) must be >= 1, got {length}")
    n = length
    x = rng.integers(0, N_LETTERS, size=(batch_size, n), dtype=np.int64)
    col = lambda v: np.full((batch_size, 1), v, dtype=np.int64)  # noqa: E731
    seq = np.concatenate([col(BOS), x, col(COPY), x, col(EOS)], axis=1)  # 2n + 3 tokens
    inputs, nxt = seq[:, :-1], seq[:, 1:]
    tgt = np.full_like(inputs, IGNORE)
    tgt[:, n + 1:] = nxt[:, n + 1:]  # from the COPY position (index n + 1) on
    return make_batch(inputs, tgt)
