"""Task registry: a name and parameters -> a `Task` (generator, vocabulary, metric, default lengths).

    task = build_task("word_problem", group="S5")
    batch = task.generate(np.random.default_rng(0), batch_size=32, length=16)

Every generator is a pure function of its parameters and the numpy Generator it is handed, so equal
seeds give equal batches.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable

from . import copying as _copying
from . import formal, mad, word_problems
from .batch import Batch
from .groups import direct_product, monoid_by_name


@dataclass(frozen=True)
class Task:
    name: str
    vocab_size: int
    generate: Callable[..., Batch] = field(repr=False)  # (rng, batch_size, length) -> Batch
    metric: str  # the headline metric: token_accuracy | last_accuracy | sequence_accuracy | scaled_accuracy
    chance: float | None = None  # random-guess accuracy (for scaled accuracy)
    head: str = "lm"  # "lm": logits per position; "compression": decode every position from the last state
    train_lengths: tuple[int, int] = (16, 16)  # inclusive range sampled per training batch
    eval_lengths: tuple[int, ...] = (16,)
    params: dict = field(default_factory=dict)


def _word_problem(group: str = "S5", targets: str = "all") -> Task:
    m = monoid_by_name(group)
    return Task(name=f"word_problem_{m.name}", vocab_size=m.order,
                generate=functools.partial(word_problems.word_problem, monoid=m, targets=targets),
                metric="last_accuracy", chance=1.0 / m.order, train_lengths=(16, 16),
                eval_lengths=(2, 4, 8, 16, 32, 64), params=dict(group=group, targets=targets))


def _monoid_mixture(p: float = 0.1, group: str = "A5", aperiodic: str = "U3", targets: str = "all") -> Task:
    g, a = monoid_by_name(group), monoid_by_name(aperiodic)
    prod = direct_product(a, g)
    return Task(name=f"mixture_{a.name}x{g.name}_p{p}", vocab_size=prod.order,
                generate=functools.partial(word_problems.mixture_word_problem, aperiodic=a, group=g, p=p,
                                           targets=targets, product=prod),
                metric="token_accuracy", chance=None, train_lengths=(256, 256), eval_lengths=(256,),
                params=dict(p=p, group=group, aperiodic=aperiodic, targets=targets))


def _parity(targets: str = "last") -> Task:
    return Task(name="parity", vocab_size=2, generate=functools.partial(formal.parity, targets=targets),
                metric="scaled_accuracy", chance=0.5, train_lengths=(3, 40),
                eval_lengths=(40, 64, 128, 256), params=dict(targets=targets))


def _mod_arithmetic(modulus: int = 5, brackets: bool = False) -> Task:
    v = formal.ArithmeticVocab(modulus, brackets)
    fn = formal.mod_arithmetic_brackets if brackets else formal.mod_arithmetic
    return Task(name="mod_arithmetic_brackets" if brackets else "mod_arithmetic", vocab_size=v.size,
                generate=functools.partial(fn, modulus=modulus), metric="scaled_accuracy",
                chance=1.0 / modulus, train_lengths=(3, 40), eval_lengths=(40, 64, 128, 256),
                params=dict(modulus=modulus, brackets=brackets))


def _copy() -> Task:
    return Task(name="copy", vocab_size=_copying.VOCAB_SIZE, generate=_copying.copying,
                metric="token_accuracy", chance=1.0 / _copying.N_LETTERS, train_lengths=(5, 50),
                eval_lengths=(5, 25, 50, 75, 100))


def _mad_compression(vocab_size: int = 16) -> Task:
    return Task(name="mad_compression", vocab_size=vocab_size,
                generate=functools.partial(mad.compression, vocab_size=vocab_size), metric="token_accuracy",
                head="compression", train_lengths=(64, 64), eval_lengths=(64,),
                params=dict(vocab_size=vocab_size))


def _mad_selective_copying(vocab_size: int = 16, num_tokens_to_copy: int = 16) -> Task:
    return Task(name="mad_selective_copying", vocab_size=vocab_size,
                generate=functools.partial(mad.selective_copying, vocab_size=vocab_size,
                                           num_tokens_to_copy=num_tokens_to_copy),
                metric="token_accuracy", train_lengths=(64, 64), eval_lengths=(64,),
                params=dict(vocab_size=vocab_size, num_tokens_to_copy=num_tokens_to_copy))


def _mad_associative_recall(vocab_size: int = 16) -> Task:
    return Task(name="mad_associative_recall", vocab_size=vocab_size,
                generate=functools.partial(mad.associative_recall, vocab_size=vocab_size),
                metric="token_accuracy", train_lengths=(64, 64), eval_lengths=(64,),
                params=dict(vocab_size=vocab_size))


TASKS: dict[str, Callable[..., Task]] = {
    "word_problem": _word_problem,
    "monoid_mixture": _monoid_mixture,
    "parity": _parity,
    "mod_arithmetic": _mod_arithmetic,
    "copy": _copy,
    "mad_compression": _mad_compression,
    "mad_selective_copying": _mad_selective_copying,
    "mad_associative_recall": _mad_associative_recall,
}


def task_parameters(name: str) -> dict:
    """The parameters (and defaults) a task accepts."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    return {k: p.default for k, p in inspect.signature(TASKS[name]).parameters.items()}


def build_task(name: str, **params) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}")
    allowed = task_parameters(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"task {name!r} does not take {unknown}; it takes {sorted(allowed)}")
    return TASKS[name](**params)
