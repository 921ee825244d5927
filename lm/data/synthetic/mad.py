"""Three MAD tasks (Poli et al. 2024, mad-lab) as the BD-LRU paper uses them: compression, selective
copying, associative (in-context) recall. Sequences have exactly `length` tokens.

The BD-LRU paper averages four configurations per task: base (vocab 16, length 64, 20,000 training
examples), vocab 32, length 128, and 10,000 training examples (see configs/synth/mad_*.yaml); the
finite training set is drawn by the runner (`train.examples`), the generators only make batches.
"""
from __future__ import annotations

import numpy as np

from .batch import IGNORE, Batch, check_rng, make_batch


def compression(rng, batch_size: int, length: int, vocab_size: int = 16) -> Batch:
    """length - 1 random tokens from 0..V-2, then the compression token V-1; the target is the whole
    input, to be reconstructed from the model's state at the last position (the runner's compression
    head: last hidden state + position embedding -> MLP decoder, as in MAD's auto-encoder)."""
    rng = check_rng(rng)
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be >= 3, got {vocab_size}")
    if length < 2:
        raise ValueError(f"length must be >= 2, got {length}")
    body = rng.integers(0, vocab_size - 1, size=(batch_size, length - 1), dtype=np.int64)
    inputs = np.concatenate([body, np.full((batch_size, 1), vocab_size - 1, dtype=np.int64)], axis=1)
    return make_batch(inputs, inputs.copy())


def selective_copying(rng, batch_size: int, length: int, vocab_size: int = 16,
                      num_tokens_to_copy: int = 16) -> Batch:
    """n data tokens (0..V-3) scattered among blanks (V-2) in the first length - n - 1 positions, the
    copy token (V-1), then n blanks at whose positions the model must output the data tokens in order."""
    rng = check_rng(rng)
    n = num_tokens_to_copy
    if vocab_size < 3:
        raise ValueError(f"vocab_size must be >= 3, got {vocab_size}")
    if n < 1 or length <= 2 * n + 1:
        raise ValueError(f"selective copying needs length > 2 * num_tokens_to_copy + 1, got length {length}, "
                         f"num_tokens_to_copy {n}")
    blank, copy = vocab_size - 2, vocab_size - 1
    span = length - n - 1
    data = rng.integers(0, vocab_size - 2, size=(batch_size, n), dtype=np.int64)
    # positions of the data tokens: n sorted distinct slots out of `span`, per row
    keys = rng.random((batch_size, span))
    slots = np.sort(np.argsort(keys, axis=1)[:, :n], axis=1)
    inputs = np.full((batch_size, length), blank, dtype=np.int64)
    np.put_along_axis(inputs, slots, data, axis=1)
    inputs[:, span] = copy
    tgt = np.full_like(inputs, IGNORE)
    tgt[:, span + 1:] = data
    return make_batch(inputs, tgt)


def associative_recall(rng, batch_size: int, length: int, vocab_size: int = 16) -> Batch:
    """MAD in-context recall, multi-query: length/2 + 1 key-value pairs (keys 0..V/2-1, values V/2..V-1);
    a key keeps its value within a sequence. Teacher-forced next-token targets everywhere (MAD trains on
    them all); scored (mask) are the value positions of keys seen before, the recalls."""
    rng = check_rng(rng)
    if vocab_size < 4 or vocab_size % 2:
        raise ValueError(f"vocab_size must be even and >= 4 (keys and values split it), got {vocab_size}")
    if length < 2 or length % 2:
        raise ValueError(f"length must be even and >= 2 (key-value pairs), got {length}")
    half = vocab_size // 2
    pairs = length // 2 + 1  # one extra token so that inputs/targets both have `length` tokens
    keys = rng.integers(0, half, size=(batch_size, pairs), dtype=np.int64)
    table = rng.integers(half, vocab_size, size=(batch_size, half), dtype=np.int64)  # this sequence's map
    values = np.take_along_axis(table, keys, axis=1)
    seq = np.empty((batch_size, 2 * pairs), dtype=np.int64)
    seq[:, 0::2], seq[:, 1::2] = keys, values
    # a value is recallable if its key occurred in an earlier pair
    seen_before = np.zeros((batch_size, pairs), dtype=bool)
    for j in range(1, pairs):
        seen_before[:, j] = (keys[:, :j] == keys[:, j:j + 1]).any(axis=1)
    scored = np.zeros_like(seq, dtype=bool)
    scored[:, 1::2] = seen_before
    inputs, tgt, mask = seq[:, :length], seq[:, 1:length + 1], scored[:, 1:length + 1]
    return make_batch(inputs, tgt, mask)
