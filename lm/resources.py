"""Files that ship inside the package (found with importlib.resources, so a wheel works like the clone):
model presets, training / DeepSpeed / synthetic recipes, the default tokenizer.

    config_path("configs/train/default.yaml")   an existing file, else the packaged recipe of that name
    config_path("default", kind="train")        a packaged recipe by name (".yaml" optional)
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def package_dir(*parts: str) -> Path:
    """A folder or file inside the installed `lm` package (wheels install unpacked, so this is a Path)."""
    return Path(str(files("lm").joinpath(*parts)))


def configs_dir(kind: str) -> Path:
    return package_dir("configs", kind)


def list_configs(kind: str) -> list[str]:
    return sorted(p.stem for p in configs_dir(kind).iterdir() if p.suffix in (".yaml", ".json"))


def config_path(name_or_path: str | Path, kind: str) -> Path:
    """An existing file as given; else the packaged config `configs/<kind>/<name>` (a leading `configs/` or
    `configs/<kind>/` and the extension are optional), so `lm train configs/train/default.yaml` works from
    any folder. Raises FileNotFoundError naming what exists."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    parts = list(Path(str(name_or_path)).parts)
    if parts[:1] == ["configs"]:
        parts = parts[1:]
    if parts[:1] == [kind]:
        parts = parts[1:]
    if parts:
        d = configs_dir(kind)
        for cand in (d.joinpath(*parts), *(d.joinpath(*parts[:-1], parts[-1] + ext) for ext in (".yaml", ".json"))):
            if cand.is_file():
                return cand
    raise FileNotFoundError(
        f"{str(name_or_path)!r} not found: neither a file nor a packaged {kind} config (packaged: {', '.join(list_configs(kind))})"
    )
