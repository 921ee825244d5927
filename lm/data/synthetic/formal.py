"""Formal-language tasks of the Chomsky-hierarchy benchmark (Deletang et al. 2023), as used by xLSTM,
Grazzi et al. 2025 and the DeltaProduct / FP-RNN papers: parity and modular arithmetic with and
without brackets. Each batch has one length (Deletang's protocol: a length per step, sampled by the
caller from the training range).

Vocabularies (the papers' sizes):
  parity:                      0, 1                                   (2)
  mod arithmetic, no brackets: 0..m-1, '+', '-', '*', '=', PAD        (m + 5 = 10 for m = 5)
  mod arithmetic, brackets:    0..m-1, '+', '-', '*', '(', ')', '=', PAD  (m + 7 = 12 for m = 5)
The expression is followed by '='; the answer (a residue 0..m-1) is the target at the '=' position.
`length` counts the expression's tokens, without '='. Random-guess accuracy: 1/2 and 1/m.
"""
from __future__ import annotations

import random

import numpy as np

from .batch import IGNORE, Batch, check_rng, make_batch


def parity(rng, batch_size: int, length: int, targets: str = "last") -> Batch:
    """Bits x_1..x_T; target y_t = (x_1 + ... + x_t) mod 2 at the last position ('last') or every one ('all')."""
    rng = check_rng(rng)
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    bits = rng.integers(0, 2, size=(batch_size, length), dtype=np.int64)
    run = np.cumsum(bits, axis=1) % 2
    if targets == "all":
        tgt = run
    elif targets == "last":
        tgt = np.full_like(run, IGNORE)
        tgt[:, -1] = run[:, -1]
    else:
        raise ValueError(f"targets must be 'last' or 'all', got {targets!r}")
    return make_batch(bits, tgt)


class ArithmeticVocab:
    """Token ids of the modular-arithmetic tasks."""

    def __init__(self, modulus: int, brackets: bool):
        if modulus < 2:
            raise ValueError(f"modulus must be >= 2, got {modulus}")
        self.modulus = m = modulus
        self.brackets = brackets
        self.plus, self.minus, self.times = m, m + 1, m + 2
        if brackets:
            self.lpar, self.rpar, self.equals, self.pad = m + 3, m + 4, m + 5, m + 6
        else:
            self.lpar = self.rpar = None
            self.equals, self.pad = m + 3, m + 4
        self.size = self.pad + 1

    def decode(self, ids) -> str:
        names = {self.plus: "+", self.minus: "-", self.times: "*", self.equals: "=", self.pad: "_"}
        if self.brackets:
            names.update({self.lpar: "(", self.rpar: ")"})
        return "".join(str(int(i)) if int(i) < self.modulus else names[int(i)] for i in ids)


def evaluate_flat(tokens, vocab: ArithmeticVocab) -> int:
    """Value mod m of `d op d op ... d` with the usual precedence (* before + and -); reference for tests."""
    m = vocab.modulus
    total, term, sign = 0, int(tokens[0]), 1
    for i in range(1, len(tokens), 2):
        op, d = int(tokens[i]), int(tokens[i + 1])
        if op == vocab.times:
            term = term * d % m
        else:
            total += sign * term
            sign = 1 if op == vocab.plus else -1
            term = d
    return (total + sign * term) % m


def mod_arithmetic(rng, batch_size: int, length: int, modulus: int = 5) -> Batch:
    """Expressions d op d op ... d (odd `length`; an even length is lowered by one as in Deletang et al.)
    with ops + - * uniform, evaluated with precedence mod `modulus`."""
    rng = check_rng(rng)
    v = ArithmeticVocab(modulus, brackets=False)
    if length % 2 == 0:
        length -= 1
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    n = length // 2
    digits = rng.integers(0, modulus, size=(batch_size, n + 1), dtype=np.int64)
    ops = rng.integers(0, 3, size=(batch_size, n), dtype=np.int64) + v.plus
    expr = np.empty((batch_size, length), dtype=np.int64)
    expr[:, 0::2], expr[:, 1::2] = digits, ops
    # vectorised evaluation with precedence: running sum of finished terms and the current product term
    total = np.zeros(batch_size, dtype=np.int64)
    sign = np.ones(batch_size, dtype=np.int64)
    term = digits[:, 0].copy()
    for i in range(n):
        op, d = ops[:, i], digits[:, i + 1]
        is_mul = op == v.times
        total = np.where(is_mul, total, total + sign * term)
        sign = np.where(is_mul, sign, np.where(op == v.plus, 1, -1))
        term = np.where(is_mul, term * d % modulus, d)
    answer = (total + sign * term) % modulus
    inputs = np.concatenate([expr, np.full((batch_size, 1), v.equals)], axis=1)
    tgt = np.full_like(inputs, IGNORE)
    tgt[:, -1] = answer
    return make_batch(inputs, tgt)


