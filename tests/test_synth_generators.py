"""Synthetic task generators: group tables and products against brute force, answers against independent
evaluators, determinism by seed, vocabulary and length ranges; metrics on hand-made cases."""
import itertools

import numpy as np
import pytest

from lm.data.synthetic import (IGNORE, alternating_group, build_task, cyclic_group, dihedral_group,
                               direct_product, is_aperiodic, last_accuracy, monoid_by_name, per_position_accuracy,
                               reset_monoid, scaled_accuracy, sequence_accuracy, symmetric_group, task_parameters,
                               token_accuracy)
from lm.data.synthetic import copying, formal, mad
from lm.data.synthetic.groups import compose

ORDERS = {"S3": 6, "S4": 24, "S5": 120, "A4": 12, "A5": 60, "Z5": 5, "Z7": 7, "D3": 6, "D4": 8, "D5": 10, "U3": 4}


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_group_tables_brute_force(name):
    m = monoid_by_name(name)
    assert m.order == ORDERS[name]
    ident = tuple(range(len(m.elements[0])))
    assert m.elements[m.identity] == ident
    for i, a in enumerate(m.elements):
        assert m.table[m.identity, i] == i and m.table[i, m.identity] == i
        for j, b in enumerate(m.elements):
            c = tuple(b[a[k]] for k in range(len(a)))  # apply a, then b
            assert m.elements[m.table[i, j]] == c
    if m.order <= 24:  # associativity, all triples
        t = m.table
        assert np.array_equal(t[t[:, :, None], np.arange(m.order)[None, None, :]],
                              t[np.arange(m.order)[:, None, None], t[None, :, :]])


def test_group_structure():
    for g in (symmetric_group(4), alternating_group(5), cyclic_group(6), dihedral_group(5)):
        # every element has an inverse
        assert all((g.table[i] == g.identity).any() for i in range(g.order))
        assert not is_aperiodic(g)
    assert all(sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j]) % 2 == 0
               for p in alternating_group(5).elements)
    z = cyclic_group(6).table
    assert np.array_equal(z, z.T)  # abelian
    d = dihedral_group(4).table
    assert not np.array_equal(d, d.T)  # not abelian
    assert set(symmetric_group(3).elements) == set(itertools.permutations(range(3)))


def test_reset_monoid_is_aperiodic():
    u = reset_monoid(3)
    assert u.order == 4 and is_aperiodic(u)
    assert all(u.mul(x, x) == x for x in range(4))  # a band: x^1 = x^2
    c = [i for i in range(4) if i != u.identity]
    for a in range(4):
        for b in c:
            assert u.mul(a, b) == b  # a reset read last wins
    assert is_aperiodic(direct_product(reset_monoid(2), reset_monoid(3)))
    assert not is_aperiodic(direct_product(u, cyclic_group(2)))


def test_direct_product_table():
    a, g = reset_monoid(3), alternating_group(4)
    p = direct_product(a, g)
    assert p.order == 48 and p.identity == a.identity * g.order + g.identity
    rng = np.random.default_rng(0)
    for x, y in rng.integers(0, p.order, size=(200, 2)):
        ax, gx, ay, gy = x // g.order, x % g.order, y // g.order, y % g.order
        assert p.table[x, y] == a.table[ax, ay] * g.order + g.table[gx, gy]
        assert p.elements[p.table[x, y]] == compose(p.elements[x], p.elements[y])


@pytest.mark.parametrize("group", ["S3", "S5", "A5", "Z5", "D4"])
def test_word_problem_prefix_products(group):
    task = build_task("word_problem", group=group)
    m = monoid_by_name(group)
    b = task.generate(np.random.default_rng(1), 8, 20)
    assert b.inputs.shape == (8, 20) and b.inputs.min() >= 0 and b.inputs.max() < task.vocab_size
    assert b.mask.all()
    for r in range(8):
        state = tuple(range(len(m.elements[0])))
        for t in range(20):
            state = compose(state, m.elements[b.inputs[r, t]])
            assert m.elements[b.targets[r, t]] == state
    last = build_task("word_problem", group=group, targets="last").generate(np.random.default_rng(1), 8, 20)
    assert np.array_equal(last.targets[:, -1], b.targets[:, -1]) and last.mask.sum() == 8


