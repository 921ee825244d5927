"""The implicit models' solver curriculum: phases by fraction of the training tokens (paper 003, sec. 3).

    phases = curriculum_phases("paper", "lm_mamba2")
    #  bounded: until 0.8, (4+1), no tolerance       free: until 1.0, (24+4), tol 0.05 (Llama: 32+4)
    i = phase_index(phases, tokens_seen / total_tokens)
    model.set_solver(phases[i].implicit)    # the model runs with them (its config.implicit: the saved default)

A phase is {name, until, implicit}: it runs while the fraction of training tokens already seen is
< `until`; `implicit` holds the phase's solver settings (lm.models.config.ImplicitSettings), validated
once when the training config is read.
"""
from __future__ import annotations

import dataclasses

from lm.models.config import ImplicitSettings

PAPER_FREE = {
    "lm_mamba2": ImplicitSettings(max_iter=24, tol=0.05, phantom_steps=4),
    "lm_llama": ImplicitSettings(max_iter=32, tol=0.05, phantom_steps=4),
}
PAPER_BOUNDED = ImplicitSettings(max_iter=4, tol=None, phantom_steps=1)
PAPER_SWITCH = 0.8


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    until: float
    implicit: ImplicitSettings

    def describe(self) -> str:
        s = self.implicit
        tol = "no tol" if s.tol is None else f"tol {s.tol:g}"
        return f"{self.name} ({s.max_iter}+{s.phantom_steps}, {tol}) until {self.until:.0%} of tokens"


def paper_curriculum(model_type: str) -> list[Phase]:
    """(4+1) bounded for 80% of the tokens, then free: (24+4) Mamba2 / (32+4) Llama, tol 0.05."""
    if model_type not in PAPER_FREE:
        raise ValueError(
            f"curriculum: 'paper' is defined for {sorted(PAPER_FREE)} (paper 003), not {model_type}; give the "
            "phases explicitly, e.g. [{name: bounded, until: 0.8, implicit: {max_iter: 4, phantom_steps: 1}}, "
            "{name: free, until: 1.0, implicit: {max_iter: 24, tol: 0.05, phantom_steps: 4}}]")
    return [Phase("bounded", PAPER_SWITCH, PAPER_BOUNDED), Phase("free", 1.0, PAPER_FREE[model_type])]


def parse_curriculum(value):
    """The config's curriculum: None, "paper" (resolved per model type by curriculum_phases), or a list of
    {name, until, implicit} with increasing `until`, the last = 1.0 -> a list of Phase."""
    if value is None or value == "paper":
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"curriculum: expected null, 'paper' or a non-empty list of phases, got {value!r}")
    phases, prev = [], 0.0
    for i, item in enumerate(value):
        where = f"curriculum[{i}]"
        if isinstance(item, Phase):
            item = {"name": item.name, "until": item.until, "implicit": item.implicit}
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected a mapping {{name, until, implicit}}, got {item!r}")
        unknown = sorted(set(item) - {"name", "until", "implicit"})
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: ['implicit', 'name', 'until']")
        until = item.get("until")
        if not isinstance(until, (int, float)) or isinstance(until, bool) or not (prev < until <= 1.0):
            raise ValueError(f"{where}.until: must be a fraction in ({prev}, 1] and increase (got {until!r})")
        if not isinstance(item.get("implicit"), (dict, ImplicitSettings)):
            raise ValueError(f"{where}.implicit: expected a mapping of solver settings (got {item.get('implicit')!r})")
        try:
            settings = ImplicitSettings.from_value(item["implicit"])
        except ValueError as err:
            raise ValueError(f"{where}.{err}") from None
        phases.append(Phase(str(item.get("name", f"phase{i}")), float(until), settings))
        prev = until
    if phases[-1].until != 1.0:
        raise ValueError(f"curriculum[{len(phases) - 1}].until: the last phase must end at 1.0 (got {phases[-1].until})")
    return phases


def curriculum_phases(value, model_type: str) -> list[Phase] | None:
    """The phases of a parsed curriculum for a model type ("paper" depends on it)."""
    if value == "paper":
        return paper_curriculum(model_type)
    return parse_curriculum(value)  # Phases as they are; dicts of a config built in code are read here


def phase_index(phases: list[Phase], fraction: float) -> int:
    """The phase that runs when `fraction` of the training tokens has been seen."""
    for i, p in enumerate(phases):
        if fraction < p.until:
            return i
    return len(phases) - 1


def phase_start(phases: list[Phase], index: int) -> float:
    return 0.0 if index == 0 else phases[index - 1].until


class Curriculum:
    """A run's place in its phases: at each step the phase for the fraction of the steps done is set on the model
    (model.set_solver), with a "phase_switch" event (not for the run's first phase) and a console line. Without
    phases (an explicit model, or fixed model.implicit settings) it does nothing."""

    def __init__(self, phases: list[Phase] | None, model, *, total_steps: int, tokens_per_step: int, logger, console):
        self.phases, self.model = phases or [], model
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.logger, self.console = logger, console
        self.index = -1

    @property
    def phase(self) -> str | None:
        return self.phases[self.index].name if self.phases else None

    def resume(self, index: int | None) -> None:
        """The phase a checkpoint was in (client.json phase_index)."""
        if self.phases and index is not None and index >= 0:
            self.model.set_solver(self.phases[index].implicit)
            self.index = index

    def enter(self, step: int) -> None:
        """Before step `step` + 1: switch to its phase where that is another."""
        if not self.phases:
            return
        i = phase_index(self.phases, step / self.total_steps)
        if i == self.index:
            return
        p = self.phases[i]
        self.model.set_solver(p.implicit)
        if self.index >= 0:
            self.logger.log({"event": "phase_switch", "step": step, "tokens": step * self.tokens_per_step,
                             "phase": p.name, "implicit": p.implicit.to_dict()})
        self.console.write(f"step {step}: curriculum phase {p.describe()}")
        self.index = i

    def client(self) -> dict:
        """The checkpoint's record of the phase."""
        return {"phase_index": self.index if self.phases else None, "phase": self.phase}
