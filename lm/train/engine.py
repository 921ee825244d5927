"""Two engines with one interface: DeepSpeed (ZeRO 0/1/2, any number of ranks) and plain PyTorch
(one process, no DeepSpeed needed: the README's CPU main job).

    engine.forward(batch) -> model output          (autocast for bf16 in the torch engine)
    engine.backward(loss)                           (scaled by 1/accumulation)
    engine.micro_end(boundary, lr, losses) -> None | (applied, grad_norm)   at the accumulation boundary:
        set lr, clip, step; a step whose gradients (or, torch engine, micro losses) are not finite is skipped
        (applied false). The torch engine with the fused AdamW returns both as device tensors and decides
        the skip on the device (no host sync in the step); otherwise they are Python values.
    engine.save(staging_root, tag) / engine.load(ckpt_dir, universal=None)   (universal: DeepSpeed's universal
        form of the checkpoint, for another number of ranks: lm.train.resume)
    engine.module                                   (the model)

Checkpoint files go through `writer(path)` (checkpoint.HashingWriter: the manifest's content hash is computed
from the bytes as they are written).

The DeepSpeed engine replaces a few private methods of DeepSpeed's ZeRO-1/2 optimizer and checkpoint engine (the
host waits and kernel launches they cost, OVERRIDES). Each is installed only on the DeepSpeed versions it was written
against and tested with (TESTED_DEEPSPEED: the signatures it replaces and the attributes it reads); on any other
version DeepSpeed's own method runs, with a one-line warning on rank 0, and the results are the same (slower).
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import types
from pathlib import Path

import torch

# DeepSpeed releases (major, minor) whose private methods the overrides below replace as written and were tested with:
# DeepSpeedZeroOptimizer.{has_overflow_partitioned_grads_serial(), get_grad_norm_direct(gradients, params, norm_type),
# unscale_and_clip_grads(grad_groups_flat, total_norm), scaled_global_norm(norm_type), check_grad_overflow} in
# deepspeed/runtime/zero/stage_1_and_2.py and TorchCheckpointEngine.save(state_dict, path) (0.19.5 - 0.19.8)
TESTED_DEEPSPEED = ((0, 19),)
# name -> what it replaces and why (the commits that added them measured what each saves: docs/performance.md)
OVERRIDES = {
    "fused_grad_checks": "ZeRO-1/2's overflow check and gradient norm (has_overflow_partitioned_grads_serial, "
                         "get_grad_norm_direct) as foreach norms instead of ~4000 small kernels per step",
    "clip_on_device": "ZeRO-1/2's unscale_and_clip_grads without its host test of the gradient norm",
    "skip_on_device": "bf16 ZeRO-1/2's non-finite step skipped on the device (scaled_global_norm sets the fused "
                      "AdamW's found_inf; check_grad_overflow off) instead of an .item() in every step",
    "hashing_writer": "TorchCheckpointEngine.save through the checkpoint's hashing writer (no re-read of the files)",
}
_warned: set = set()


def deepspeed_version() -> tuple:
    """The installed DeepSpeed's (major, minor)."""
    import deepspeed
    from packaging.version import Version

    return Version(deepspeed.__version__).release[:2]


def use_override(name: str) -> bool:
    """Whether override `name` (OVERRIDES) is installed: the DeepSpeed version is one it was tested with. Otherwise
    DeepSpeed's own method stays, and rank 0 says so once per process in one line."""
    version = deepspeed_version()
    if version in TESTED_DEEPSPEED:
        return True
    if name not in _warned:
        _warned.add(name)
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            tested = ", ".join(f"{a}.{b}.x" for a, b in TESTED_DEEPSPEED)
            print(f"lm train: DeepSpeed {'.'.join(map(str, version))} is not a version lm's {name} override was "
                  f"tested with ({tested}): DeepSpeed's own method runs ({OVERRIDES[name]})", file=sys.stderr)
    return False


