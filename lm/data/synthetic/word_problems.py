"""Word problems on finite monoids: the model reads m_0 .. m_{T-1} and predicts every prefix product.

Token = element index, vocabulary = the monoid's order (Merrill et al. 2024, "The illusion of state in
state-space models"; the implicit-LM, DeltaProduct, FP-RNN and BD-LRU papers all use this form).
"""
from __future__ import annotations

import numpy as np

from .batch import IGNORE, Batch, check_rng, make_batch
from .groups import Monoid, direct_product, prefix_products


def _targets(products: np.ndarray, targets: str) -> np.ndarray:
    if targets == "all":
        return products
    if targets == "last":
        out = np.full_like(products, IGNORE)
        out[:, -1] = products[:, -1]
        return out
    raise ValueError(f"targets must be 'all' (every prefix product) or 'last' (the final product), got {targets!r}")


def word_problem(rng, batch_size: int, length: int, monoid: Monoid, targets: str = "all") -> Batch:
    """Uniform words of `length` elements; target at position t is m_0 * ... * m_t."""
    rng = check_rng(rng)
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    words = rng.integers(0, monoid.order, size=(batch_size, length), dtype=np.int64)
    return make_batch(words, _targets(prefix_products(monoid, words), targets))


def mixture_word_problem(rng, batch_size: int, length: int, aperiodic: Monoid, group: Monoid,
                         p: float, targets: str = "all", product: Monoid | None = None) -> Batch:
    """The D_p distribution of the implicit-LM paper on M = aperiodic x group.

    Each token is (a, g): a uniform over the aperiodic monoid; g is the group identity with probability
    1 - p and each non-identity element with probability p / (|G| - 1) ("hard" tokens). Token index
    a * |G| + g (see `direct_product`); target = prefix product in M. Pass `product` (the precomputed
    direct_product(aperiodic, group)) to skip rebuilding its table per batch.
    """
    rng = check_rng(rng)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p (hard-token probability) must be in [0, 1], got {p}")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    prod = product if product is not None else direct_product(aperiodic, group)
    if prod.order != aperiodic.order * group.order:
        raise ValueError(f"product has order {prod.order}, expected {aperiodic.order} x {group.order}")
    a = rng.integers(0, aperiodic.order, size=(batch_size, length), dtype=np.int64)
    hard = rng.random((batch_size, length)) < p
    others = np.array([g for g in range(group.order) if g != group.identity], dtype=np.int64)
    g = np.where(hard, others[rng.integers(0, len(others), size=(batch_size, length))], group.identity)
    words = a * group.order + g
    return make_batch(words, _targets(prefix_products(prod, words), targets))
