"""`lm <command> ...`: one entry point; each command lives in its own module and is imported lazily."""
from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {
    "train": ("lm.train.cli:main", "pretrain a model (DeepSpeed or single process)"),
    "export": ("lm.train.export:main", "export a training checkpoint to a Hugging Face model folder"),
    "plot": ("lm.train.plot:main", "draw a run's training curves to PNG"),
    "prepare-data": ("lm.data.prepare:main", "tokenize a corpus into training shards"),
    "eval": ("lm.eval.harness:main", "lm-eval-harness on a checkpoint"),
    "ppl": ("lm.eval.ppl:main", "held-out perplexity by context length"),
    "duality": ("lm.eval.duality:main", "sequential vs simultaneous agreement of an implicit model"),
    "generate": ("lm.eval.generate:main", "generate text from a checkpoint"),
    "synth": ("lm.train.synth:main", "train/evaluate on a synthetic state-tracking task"),
    "bench": ("lm.benchmarks:main", "kernel and training benchmarks (GPU)"),
    "info": ("lm.models.presets:info_main", "parameter count and training FLOPs of a preset"),
    "convert": ("lm.convert:main", "checkpoints of other projects in and out (--from fla / --to fla)"),
    "selftest": ("lm.selftest:main", "check this installation: every family, a training step, lm-eval"),
}


def _usage() -> str:
    lines = ["usage: lm <command> [args]", "", "commands:"]
    lines += [f"  {name:13s} {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lm: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    mod, fn = target.split(":")
    # CPU runs: OpenMP threads that sleep instead of spinning while they wait (read when torch starts its OpenMP
    # runtime, so before the command's module imports torch). Measured on 2 cores with the default job: 46 s vs
    # 43 s when idle, 35 s vs 51 s when another process competes for the cores.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        module = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name and (e.name == mod or mod.startswith(e.name + ".")):
            print(f"lm {name}: this command is not available in this build ({mod} missing)", file=sys.stderr)
            return 2
        raise
    try:
        return int(getattr(module, fn)(rest) or 0)
    except ValueError as err:  # the project's bad-input error: its message says what was wrong and what to do
        print(f"lm {name}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