def _set_lr(optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


class TorchEngine:
    name = "torch"

    def __init__(self, model, optimizer, *, accumulation: int, grad_clip: float, precision: str, device):
        self.module, self.optimizer = model, optimizer
        self.accumulation, self.grad_clip = accumulation, grad_clip
        self.precision, self.device = precision, device

    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, batch: dict):
        with self._autocast():
            return self.module(**batch)

    def backward(self, loss):
        (loss / self.accumulation).backward()

    def micro_end(self, boundary: bool, lr: float, losses: torch.Tensor | None = None):
        if not boundary:
            return None
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        bad = ~torch.isfinite(norm)
        if losses is not None:
            bad = bad | ~torch.isfinite(losses).all()
        _set_lr(self.optimizer, lr)
        if self.optimizer.defaults.get("fused"):
            # the fused AdamW leaves parameters, moments and step count as they are where found_inf is 1
            self.optimizer.found_inf = bad.to(torch.float32)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return ~bad, norm.detach()
        applied, norm = not bool(bad), float(norm)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return applied, norm

    def save(self, staging_root: Path, tag: str, writer) -> None:
        d = staging_root / tag
        d.mkdir(parents=True, exist_ok=True)
        with writer(d / "model_optim.pt") as f:
            torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}, f)

    def load(self, ckpt: Path, universal: Path | None = None) -> None:
        path = ckpt / "model_optim.pt"
        if not path.is_file():
            raise ValueError(f"checkpoint {ckpt} has no model_optim.pt: it was not written by the torch engine "
                             "(use train.engine=deepspeed to resume a DeepSpeed checkpoint)")
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def deepspeed_config(*, base: str | None, micro_batch_size: int, accumulation: int, world_size: int,
                     grad_clip: float, precision: str, zero_stage: int, universal: bool = False) -> dict:
    """The DeepSpeed config of a run; `universal`: its checkpoint is loaded from DeepSpeed's universal form (a
    resume at another number of ranks, lm.train.resume)."""
    cfg: dict = {}
    if base:
        from ..resources import config_path

        try:
            p = config_path(base, "deepspeed")  # a file, or a packaged one (configs/deepspeed/zero2.json)
        except FileNotFoundError as err:
            raise ValueError(f"train.deepspeed_config: {err}") from None
        cfg = json.loads(p.read_text())
    cfg.update({
        "train_batch_size": micro_batch_size * accumulation * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": grad_clip,
        "bf16": {**cfg.get("bf16", {}), "enabled": precision == "bf16", "check_grad_overflow": True},
        "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    })
    # DeepSpeed's throughput timer (on by default, "synchronized") synchronises the device at the start and the end
    # of every micro-batch: the GPU drains and waits for the host to launch the next work. The trainer measures
    # tokens/s itself, so the timer is off unless the base json sets it.
    cfg.setdefault("timers", {"throughput": {"enabled": False}})
    cfg.setdefault("steps_per_print", 10**12)
    cfg.setdefault("wall_clock_breakdown", False)
    cfg["zero_optimization"] = {**cfg.get("zero_optimization", {}), "stage": zero_stage}
    for k in ("optimizer", "scheduler"):  # ours are built in code
        cfg.pop(k, None)
    if universal:
        cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "load_universal": True}
    return cfg


def _zero_overrides(opt) -> None:
    """The ZeRO-1/2 optimizer's overrides (OVERRIDES: fused_grad_checks, clip_on_device, skip_on_device), each on a
    tested DeepSpeed version only (use_override). Other optimizers (ZeRO-3, CPU offload, MoE, none) are left as
    they are."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(opt, DeepSpeedZeroOptimizer) or opt.cpu_offload or getattr(opt, "has_moe_layers", False):
        return
    if use_override("fused_grad_checks"):
        _fused_norms(opt)
    if use_override("clip_on_device"):
        opt.unscale_and_clip_grads = types.MethodType(_unscale_and_clip_grads, opt)
    if use_override("skip_on_device"):
        _skip_on_device(opt)


def _fused_norms(opt) -> None:
    """ZeRO-1/2's overflow check and gradient norm as a few fused kernels instead of a loop over parameters.

    DeepSpeed's stage-1/2 optimizer tests every gradient for inf / NaN (amax, amin, isfinite, ... per tensor) and
    takes every gradient's norm in float64, one tensor at a time: ~4000 small kernel launches per step for a 48-layer
    model, during which the device idles until the host has launched them all (docs/performance.md, DeepSpeed's cost).
    Here both (has_overflow_partitioned_grads_serial, get_grad_norm_direct) are `torch._foreach_norm` over the same
    gradients (the max-norm propagates NaN and exposes inf: an overflow exactly where any element is non-finite; the
    2-norm per tensor, summed in float64) followed by DeepSpeed's own reductions across ranks."""
    from deepspeed import comm as ds_dist

    dev = opt.device

    def has_overflow_partitioned_grads_serial():
        grads = [g for i in range(len(opt.bit16_groups)) for g in (opt.averaged_gradients.get(i) or ())
                 if g is not None and g.numel() > 0]
        if not grads:  # shape (1,), as DeepSpeed's: its caller indexes [0]
            return torch.zeros(1, dtype=torch.bool, device=dev)
        norms = torch.stack(torch._foreach_norm(grads, float("inf"), dtype=torch.float32))
        return (~torch.isfinite(norms).all()).reshape(1)

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            raise ValueError("only the L2 gradient norm is fused")
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False) and g.numel() > 0]
        if grads:
            # CUDA's foreach norm reduces in a tree (float32 is exact enough); the CPU kernel sums serially: float64
            acc = torch.float64 if grads[0].device.type == "cpu" else torch.float32
            sq = torch.stack(torch._foreach_norm(grads, 2.0, dtype=acc)).double().pow(2).sum().float()
        else:
            sq = torch.zeros((), dtype=torch.float32, device=dev)
        ds_dist.all_reduce(sq, op=ds_dist.ReduceOp.SUM, group=opt.dp_process_group)
        opt._model_parallel_all_reduce(tensor=sq, op=ds_dist.ReduceOp.SUM)
        # DeepSpeed's invalid-norm sentinel -1 (its mask_nan_or_inf_with_val_inplace fills with a tensor made on
        # the host: two waits for the device per call)
        total = sq.sqrt()
        return total.masked_fill_(~torch.isfinite(total), -1.0)

    opt.has_overflow_partitioned_grads_serial = has_overflow_partitioned_grads_serial
    opt.get_grad_norm_direct = get_grad_norm_direct


