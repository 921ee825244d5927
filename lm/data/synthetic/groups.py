"""Finite monoids as multiplication tables: S_n, A_n, Z_n, D_n, an aperiodic reset monoid, products.

Every element is a transformation of a finite set {0..k-1}, stored as a tuple `f` with `f[i]` the image
of `i`. Elements are numbered by sorting these tuples lexicographically, so the identity of S_n, A_n,
Z_n and D_n is element 0 (the identity tuple is the smallest permutation).

Product convention (the automaton, "left to right" order): `a * b` means "apply a, then b", i.e.
`(a * b)[i] = b[a[i]]`. The prefix product of a word m_0 m_1 ... m_k is then the state transformation
after reading the word from left to right: p_k = p_{k-1} * m_k. For groups either convention gives an
equally hard task; for the reset monoid this one makes the product "the last reset read", a real
memory (flip-flop) task, where the other order would make it "the first reset read".
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Monoid:
    """A finite monoid given by its elements (transformations) and multiplication table.

    table[a, b] = index of a * b (apply a, then b); identity is the index of the neutral element.
    """

    name: str
    elements: tuple[tuple[int, ...], ...]
    table: np.ndarray = field(repr=False)
    identity: int

    @property
    def order(self) -> int:
        return len(self.elements)

    def mul(self, a: int, b: int) -> int:
        return int(self.table[a, b])

    def index(self, element: tuple[int, ...]) -> int:
        return self.elements.index(tuple(element))


def compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """a * b as transformations: apply a, then b."""
    return tuple(b[a[i]] for i in range(len(a)))


def monoid_from_elements(name: str, elements) -> Monoid:
    """Build the table of the transformation monoid made of `elements` (must be closed, hold identity)."""
    elems = tuple(sorted({tuple(int(v) for v in e) for e in elements}))
    if not elems:
        raise ValueError(f"monoid {name!r}: no elements")
    k = len(elems[0])
    pos = {e: i for i, e in enumerate(elems)}
    ident = tuple(range(k))
    if ident not in pos:
        raise ValueError(f"monoid {name!r}: the identity transformation is missing")
    n = len(elems)
    table = np.empty((n, n), dtype=np.int64)
    for i, a in enumerate(elems):
        for j, b in enumerate(elems):
            c = compose(a, b)
            if c not in pos:
                raise ValueError(f"monoid {name!r}: not closed ({a} * {b} = {c} is missing)")
            table[i, j] = pos[c]
    table.setflags(write=False)
    return Monoid(name=name, elements=elems, table=table, identity=pos[ident])


def _parity(p: tuple[int, ...]) -> int:
    """0 for an even permutation, 1 for an odd one (count inversions)."""
    inv = sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j])
    return inv % 2


def symmetric_group(n: int) -> Monoid:
    """S_n: all n! permutations of n points."""
    if n < 1:
        raise ValueError(f"symmetric group needs n >= 1, got {n}")
    return monoid_from_elements(f"S{n}", itertools.permutations(range(n)))


def alternating_group(n: int) -> Monoid:
    """A_n: the n!/2 even permutations of n points (n >= 2; A_2 is trivial)."""
    if n < 2:
        raise ValueError(f"alternating group needs n >= 2, got {n}")
    return monoid_from_elements(f"A{n}", (p for p in itertools.permutations(range(n)) if _parity(p) == 0))


def cyclic_group(n: int) -> Monoid:
    """Z_n: the n rotations i -> i + k (mod n) of n points."""
    if n < 1:
        raise ValueError(f"cyclic group needs n >= 1, got {n}")
    return monoid_from_elements(f"Z{n}", (tuple((i + k) % n for i in range(n)) for k in range(n)))


def dihedral_group(n: int) -> Monoid:
    """D_n: the 2n symmetries (n rotations, n reflections) of a regular n-gon (n >= 3)."""
    if n < 3:
        raise ValueError(f"dihedral group D_n needs n >= 3 (the symmetries of an n-gon), got {n}")
    rots = [tuple((i + k) % n for i in range(n)) for k in range(n)]
    refl = [tuple((k - i) % n for i in range(n)) for k in range(n)]
    return monoid_from_elements(f"D{n}", rots + refl)


def reset_monoid(k: int = 3) -> Monoid:
    """U_k: the identity and the k constant maps ("resets") of a k-state set; order k + 1.

    Every element is idempotent (x * x = x), so the monoid is aperiodic. With the left-to-right
    product, the prefix product of a word is the last reset read (the identity if none yet): the
    Krohn-Rhodes "flip-flop" memory for k = 2. `reset_monoid(3)` is the 4-element aperiodic monoid we
    use for the D_p mixture of the implicit-LM paper, which does not say which one it used.
    """
    if k < 1:
        raise ValueError(f"reset monoid needs k >= 1 states, got {k}")
    consts = [tuple([c] * k) for c in range(k)]
    return monoid_from_elements(f"U{k}", [tuple(range(k))] + consts)


def direct_product(m1: Monoid, m2: Monoid) -> Monoid:
    """M1 x M2 with element (a, b) numbered a * |M2| + b and componentwise product."""
    n1, n2 = m1.order, m2.order
    a = np.arange(n1 * n2) // n2
    b = np.arange(n1 * n2) % n2
    table = m1.table[a[:, None], a[None, :]] * n2 + m2.table[b[:, None], b[None, :]]
    table = np.ascontiguousarray(table, dtype=np.int64)
    table.setflags(write=False)
    elements = tuple(m1.elements[i] + tuple(v + len(m1.elements[0]) for v in m2.elements[j])
                     for i in range(n1) for j in range(n2))
    return Monoid(name=f"{m1.name}x{m2.name}", elements=elements, table=table,
                  identity=m1.identity * n2 + m2.identity)


def is_aperiodic(m: Monoid) -> bool:
    """True if every x satisfies x^n = x^(n+1) for some n (here n = |M| suffices): no nontrivial group."""
    for x in range(m.order):
        p = x
        for _ in range(m.order - 1):
            p = m.mul(p, x)  # p = x^|M|
        if m.mul(p, x) != p:
            return False
    return True


def prefix_products(m: Monoid, words: np.ndarray) -> np.ndarray:
    """Prefix products p[:, t] = words[:, 0] * ... * words[:, t] for a (B, T) array of element indices."""
    words = np.asarray(words, dtype=np.int64)
    if words.ndim != 2:
        raise ValueError(f"words must be (batch, length), got shape {words.shape}")
    out = np.empty_like(words)
    if words.shape[1] == 0:
        return out
    out[:, 0] = words[:, 0]
    for t in range(1, words.shape[1]):
        out[:, t] = m.table[out[:, t - 1], words[:, t]]
    return out


_FAMILIES = {"S": symmetric_group, "A": alternating_group, "Z": cyclic_group, "D": dihedral_group,
             "U": reset_monoid}


def monoid_by_name(name: str) -> Monoid:
    """'S5', 'A5', 'Z7', 'D4', 'U3' (reset monoid) -> the monoid."""
    fam, num = name[:1].upper(), name[1:]
    if fam not in _FAMILIES or not num.isdigit():
        raise ValueError(f"unknown group {name!r}: use S<n>, A<n>, Z<n>, D<n> or U<k> (e.g. S5, A5, Z7, D4)")
    n = int(num)
    if fam in "SA" and n > 8:
        raise ValueError(f"group {name!r} is too large for a table (n! elements); use n <= 8")
    return _FAMILIES[fam](n)
