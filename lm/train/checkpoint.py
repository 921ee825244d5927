"""Checkpoint folders: atomic publication, a manifest that proves completeness, `latest`, keep-last-K.

Layout of a run:  RUN/checkpoints/step_00001000/{manifest.json, client.json, client_rank*.pt,
config.json, engine files (DeepSpeed's mp_rank_*/zero_pp_rank_* or model_optim.pt)}, RUN/checkpoints/latest.

Saving (every rank writes its part into RUN/checkpoints/.tmp/<tag>; then rank 0):
write_manifest (every file with its size) -> rename .tmp/<tag> to <tag> -> write `latest` (atomic
replace) -> prune to the last K. A crash at any point leaves the previous checkpoint and `latest`
intact; a folder without a valid manifest is never resumed from (`verify` says why).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
LATEST = "latest"
TMP = ".tmp"
_TAG = re.compile(r"^step_(\d{8,})$")


def tag_of(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def staging_dir(root: Path, tag: str) -> Path:
    return root / TMP / tag


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(ckpt: Path, meta: dict) -> None:
    files = {}
    for p in sorted(ckpt.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(ckpt))] = p.stat().st_size
    _write_atomic(ckpt / MANIFEST, json.dumps({"files": files, **meta}, indent=1))


def verify(ckpt: str | os.PathLike) -> dict:
    """The manifest of a complete checkpoint; ValueError naming the problem otherwise."""
    ckpt = Path(ckpt)
    hint = ("resume from an earlier checkpoint with checkpoint.resume=<path to step_...> "
            "or remove this folder (nothing else is touched)")
    if not ckpt.is_dir():
        raise ValueError(f"checkpoint {ckpt} does not exist")
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        raise ValueError(f"checkpoint {ckpt} is partial: it has no {MANIFEST} (its save did not finish); {hint}")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as err:
        raise ValueError(f"checkpoint {ckpt} is corrupt: {MANIFEST} is unreadable ({err}); {hint}") from None
    for rel, size in files.items():
        p = ckpt / rel
        if not p.is_file():
            raise ValueError(f"checkpoint {ckpt} is corrupt: {rel} is missing; {hint}")
        if p.stat().st_size != size:
            raise ValueError(f"checkpoint {ckpt} is corrupt: {rel} has {p.stat().st_size} bytes, "
                             f"the manifest says {size}; {hint}")
    return manifest


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the published checkpoint folders, oldest first (complete or not)."""
    if not root.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _TAG.match(p.name))]
    return sorted(out)


def publish(root: Path, tag: str, keep_last: int) -> Path:
    """Rank 0, after every rank wrote into staging_dir(root, tag) and the manifest is written."""
    src, dst = staging_dir(root, tag), root / tag
    if dst.exists():  # a re-save of the same step (e.g. the final step was also a periodic one)
        shutil.rmtree(dst)
    os.replace(src, dst)
    _write_atomic(root / LATEST, tag + "\n")
    for _, old in list_checkpoints(root)[:-keep_last]:
        if old != dst:
            shutil.rmtree(old, ignore_errors=True)
    return dst


def resolve(path_or_run: str | os.PathLike) -> Path:
    """A checkpoint folder from itself, a run folder or a checkpoints folder (via `latest`), verified."""
    p = Path(path_or_run)
    if (p / MANIFEST).is_file() or _TAG.match(p.name):
        verify(p)
        return p
    root = p if (p / LATEST).is_file() or p.name == "checkpoints" else checkpoints_root(p)
    latest = root / LATEST
    if not latest.is_file():
        have = [str(c) for _, c in list_checkpoints(root)]
        raise ValueError(f"no checkpoint found in {p}: {latest} does not exist"
                         + (f"; checkpoint folders present: {have}" if have else
                            "; train first (or without checkpoint.resume)"))
    tag = latest.read_text().strip()
    ckpt = root / tag
    try:
        verify(ckpt)
    except ValueError as err:
        have = [str(c) for _, c in list_checkpoints(root) if c != ckpt]
        raise ValueError(f"{latest} points to {tag}, which is not usable: {err}"
                         + (f". Other checkpoints: {have}" if have else "")) from None
    return ckpt
