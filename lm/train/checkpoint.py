"""Checkpoints: atomic folders with a manifest of content hashes, `latest`, keep-last-K, save and resume.

Layout of a run:  RUN/checkpoints/step_00001000/{manifest.json, client.json, client_rank*.pt,
config.json, engine files (DeepSpeed's mp_rank_*/zero_pp_rank_* or model_optim.pt)}, RUN/checkpoints/latest.

Saving (every rank writes its part into RUN/checkpoints/.tmp/<tag>; then rank 0):
write_manifest (every file with its size and sha256) -> rename .tmp/<tag> to <tag> -> write `latest`
(atomic replace) -> prune to the last K. A crash at any point leaves the previous checkpoint and `latest`
intact; a folder without a valid manifest is never resumed from (`verify` says why).

The sha256 of a file is computed from its bytes as they are written (HashingWriter under torch.save, also
inside DeepSpeed's save), so saving never reads a multi-GB file back. Resuming re-reads and checks every
file: a file changed in place (same size, other bytes) is named, with the earlier checkpoints to use.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

MANIFEST = "manifest.json"
LATEST = "latest"
TMP = ".tmp"
_TAG = re.compile(r"^step_(\d{8,})$")
_CHUNK = 1 << 24


def tag_of(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def staging_dir(root: Path, tag: str) -> Path:
    return root / TMP / tag


# ------------------------------------------------------------------------------------- content hashes


class HashingWriter:
    """A binary file opened for writing that hashes what passes through it (torch.save takes it as a file).
    On close the (sha256, bytes) pair is recorded in `hashes[path]`."""

    def __init__(self, path: Path, hashes: dict):
        self.path, self.hashes = Path(path), hashes
        self._f = open(self.path, "wb")
        self._h = hashlib.sha256()
        self._n = 0

    def write(self, data) -> int:
        self._h.update(data)
        n = self._f.write(data)
        self._n += n
        return n

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self.hashes[str(self.path.resolve())] = (self._h.hexdigest(), self._n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_records(folder: Path, hashes: dict | None = None, skip: tuple[str, ...] = (MANIFEST,)) -> dict:
    """{relative path: {"bytes", "sha256"}} of every file under `folder`: the hash recorded while writing when
    there is one for that path and size, else read from the file (small files DeepSpeed copies in)."""
    hashes = hashes or {}
    out = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or p.name in skip:
            continue
        size = p.stat().st_size
        rec = hashes.get(str(p.resolve()))
        digest = rec[0] if rec is not None and rec[1] == size else sha256_of(p)
        out[str(p.relative_to(folder))] = {"bytes": size, "sha256": digest}
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(folder: Path, meta: dict, hashes: dict | None = None) -> None:
    _write_atomic(folder / MANIFEST, json.dumps({"files": file_records(folder, hashes), **meta}, indent=1))


def check_files(folder: Path, files: dict, what: str, hint: str) -> None:
    """Sizes, then content hashes, of the manifest's files; ValueError naming the first that differs."""
    for rel, rec in files.items():
        size, digest = (rec, None) if isinstance(rec, int) else (rec["bytes"], rec.get("sha256"))
        p = folder / rel
        if not p.is_file():
            raise ValueError(f"{what} {folder} is corrupt: {rel} is missing; {hint}")
        if p.stat().st_size != size:
            raise ValueError(f"{what} {folder} is corrupt: {rel} has {p.stat().st_size} bytes, "
                             f"the manifest says {size}; {hint}")
    for rel, rec in files.items():
        digest = None if isinstance(rec, int) else rec.get("sha256")
        if digest is not None and sha256_of(folder / rel) != digest:
            raise ValueError(f"{what} {folder} is corrupt: {rel} has other bytes than were written (its sha256 "
                             f"differs from the manifest's; the file was changed in place after the save); {hint}")