def test_mixture_distribution_and_products():
    for p in (0.0, 0.25):
        task = build_task("monoid_mixture", p=p)
        assert task.vocab_size == 240
        b = task.generate(np.random.default_rng(2), 64, 128)
        g = b.inputs % 60
        hard = g != alternating_group(5).identity
        assert abs(hard.mean() - p) < 0.02
        assert np.bincount((b.inputs // 60).ravel(), minlength=4).min() > 64 * 128 / 4 * 0.9  # uniform
        prod = direct_product(reset_monoid(3), alternating_group(5))
        state = np.full(64, prod.identity)
        for t in range(128):
            state = prod.table[state, b.inputs[:, t]]
            assert np.array_equal(b.targets[:, t], state)
    with pytest.raises(ValueError, match="p"):
        build_task("monoid_mixture", p=1.5).generate(np.random.default_rng(0), 1, 4)


def test_parity():
    b = build_task("parity", targets="all").generate(np.random.default_rng(3), 16, 33)
    assert set(np.unique(b.inputs)) <= {0, 1}
    for r in range(16):
        for t in range(33):
            assert b.targets[r, t] == sum(b.inputs[r, : t + 1]) % 2
    b = build_task("parity").generate(np.random.default_rng(3), 16, 33)
    assert b.mask[:, :-1].sum() == 0 and b.mask[:, -1].all()


def _python_value(vocab, toks):
    s = vocab.decode(toks).replace("=", "")
    return eval(s, {"__builtins__": {}}) % vocab.modulus  # python precedence == the task's; ints only


@pytest.mark.parametrize("brackets", [False, True])
def test_mod_arithmetic_answers(brackets):
    task = build_task("mod_arithmetic", brackets=brackets)
    assert task.vocab_size == (12 if brackets else 10) and task.chance == 0.2
    vocab = formal.ArithmeticVocab(5, brackets)
    rng = np.random.default_rng(4)
    for length in (1, 2, 3, 4, 5, 7, 12, 40, 101):
        b = task.generate(rng, 32, length)
        n = length if brackets else (length if length % 2 else length - 1)
        assert b.inputs.shape == (32, n + 1) and (b.inputs[:, -1] == vocab.equals).all()
        assert b.inputs.max() < task.vocab_size and b.mask.sum() == 32 and b.mask[:, -1].all()
        for r in range(32):
            toks = b.inputs[r, :-1]
            ans = b.targets[r, -1]
            assert 0 <= ans < 5
            assert ans == _python_value(vocab, toks)
            ref = formal.evaluate_brackets(toks, vocab) if brackets else formal.evaluate_flat(toks, vocab)
            assert ans == ref


def test_mod_arithmetic_paper_examples():
    flat = formal.ArithmeticVocab(5, brackets=False)
    # DeltaProduct paper: 2+1-2*2-3 = 1 (precedence), Deletang et al.: 1-1-1 = 4, 0*1+4*3-2 = 0
    assert formal.evaluate_flat([2, 5, 1, 6, 2, 7, 2, 6, 3], flat) == 1
    assert formal.evaluate_flat([1, 6, 1, 6, 1], flat) == 4
    assert formal.evaluate_flat([0, 7, 1, 5, 4, 7, 3, 6, 2], flat) == 0
    br = formal.ArithmeticVocab(5, brackets=True)
    lp, rp, pl, mi = br.lpar, br.rpar, br.plus, br.minus
    # ((1-(-2))+((4)+3)) = 0
    toks = [lp, lp, 1, mi, lp, mi, 2, rp, rp, pl, lp, lp, 4, rp, pl, 3, rp, rp]
    assert br.decode(toks) == "((1-(-2))+((4)+3))" and formal.evaluate_brackets(toks, br) == 0


def test_copying_layout():
    b = build_task("copy").generate(np.random.default_rng(5), 4, 7)
    assert b.inputs.shape == (4, 2 * 7 + 2) and b.inputs.max() < 29
    for r in range(4):
        x = b.inputs[r, 1:8]
        assert b.inputs[r, 0] == copying.BOS and b.inputs[r, 8] == copying.COPY
        assert np.array_equal(b.targets[r, 8:15], x) and b.targets[r, 15] == copying.EOS
        assert (b.targets[r, :8] == IGNORE).all()
        assert np.array_equal(b.inputs[r, 9:], x)  # teacher forcing


def test_mad_tasks():
    rng = np.random.default_rng(6)
    b = mad.compression(rng, 4, 64, vocab_size=16)
    assert (b.inputs[:, -1] == 15).all() and b.inputs[:, :-1].max() < 15 and np.array_equal(b.inputs, b.targets)

    b = mad.selective_copying(rng, 4, 64, vocab_size=16, num_tokens_to_copy=16)
    for r in range(4):
        data = b.inputs[r, :47][b.inputs[r, :47] != 14]
        assert len(data) == 16 and data.max() < 14 and b.inputs[r, 47] == 15
        assert (b.inputs[r, 48:] == 14).all() and np.array_equal(b.targets[r, 48:], data)
        assert b.mask[r].sum() == 16

    b = mad.associative_recall(rng, 8, 64, vocab_size=16)
    assert b.inputs.shape == (8, 64)
    for r in range(8):
        seen = {}
        for t in range(0, 64, 2):
            k, v = b.inputs[r, t], b.inputs[r, t + 1]
            assert k < 8 <= v < 16
            assert seen.setdefault(k, v) == v  # one value per key in a sequence
        # scored positions: the key is at t, its value (target at t) was shown earlier
        for t in range(64):
            if b.mask[r, t]:
                assert t % 2 == 0 and b.targets[r, t] == seen[b.inputs[r, t]]
                assert b.inputs[r, t] in b.inputs[r, 0:t:2]
            elif t % 2 == 0 and t < 64 and b.inputs[r, t] in b.inputs[r, 0:t:2]:
                raise AssertionError("a recall was not scored")
        assert (b.targets[r, :-1] == b.inputs[r, 1:]).all()
    with pytest.raises(ValueError, match="num_tokens_to_copy"):
        mad.selective_copying(rng, 1, 20, num_tokens_to_copy=16)


@pytest.mark.parametrize("name", ["word_problem", "monoid_mixture", "parity", "mod_arithmetic", "copy",
                                  "mad_compression", "mad_selective_copying", "mad_associative_recall"])
def test_deterministic_by_seed_and_in_range(name):
    params = {"brackets": True} if name == "mod_arithmetic" else {}
    task = build_task(name, **params)
    lo, hi = task.train_lengths
    length = min(hi, 48)
    a = task.generate(np.random.default_rng(11), 5, length)
    b = task.generate(np.random.default_rng(11), 5, length)
    c = task.generate(np.random.default_rng(12), 5, length)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)
    assert not np.array_equal(a.inputs, c.inputs)
    assert a.inputs.dtype == np.int64 and a.targets.dtype == np.int64 and a.mask.dtype == bool
    assert 0 <= a.inputs.min() and a.inputs.max() < task.vocab_size
    t = a.targets[a.targets != IGNORE]
    assert 0 <= t.min() and t.max() < task.vocab_size
    assert a.mask.any() and not (a.mask & (a.targets == IGNORE)).any()


def test_build_task_errors():
    with pytest.raises(ValueError, match="unknown task"):
        build_task("nope")
    with pytest.raises(ValueError, match="does not take"):
        build_task("parity", group="S5")
    with pytest.raises(ValueError, match="unknown group"):
        build_task("word_problem", group="Q8")
    assert task_parameters("word_problem") == {"group": "S5", "targets": "all"}


def test_metrics():
    pred = np.array([[1, 2, 3], [1, 0, 3]])
    tgt = np.array([[1, 2, 0], [1, 2, 3]])
    mask = np.array([[True, True, False], [True, True, True]])
    assert token_accuracy(pred, tgt, mask) == pytest.approx(4 / 5)
    assert last_accuracy(pred, tgt, mask) == pytest.approx(1.0)  # row 0 last scored = pos 1, row 1 = pos 2
    assert sequence_accuracy(pred, tgt, mask) == pytest.approx(0.5)
    assert np.allclose(per_position_accuracy(pred, tgt, mask), [1.0, 0.5, 1.0])
    assert scaled_accuracy(0.2, 0.2) == 0.0 and scaled_accuracy(1.0, 0.2) == 1.0
    assert scaled_accuracy(0.6, 0.2) == pytest.approx(0.5)
