"""Accuracy metrics on (predictions, targets, mask) arrays of shape (batch, length).

token_accuracy:    correct scored positions / scored positions.
last_accuracy:     accuracy of each sequence's last scored position (the "accuracy at length T" of
                   word problems, the answer of parity and modular arithmetic).
sequence_accuracy: fraction of sequences whose scored positions are all right.
scaled_accuracy:   (acc - chance) / (1 - chance): 1 = perfect, 0 = random guessing (Deletang et al.,
                   xLSTM, Grazzi et al., DeltaProduct Table 2). Not clipped: below chance is negative.
per_position_accuracy: accuracy at each position (NaN where nothing is scored).
"""
from __future__ import annotations

import numpy as np


def _arrays(pred, target, mask):
    pred, target, mask = (np.asarray(a.detach().cpu() if hasattr(a, "detach") else a) for a in (pred, target, mask))
    mask = mask.astype(bool)
    if not (pred.shape == target.shape == mask.shape):
        raise ValueError(f"pred/target/mask shapes differ: {pred.shape}, {target.shape}, {mask.shape}")
    return pred, target, mask


def token_accuracy(pred, target, mask) -> float:
    pred, target, mask = _arrays(pred, target, mask)
    n = mask.sum()
    return float(((pred == target) & mask).sum() / n) if n else float("nan")


def last_accuracy(pred, target, mask) -> float:
    pred, target, mask = _arrays(pred, target, mask)
    has = mask.any(axis=1)
    if not has.any():
        return float("nan")
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    rows = np.nonzero(has)[0]
    return float((pred[rows, last[rows]] == target[rows, last[rows]]).mean())


def sequence_accuracy(pred, target, mask) -> float:
    pred, target, mask = _arrays(pred, target, mask)
    has = mask.any(axis=1)
    if not has.any():
        return float("nan")
    ok = ((pred == target) | ~mask).all(axis=1)
    return float(ok[has].mean())


def scaled_accuracy(accuracy: float, chance: float) -> float:
    if not 0.0 <= chance < 1.0:
        raise ValueError(f"chance accuracy must be in [0, 1), got {chance}")
    return (accuracy - chance) / (1.0 - chance)


def per_position_accuracy(pred, target, mask) -> np.ndarray:
    pred, target, mask = _arrays(pred, target, mask)
    n = mask.sum(axis=0)
    correct = ((pred == target) & mask).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, correct / np.maximum(n, 1), np.nan)


def all_metrics(pred, target, mask, chance: float | None = None) -> dict[str, float]:
    out = {"token_accuracy": token_accuracy(pred, target, mask),
           "last_accuracy": last_accuracy(pred, target, mask),
           "sequence_accuracy": sequence_accuracy(pred, target, mask)}
    if chance is not None:
        out["scaled_accuracy"] = scaled_accuracy(out["token_accuracy"], chance)
    return out
