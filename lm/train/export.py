"""`lm export CHECKPOINT_OR_RUN [--output DIR]`: a training checkpoint -> a Hugging Face model folder
(safetensors + config.json + tokenizer) that `AutoModelForCausalLM.from_pretrained(DIR)` loads after
`import lm`. DeepSpeed ZeRO checkpoints are consolidated to fp32 (DeepSpeed's zero_to_fp32); the
torch engine's checkpoints hold fp32 weights already. The exported config carries the solver
settings of the curriculum phase the checkpoint was in. The folder gets a manifest.json (size and sha256 of
every file) that the loaders check (`verify_export`), so a file changed or cut short later is named.

An export never mixes with other files: it is written beside the output folder and then takes its place, so a
re-export leaves no stale file (an old eval_results.json) behind. A folder holding another run's export, or files
that are no export, is refused unless --force. Files get the permissions the umask gives (group-readable on a
shared cluster under the usual umask 022 / 002), not the 0600 of the temporary files they are written through.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from . import checkpoint as ckpt_lib


def _state_dict(ckpt: Path) -> dict:
    if (ckpt / "model_optim.pt").is_file():
        return torch.load(ckpt / "model_optim.pt", map_location="cpu", weights_only=False)["model"]
    if any(ckpt.glob("zero_pp_rank_*_optim_states.pt")) or any(ckpt.glob("*zero_pp_rank_*")):
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
        except Exception:  # noqa: BLE001 - ZeRO-0 checkpoints carry the full module instead
            pass
    states = sorted(ckpt.glob("mp_rank_*_model_states.pt"))
    if not states:
        raise ValueError(f"{ckpt}: no model weights found (model_optim.pt or DeepSpeed mp_rank_*_model_states.pt)")
    sd = torch.load(states[0], map_location="cpu", weights_only=False)["module"]
    return {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}


def _run_of(ckpt: str | os.PathLike) -> Path:
    """The run folder of a checkpoint folder (RUN/checkpoints/step_N)."""
    return Path(ckpt).resolve().parent.parent


def check_output(out: Path, ckpt: Path, force: bool = False) -> None:
    """Refuse to replace a folder that holds anything but an export of the same run (unless force)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--output: {out} is a file, not a folder; choose another --output")
    if Path(ckpt).resolve().is_relative_to(out.resolve()):
        raise ValueError(f"--output: {out} holds the checkpoint {ckpt} itself; choose another --output")
    if not any(out.iterdir()) or force:
        return
    mpath = out / ckpt_lib.MANIFEST
    try:
        prev = json.loads(mpath.read_text()).get("checkpoint") if mpath.is_file() else None
    except (OSError, ValueError):
        prev = None
    if prev is not None and _run_of(prev) == _run_of(ckpt):
        return  # a newer export of the same run replaces the older one
    what = (f"the export of another run's checkpoint ({prev})" if prev is not None
            else f"files that are not an lm export ({', '.join(sorted(p.name for p in out.iterdir())[:4])} ...)")
    raise ValueError(f"--output: {out} already holds {what}; nothing was written. Choose another --output, or add "
                     "--force to replace that folder (all its files go, e.g. an eval_results.json of the old "
                     "model).")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publish(staging: Path, out: Path) -> None:
    """Put the finished staging folder in place of `out` (whose old files go), readable as the umask says."""
    mode = 0o666 & ~_umask()
    for p in staging.rglob("*"):
        if p.is_file():
            os.chmod(p, mode)
    os.chmod(staging, 0o777 & ~_umask())
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def export_checkpoint(checkpoint: str | os.PathLike, output: str | os.PathLike, *, dtype: str = "float32",
                      tokenizer: str | None = None, force: bool = False) -> Path:
    """Write the HF folder for a checkpoint (or a run folder's latest checkpoint); returns its path. `output` may
    hold an export of the same run (replaced whole); anything else is refused unless `force` (check_output)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import lm.models  # noqa: F401  (registers the model types)

    ckpt = ckpt_lib.resolve(checkpoint)
    out = Path(output)
    check_output(out, ckpt, force)
    config = AutoConfig.from_pretrained(str(ckpt))
    model = AutoModelForCausalLM.from_config(config)
    sd = _state_dict(ckpt)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise ValueError(f"{ckpt}: weights do not match the model config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    model.tie_weights()
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype: must be float32, bfloat16 or float16 (got {dtype!r})")
    model = model.to(getattr(torch, dtype))
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _write(model, ckpt, staging, dtype, tokenizer, hf_logging)
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write(model, ckpt: Path, out: Path, dtype: str, tokenizer: str | None, hf_logging) -> None:
    """The export's files into `out`: weights, config, tokenizer, manifest."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its "Writing model shards" bar would draw into job logs
    try:
        model.save_pretrained(str(out))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    client = json.loads((ckpt / "client.json").read_text()) if (ckpt / "client.json").is_file() else {}
    data_cfg = client.get("train_config", {}).get("data", {})
    if tokenizer is None and data_cfg.get("source", "shards") == "shards":
        tokenizer = data_cfg.get("tokenizer") or "default"
    if tokenizer is not None:
        from lm.data import load_tokenizer

        load_tokenizer(tokenizer).save_pretrained(str(out))
    # save_pretrained writes through safetensors (no file object to hash through): hash the fresh files
    ckpt_lib.write_manifest(out, {"checkpoint": str(ckpt.resolve()), "dtype": dtype})


def verify_export(folder: str | os.PathLike) -> None:
    """Check an exported folder against its manifest.json (sizes, then sha256); folders without one pass."""
    folder = Path(folder)
    mpath = folder / ckpt_lib.MANIFEST
    if not mpath.is_file():
        return
    hint = ("export it again from its training checkpoint (`lm export RUN_DIR`), or copy the folder again "
            "from where it came")
    try:
        files = json.loads(mpath.read_text())["files"]
    except (ValueError, KeyError) as err:
        raise ValueError(f"model folder {folder}: {ckpt_lib.MANIFEST} is unreadable ({err}); {hint}") from None
    ckpt_lib.check_files(folder, files, "model folder", hint)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lm export", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a checkpoint folder (…/checkpoints/step_N) or a run folder (its latest)")
    ap.add_argument("--output", "-o", default=None, help="output folder (default: RUN/hf)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tokenizer", default=None, help="tokenizer to save with it (default: the run's)")
    ap.add_argument("--force", action="store_true",
                    help="replace an output folder that holds something else than an export of this run")
    args = ap.parse_args(argv)
    try:
        ckpt = ckpt_lib.resolve(args.checkpoint)
        output = args.output or str(ckpt.parent.parent / "hf")
        out = export_checkpoint(ckpt, output, dtype=args.dtype, tokenizer=args.tokenizer, force=args.force)
    except ValueError as err:
        print(f"lm export: {err}", file=sys.stderr)
        return 2
    print(f"exported {ckpt} -> {out}")
    return 0