def verify(ckpt: str | os.PathLike, *, hashes: bool = True) -> dict:
    """The manifest of a complete checkpoint whose files match it; ValueError naming the problem otherwise."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise ValueError(f"checkpoint {ckpt} does not exist")
    m = _TAG.match(ckpt.name)
    earlier = [str(c) for s, c in list_checkpoints(ckpt.parent) if m and s < int(m.group(1))]
    hint = ("resume from an earlier checkpoint with checkpoint.resume=<path to step_...> "
            + (f"(earlier checkpoints: {', '.join(earlier)}) " if earlier else "(there is no earlier one) ")
            + "or remove this folder (nothing else is touched)")
    mpath = ckpt / MANIFEST
    if not mpath.is_file():
        raise ValueError(f"checkpoint {ckpt} is partial: it has no {MANIFEST} (its save did not finish); {hint}")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as err:
        raise ValueError(f"checkpoint {ckpt} is corrupt: {MANIFEST} is unreadable ({err}); {hint}") from None
    if not hashes:
        files = {k: (v if isinstance(v, int) else v["bytes"]) for k, v in files.items()}
    check_files(ckpt, files, "checkpoint", hint)
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


def latest_tag(run_dir: str | os.PathLike) -> str | None:
    latest = checkpoints_root(run_dir) / LATEST
    return latest.read_text().strip() if latest.is_file() else None


def resolve(path_or_run: str | os.PathLike, *, hashes: bool = True) -> Path:
    """A checkpoint folder from itself, a run folder or a checkpoints folder (via `latest`), verified."""
    p = Path(path_or_run)
    if (p / MANIFEST).is_file() or _TAG.match(p.name):
        verify(p, hashes=hashes)
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
        verify(ckpt, hashes=hashes)
    except ValueError as err:
        raise ValueError(f"{latest} points to {tag}, which is not usable: {err}") from None
    return ckpt


def read_client(ckpt: Path) -> dict:
    return json.loads((ckpt / "client.json").read_text())


# ---------------------------------------------------------------------------------------- save / resume


def _rng_state() -> dict:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save(root: Path, step: int, *, engine, reader, dist, keep_last: int, client: dict) -> Path:
    """Write checkpoint `step` (every rank its part, hashed as written), publish it on rank 0; returns its path.
    `client` (rank 0's training state: step, phase, config, ...) goes to client.json."""
    tag = tag_of(step)
    stage = staging_dir(root, tag)
    if dist.is_main:
        shutil.rmtree(stage, ignore_errors=True)
        stage.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    hashes: dict = {}

    def writer(path):
        return HashingWriter(path, hashes)

    engine.save(stage.parent, tag, writer)
    stage.mkdir(parents=True, exist_ok=True)
    with writer(stage / f"client_rank{dist.rank}.pt") as f:
        torch.save({"rng": _rng_state(), "data": reader.state_dict()}, f)
    every = dist.gather(hashes)
    if dist.is_main:
        merged = {k: v for h in every for k, v in h.items()}
        (stage / "client.json").write_text(json.dumps(client, indent=1))
        engine.module.solver_config().to_json_file(str(stage / "config.json"))  # the phase's solver settings
        write_manifest(stage, {"step": step, "engine": dist.engine, "world_size": dist.world}, merged)
        publish(root, tag, keep_last)
    dist.barrier()
    return root / tag


def check_resumable(ckpt: Path, dist) -> dict:
    """The checkpoint's client.json when this run's engine can load it; ValueError otherwise. Another number of
    ranks is fine (lm.train.resume: ZeRO's partitions are re-split through DeepSpeed's universal checkpoint)."""
    client = read_client(ckpt)
    if client["engine"] == "torch" and dist.world > 1:
        raise ValueError(f"checkpoint.resume: {ckpt} was written by the plain PyTorch engine, which runs one process; "
                         f"this run has {dist.world} ranks. Resume it in one process, or go on at {dist.world} ranks "
                         f"from its weights: `lm export {ckpt} --output DIR`, then model.init_from=DIR in another "
                         "run_dir (the optimizer state and the schedule start afresh)")
    if client["engine"] != dist.engine:
        raise ValueError(f"checkpoint.resume: {ckpt} was written by the {client['engine']} engine, this run uses "
                         f"{dist.engine}; set train.engine={client['engine']}")
    return client


def reshards(ckpt: Path, client: dict, dist) -> bool:
    """Whether resuming `ckpt` in this run re-splits its ZeRO optimizer partitions (another number of ranks)."""
    from .resume import partitioned

    return client["world_size"] != dist.world and partitioned(ckpt)


def _unreadable(ckpt: Path, err: Exception) -> ValueError:
    return ValueError(f"checkpoint {ckpt} could not be loaded ({type(err).__name__}: {err}); it may be corrupt: "
                      "resume from an earlier one with checkpoint.resume=<path>")


def load(ckpt: Path, *, engine, reader, dist) -> dict:
    """Restore engine (model, optimizer), data position and RNG state from a verified checkpoint; its client.json.
    At another number of ranks the ZeRO partitions go through DeepSpeed's universal checkpoint, written by rank 0
    into the staging area and removed once every rank has loaded it (the engine was built for it: build_engine's
    `universal`)."""
    from . import resume

    client = check_resumable(ckpt, dist)
    saved_world = int(client["world_size"])
    universal = None
    if reshards(ckpt, client, dist):
        universal = resume.universal_dir(ckpt.parent, ckpt.name)
        dist.on_main(lambda: str(resume.to_universal(ckpt, universal)))
    try:
        engine.load(ckpt, universal=universal)
        own = ckpt / f"client_rank{dist.rank % saved_world}.pt"
        rank_state = torch.load(own, weights_only=False)
        if dist.rank >= saved_world:  # the data position is global: rank 0's (resume.data_state maps it)
            rank_state["data"] = torch.load(ckpt / "client_rank0.pt", weights_only=False)["data"]
    except ValueError:
        raise
    except RuntimeError as err:
        if "state_dict" not in str(err):
            raise _unreadable(ckpt, err) from None
        # the files were read (their hashes matched the manifest): the weights are of another model
        detail = "; ".join(line.strip() for line in str(err).splitlines()[1:4])
        raise ValueError(f"checkpoint.resume: the weights in {ckpt} do not fit this config's model ({detail} ...). "
                         f"The checkpoint's model is described by {ckpt / 'config.json'}: resume with the run's "
                         "model settings, or start a new run in another run_dir. The checkpoint is intact; nothing "
                         "was changed.") from None
    except Exception as err:  # noqa: BLE001 - a damaged file: say which checkpoint
        raise _unreadable(ckpt, err) from None
    finally:
        if universal is not None:
            dist.barrier()
            if dist.is_main:
                shutil.rmtree(universal.parent, ignore_errors=True)
    reader.load_state_dict(resume.data_state(rank_state["data"], saved_world, dist.world))
    _set_rng_state(rank_state["rng"])
    return client
