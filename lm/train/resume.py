"""Resuming a run: which settings a resume may change, and a checkpoint loaded at another number of ranks.

The config. Every checkpoint holds the config it was trained with (client.json "train_config"). A resume
compares it with the new config before anything is built or written:
- what the weights, the optimizer state and the data position mean may not change (FIXED: the model, its solver
  settings and curriculum, the data and tokenizer, the sequence length, the seed, the precision and ZeRO stage,
  AdamW's betas / eps / weight decay): such a difference is refused with the keys named. A key changed on purpose
  is accepted when `checkpoint.allow_change` (`lm train --allow-change KEY`) lists it (or its section);
- the global batch never changes (NEVER): steps, the schedule and the data position count global batches;
- everything else may change and is reported: the length of the run (train.steps / tokens, the schedule's end),
  the learning rate and clipping, logging, evaluation and checkpoint cadence, the micro-batch size and the number
  of ranks (with the same global batch), threads, compilation.

Another number of ranks (same global batch). The data position is global: the shard and synthetic readers count
the windows handed out to all ranks together, and a global batch is the same run of windows whatever the number
of ranks (rank r's micro-batch m of a step takes windows m * ranks * b + r * b ...: the ranks split the step's
windows, the step's set of windows is the same), so every rank restores the position of rank 0's state. The task
reader counts batches per rank (batch i of rank r is number i * ranks + r): its count is scaled to the new number
of ranks. ZeRO-1/2 partitions the optimizer state (and the fp32 master weights) over the ranks that wrote them:
rank 0 converts the checkpoint to DeepSpeed's universal checkpoint (one folder per parameter with its fp32 value
and Adam moments; `deepspeed.checkpoint.ds_to_universal`) in the checkpoints' staging folder, every rank loads its
new partition from it (DeepSpeed's `checkpoint.load_universal`), and the staging copy is removed. The checkpoint
itself is only read. RNG states come from the saved rank r mod (saved ranks).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
from pathlib import Path

from . import checkpoint as ckpt

# dotted keys (or sections) that a resume keeps unless checkpoint.allow_change lists them
FIXED = ("model.preset", "model.overrides", "model.implicit", "curriculum",
         "data.source", "data.path", "data.seq_len", "data.tokenizer", "data.cu_seqlens", "data.synthetic_vocab",
         "task.name", "task.params", "task.lengths", "task.examples",
         "train.seed", "train.precision", "train.zero_stage",
         "optim.betas", "optim.eps", "optim.weight_decay")
NEVER = ("train.global_batch_tokens",)
# not compared: they name where things are, or the resume itself
IGNORED = ("run_dir", "checkpoint.resume", "checkpoint.allow_change", "model.init_from")


def _flat(tree, prefix: str = "") -> dict:
    """{dotted key: value} of a config dict (lists and scalars are values; dicts are descended into)."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def _under(key: str, prefixes) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def config_changes(saved: dict, new: dict) -> list[tuple[str, object, object]]:
    """(key, saved value, new value) of every key whose value differs; keys missing from the saved config (a
    config written before the key existed) count as unchanged."""
    a, b = _flat(json.loads(json.dumps(saved))), _flat(json.loads(json.dumps(new)))
    out = []
    for key in sorted(set(a) | set(b)):
        if _under(key, IGNORED) or key not in a:
            continue
        if a.get(key) != b.get(key):
            out.append((key, a.get(key), b.get(key)))
    return out


def check_config(ckpt_dir: Path, client: dict, cfg) -> list[str]:
    """Refuse a resume whose config differs from the checkpoint's in what may not change (ValueError naming the
    keys, the way to go on and the override); the allowed changes as 'key: old -> new' lines."""
    saved = client.get("train_config")
    if not saved:
        return []
    changes = config_changes(saved, cfg.to_dict())
    allowed = [str(k) for k in (cfg.checkpoint.allow_change or [])]
    never = [c for c in changes if _under(c[0], NEVER)]
    if never:
        k, old, now = never[0]
        raise ValueError(
            f"checkpoint.resume: {ckpt_dir} was trained with {k}={old}, this config has {now}. The steps, the learning "
            "rate schedule and the data position of a run count its global batches, so a run keeps its global batch "
            f"(at any number of ranks: set {k}={old} to resume). To train on with another global batch, start a new "
            f"run from these weights: `lm export {ckpt_dir} --output DIR`, then `lm train ... model.init_from=DIR "
            "run_dir=NEW` (the optimizer state and the schedule start afresh). Nothing was changed.")
    refused = [c for c in changes if _under(c[0], FIXED) and not _under(c[0], allowed)]
    if refused:
        lines = "\n".join(f"  {k}: {old!r} in the checkpoint, {now!r} now" for k, old, now in refused)
        keys = ",".join(sorted({k for k, _, _ in refused}))
        raise ValueError(
            f"checkpoint.resume: {ckpt_dir} belongs to a run with another model or data than this config:\n{lines}\n"
            f"A resume continues that run: resume with its settings (its config is in {ckpt_dir / 'client.json'} "
            f"under train_config, and in the run's train_config.json). To start a new run from its weights instead: "
            f"`lm export {ckpt_dir} --output DIR`, then model.init_from=DIR in another run_dir. To resume with these "
            f"changed on purpose: --allow-change {keys} (checkpoint.allow_change). Nothing was changed.")
    return [f"{k}: {old!r} -> {now!r}" for k, old, now in changes]


# ------------------------------------------------------------------------------------ another world size


def partitioned(ckpt_dir: Path) -> bool:
    """Whether the checkpoint's optimizer state is split over its ranks (DeepSpeed ZeRO-1/2, or bf16 ZeRO-0)."""
    return any(ckpt_dir.glob("*zero_pp_rank_*_optim_states.pt"))


def universal_dir(root: Path, tag: str) -> Path:
    """Where rank 0 writes the universal form of checkpoint `tag` (in the staging area of the checkpoints)."""
    return ckpt.staging_dir(root, "universal") / tag


def to_universal(ckpt_dir: Path, out: Path) -> Path:
    """DeepSpeed's universal checkpoint of a ZeRO-1/2 checkpoint (per parameter: fp32 value, exp_avg, exp_avg_sq,
    step; plus the model states): what a DeepSpeed engine with `checkpoint.load_universal` loads at any number of
    ranks. Written into `out` (replaced); its printed progress is swallowed."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(input_folder=str(ckpt_dir), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True,
                              inject_missing_state=True)  # (checkpoints carry no universal_checkpoint_info)
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            ds_to_universal(args)
    except Exception as err:  # noqa: BLE001 - say which checkpoint and what DeepSpeed printed
        shutil.rmtree(out, ignore_errors=True)
        raise ValueError(f"checkpoint.resume: could not convert {ckpt_dir} to DeepSpeed's universal checkpoint for "
                         f"another number of ranks ({type(err).__name__}: {err}); resume with the number of ranks "
                         f"that wrote it. DeepSpeed said: {sink.getvalue()[-800:]}") from None
    return out


def data_state(state: dict, saved_world: int, world: int) -> dict:
    """A reader state saved by one of `saved_world` ranks, for a rank of a run with `world` ranks (same global
    batch): the window counts of the shard and synthetic readers are global (unchanged); the task reader's batch
    count is per rank (scaled)."""
    if saved_world == world or "task" not in state:
        return state
    total = int(state["consumed"]) * saved_world
    if total % world:
        raise ValueError(f"checkpoint.resume: the task data's position ({total} batches over {saved_world} ranks) "
                         f"does not split over {world} ranks; resume with a number of ranks that divides {total}")
    return {**state, "consumed": total // world}