def _bracket_expression(rnd: random.Random, length: int, v: ArithmeticVocab) -> tuple[list[int], int]:
    """A random expression of exactly `length` tokens and its value (Deletang et al.'s grammar):
    1: d   2: -d   3: (d)   4: (-d)   >=5: (E op E) with the two sub-lengths split at random.

    Uses a `random.Random` (seeded from the caller's numpy Generator): its scalar draws are ~10x cheaper
    than numpy's, and this loop is the costliest generator of the suite."""
    m = v.modulus
    # iterative expansion with an explicit stack (no recursion limit at long lengths)
    out: list[int] = []
    stack: list = [("expr", length)]
    values: list[int] = []
    while stack:
        kind, arg = stack.pop()
        if kind == "expr":
            n = arg
            if n <= 4:
                d = rnd.randrange(m)
                neg = n in (2, 4)
                toks = ([v.minus] if neg else []) + [d]
                if n >= 3:
                    toks = [v.lpar] + toks + [v.rpar]
                out.extend(toks)
                values.append((-d) % m if neg else d)
                continue
            left = rnd.randrange(1, n - 3)  # 1 .. n-4
            right = n - 3 - left
            op = rnd.randrange(3) + v.plus
            # emitted in order: '(' left op right ')' ; combine after both are done
            stack.append(("combine", op))
            stack.append(("tok", v.rpar))
            stack.append(("expr", right))
            stack.append(("tok", op))
            stack.append(("expr", left))
            stack.append(("tok", v.lpar))
        elif kind == "tok":
            out.append(arg)
        else:  # combine the last two values
            b, a = values.pop(), values.pop()
            if arg == v.plus:
                values.append((a + b) % m)
            elif arg == v.minus:
                values.append((a - b) % m)
            else:
                values.append(a * b % m)
    assert len(out) == length and len(values) == 1
    return out, values[0]


def evaluate_brackets(tokens, vocab: ArithmeticVocab) -> int:
    """Value mod m of a bracketed expression by a small recursive-descent parser (reference for tests).

    Grammar: E := T (('+'|'-') T)* ; T := F ('*' F)* ; F := d | '-' F | '(' E ')'.
    """
    toks = [int(t) for t in tokens]
    m, pos = vocab.modulus, 0

    def factor():
        nonlocal pos
        t = toks[pos]
        if t == vocab.minus:
            pos += 1
            return (-factor()) % m
        if t == vocab.lpar:
            pos += 1
            val = expr()
            if toks[pos] != vocab.rpar:
                raise ValueError(f"unbalanced expression {vocab.decode(toks)}")
            pos += 1
            return val
        if t >= m:
            raise ValueError(f"unexpected token {t} in {vocab.decode(toks)}")
        pos += 1
        return t

    def term():
        nonlocal pos
        val = factor()
        while pos < len(toks) and toks[pos] == vocab.times:
            pos += 1
            val = val * factor() % m
        return val

    def expr():
        nonlocal pos
        val = term()
        while pos < len(toks) and toks[pos] in (vocab.plus, vocab.minus):
            op = toks[pos]
            pos += 1
            rhs = term()
            val = (val + rhs) % m if op == vocab.plus else (val - rhs) % m
        return val

    val = expr()
    if pos != len(toks):
        raise ValueError(f"trailing tokens in {vocab.decode(toks)}")
    return val


def mod_arithmetic_brackets(rng, batch_size: int, length: int, modulus: int = 5) -> Batch:
    """Random bracketed expressions of exactly `length` tokens (digits, unary minus, + - *, brackets)."""
    rng = check_rng(rng)
    v = ArithmeticVocab(modulus, brackets=True)
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    inputs = np.empty((batch_size, length + 1), dtype=np.int64)
    tgt = np.full((batch_size, length + 1), IGNORE, dtype=np.int64)
    rnd = random.Random(int(rng.integers(0, 2**63 - 1)))
    for b in range(batch_size):
        toks, val = _bracket_expression(rnd, length, v)
        inputs[b, :length] = toks
        tgt[b, length] = val
    inputs[:, length] = v.equals
    return make_batch(inputs, tgt)
