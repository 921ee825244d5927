"""`lm bench NAME [args]`: run scripts/bench_NAME.py (kernel and training benchmarks; GPU for timings)."""
from __future__ import annotations

import runpy
import sys

from .models.presets import repo_root


def main(argv: list[str]) -> int:
    scripts = sorted(p.stem[len("bench_"):] for p in (repo_root() / "scripts").glob("bench_*.py"))
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lm bench NAME [args]\n\nbenchmarks: " + ", ".join(scripts))
        return 0
    name = argv[0]
    if name not in scripts:
        print(f"lm bench: unknown benchmark {name!r}; available: {', '.join(scripts)}", file=sys.stderr)
        return 2
    sys.argv = [f"bench_{name}.py", *argv[1:]]
    runpy.run_path(str(repo_root() / "scripts" / f"bench_{name}.py"), run_name="__main__")
    return 0