def _unscale_and_clip_grads(opt, grad_groups_flat, total_norm) -> None:
    """DeepSpeed's ZeRO-1/2 unscale_and_clip_grads without its host test of the norm (`bool(...)` of a device
    tensor, a wait for the backward in every step): an invalid norm (not finite, or the sentinel -1) clips with an
    infinite norm, as DeepSpeed's does, but chosen on the device."""
    if opt.clip_grad == 0.0 and opt.loss_scale == 1.0:
        return
    combined_scale = opt.loss_scale
    if opt.clip_grad > 0.0:
        clip_norm = torch.where(torch.isfinite(total_norm) & (total_norm >= 0), total_norm,
                                torch.full_like(total_norm, float("inf")))  # (a tensor, as DeepSpeed's step gives)
        clip = ((clip_norm / opt.loss_scale) + 1e-6) / opt.clip_grad
        clip = torch.clamp(clip, min=1.0)
        combined_scale = clip * opt.loss_scale
    for grad in grad_groups_flat:
        for g in (grad if isinstance(grad, list) else [grad]):
            g.data.mul_(1.0 / combined_scale)


def _skip_on_device(opt) -> None:
    """bf16 ZeRO-1/2 with gradient norms and the fused AdamW: the step's skip decided on the device, as the torch
    engine's. DeepSpeed's own check reads an all-reduced overflow flag with .item() in every step (and its bf16 path
    then tests the norm on the host): the host waits for the backward before it can queue the optimizer, and the
    loop cannot run ahead. Here the check is off (`check_grad_overflow`; with bf16 DeepSpeed then tests nothing) and
    the combined gradient norm, which DeepSpeed makes +inf where any group's is not finite, sets the fused AdamW's
    found_inf: the update, moments and step count stay as they were on every rank (the norm is all-reduced), and
    DeepSpeed copies the unchanged fp32 partitions back. `opt._lm_found_inf` holds the step's flag for micro_end."""
    base = opt.optimizer
    if (opt.dtype != torch.bfloat16 or not opt.compute_grad_norm or not opt.check_grad_overflow
            or not getattr(base, "defaults", {}).get("fused")):
        return
    opt.check_grad_overflow = False
    combined = opt.scaled_global_norm

    def scaled_global_norm(norm_type=2):
        total = combined(norm_type)
        base.found_inf = opt._lm_found_inf = (~torch.isfinite(total)).to(torch.float32).reshape(())
        return total

    opt.scaled_global_norm = scaled_global_norm
    opt._lm_found_inf = None


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(self, model, optimizer, ds_config: dict):
        import deepspeed

        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        _zero_overrides(self.engine.optimizer)
        self.base_optimizer = optimizer  # ZeRO keeps its param_groups (and their lr) in this object
        self.module = self.engine.module

    def forward(self, batch: dict):
        return self.engine(**batch)

    def backward(self, loss):
        self.engine.backward(loss)

    def micro_end(self, boundary: bool, lr: float, losses: torch.Tensor | None = None):
        if boundary:
            _set_lr(self.base_optimizer, lr)
        self.engine.step()
        if not boundary:
            return None
        found_inf = getattr(self.engine.optimizer, "_lm_found_inf", None)
        if found_inf is not None:  # decided on the device (_skip_on_device): no host sync
            norm = self.engine.get_global_grad_norm()
            return found_inf == 0, torch.where(found_inf == 0, norm, torch.full_like(norm, float("nan")))
        applied = bool(self.engine.was_step_applied())
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return applied and math.isfinite(norm), norm

    def save(self, staging_root: Path, tag: str, writer) -> None:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        ce = self.engine.checkpoint_engine
        if type(ce) is not TorchCheckpointEngine or not use_override("hashing_writer"):
            # another engine (async, Nebula), or a DeepSpeed version the override was not tested with: the manifest
            # reads the files back to hash them
            self.engine.save_checkpoint(str(staging_root), tag=tag, save_latest=False)
            return

        def save(state_dict, path):  # TorchCheckpointEngine.save, through the hashing writer
            with writer(Path(path)) as f:
                torch.save(state_dict, f, _use_new_zipfile_serialization=ce.zipfile_serialization)

        ce.save = save
        try:
            self.engine.save_checkpoint(str(staging_root), tag=tag, save_latest=False)
        finally:
            del ce.save  # the class's method again

    def load(self, ckpt: Path, universal: Path | None = None) -> None:
        if not any(ckpt.glob("mp_rank_*_model_states.pt")):
            raise ValueError(f"checkpoint {ckpt} has no DeepSpeed model states: it was not written by the "
                             "DeepSpeed engine (use train.engine=torch to resume it)")
        if universal is not None and not self.engine.load_universal_checkpoint():
            raise ValueError("a universal checkpoint needs an engine built with deepspeed_config(universal=True)")
        src = universal if universal is not None else ckpt
        path, _ = self.engine.load_checkpoint(str(src.parent), tag=src.name, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise ValueError(f"DeepSpeed could not load checkpoint {ckpt}")
