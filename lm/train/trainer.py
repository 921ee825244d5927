"""The training loop: config -> data -> model -> engine -> steps (curriculum, schedule, logging,
evaluation, checkpoints) -> final checkpoint + HF export.

    from lm.train import load_train_config, train
    summary = train(load_train_config("configs/train/default.yaml", ["train.tokens=1e6"]))

Runs as one process, or one process per rank under `deepspeed`/`torchrun` (WORLD_SIZE in the env).
A step = `accumulation` micro-batches per rank; global batch tokens = micro_batch_size * seq_len *
world_size * accumulation. Before each step the curriculum phase for the fraction of tokens already
seen is applied (model.config.implicit); the LR comes from the schedule. A step whose loss or
gradient is not finite is skipped with a warning (parameters unchanged); `train.max_bad_steps` in a
row stop the run, leaving the last checkpoint intact.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import checkpoint as ckpt_lib
from .config import TrainConfig
from .curriculum import apply_phase, parse_curriculum, phase_index, phase_start
from .budget import TimeBudget
from .data import build_data, build_task_data, to_model_inputs
from .engine import DeepSpeedEngine, TorchEngine, deepspeed_config, make_optimizer
from .metrics import MetricsLogger, Progress, memory_gb, mfu
from .schedule import lr_at, warmup_steps_of


class TrainingStopped(RuntimeError):
    """Raised when training cannot go on (e.g. too many non-finite steps in a row)."""


# ---------------------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _deepspeed_available() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):
        return False


def resolve_auto_engine(world: int, deepspeed_config: str | None, deepspeed_available: bool) -> str:
    """train.engine=auto: DeepSpeed for several ranks or when a DeepSpeed config is given (e.g. CPU optimizer
    offload), else the plain PyTorch engine. On one H100, compiled Llama-350M trained at 135.6k tok/s with the
    plain engine and 113.0k under DeepSpeed ZeRO-2 (same run, lm/train/BENCH.md): ZeRO has nothing to
    partition over one rank, and a checkpoint resumes only with the world size that wrote it anyway."""
    want = world > 1 or deepspeed_config is not None
    return "deepspeed" if want and deepspeed_available else "torch"


class Dist:
    """Rank, world size, device and the engine kind of this process."""

    def __init__(self, cfg: TrainConfig):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        want = cfg.train.device
        if want == "cuda" and not torch.cuda.is_available():
            raise ValueError("train.device: cuda requested but no CUDA device is visible (use train.device=cpu)")
        cuda = torch.cuda.is_available() and want != "cpu"
        self.device = torch.device(f"cuda:{self.local_rank}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        engine = cfg.train.engine
        if engine == "auto":
            engine = resolve_auto_engine(self.world, cfg.train.deepspeed_config, _deepspeed_available())
        if engine == "deepspeed" and not _deepspeed_available():
            raise ValueError("train.engine: deepspeed is not installed (pip install deepspeed, or the `train` extra); "
                             "use train.engine=torch for a single process")
        if engine == "torch" and self.world > 1:
            raise ValueError(f"train.engine: torch runs a single process, but WORLD_SIZE={self.world}; "
                             "use train.engine=deepspeed (or auto) for several ranks")
        self.engine = engine
        self.initialized = False
        if engine == "deepspeed":
            if self.device.type == "cpu":
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
            if self.world == 1:
                os.environ.setdefault("RANK", "0")
                os.environ.setdefault("LOCAL_RANK", "0")
                os.environ.setdefault("WORLD_SIZE", "1")
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(_free_port()))
            import deepspeed

            if not torch.distributed.is_initialized():
                deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
                self.initialized = True

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return t.tolist()

    def close(self) -> None:
        """Nothing: the process group stays for a later train() in this process (DeepSpeed caches its
        groups); the CLI destroys it before the process exits (shutdown())."""


def shutdown() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------- pieces


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


def build_model(cfg: TrainConfig, phases, data_vocab: int):
    """The causal LM for the config (fp32, on CPU), with the first curriculum phase applied."""
    from transformers import AutoModelForCausalLM

    import lm  # noqa: F401  (registers the model types)
    from lm.models.presets import load_config

    m = cfg.model
    if m.init_from:
        if not Path(m.init_from).is_dir():
            raise ValueError(f"model.init_from: {m.init_from} is not a folder (an `lm export` output)")
        model = AutoModelForCausalLM.from_pretrained(m.init_from, dtype=torch.float32)
        if phases and model.config.is_implicit:
            apply_phase(model.config, phases[0])
    else:
        implicit = phases[0].implicit if phases else m.implicit
        try:
            config = load_config(m.preset, **{**m.overrides, "implicit": implicit})
        except ValueError as err:
            raise ValueError(f"model: {err}") from None
        from lm.models import MODEL_TYPES

        model = MODEL_TYPES[config.model_type][2](config)
    if phases and not model.config.is_implicit:
        raise ValueError("curriculum: set for an explicit model (the curriculum switches solver settings of "
                         "implicit models, and an explicit model has no injection module); remove it or use "
                         "an implicit model")
    if model.config.vocab_size < data_vocab:
        raise ValueError(f"model.overrides.vocab_size: the model's vocab_size {model.config.vocab_size} is smaller "
                         f"than the data's vocabulary {data_vocab}; set model.overrides.vocab_size >= {data_vocab}")
    if m.activation_checkpointing:  # transformers >= 5.2x renamed it; older: gradient_checkpointing_enable
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        if not getattr(model.model, "gradient_checkpointing", False):
            raise ValueError("model.activation_checkpointing: this model does not support activation checkpointing")
    if m.compile:  # per block: the solver loop, the cache and the kernels stay eager
        for layer in model.model.layers:
            layer.compile()
    return model


def _token_loss_sums(model, inputs: dict) -> tuple[float, float]:
    out = model(input_ids=inputs["input_ids"], cu_seqlens=inputs.get("cu_seqlens"))
    t = inputs["targets"]
    loss = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), t.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return float(loss), float((t != -100).sum())


@torch.no_grad()
def evaluate(model, batches, device, dist: Dist, precision: str) -> dict:
    """Held-out loss and perplexity over `batches` (every rank its own; summed over ranks)."""
    was = model.training
    model.eval()
    total = count = 0.0
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
           else torch.autocast(device.type, enabled=False))
    with ctx:
        for batch in batches:
            s, n = _token_loss_sums(model, to_model_inputs(batch, device))
            total, count = total + s, count + n
    total, count = dist.all_reduce_sum([total, count])
    model.train(was)
    if count == 0:
        return {}
    loss = total / count
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": int(count)}


def run_tasks(model, tokenizer, ev_cfg, dist: Dist) -> dict:
    """The lm-eval hook: the configured tasks in process on rank 0; {"lm_eval/<task>/<metric>": value}."""
    if not ev_cfg.task_list or tokenizer is None:
        return {}
    out = {}
    if dist.is_main:
        from lm.eval.harness import run_lm_eval

        res = run_lm_eval(model, tokenizer, ev_cfg.task_list, num_fewshot=ev_cfg.num_fewshot,
                          batch_size=ev_cfg.tasks_batch_size, limit=ev_cfg.tasks_limit,
                          include_path=ev_cfg.include_path)
        out = {f"lm_eval/{task}/{metric}": v for task, r in res["results"].items() for metric, v in r.items()}
    dist.barrier()
    return out


def sample_text(model, tokenizer, prompt: str, max_new_tokens: int, seed: int) -> str:
    was = model.training
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, temperature=0.8,
                             pad_token_id=tokenizer.eos_token_id)
    model.train(was)
    return tokenizer.decode(out[0], skip_special_tokens=True)


# --------------------------------------------------------------------------------------------- train


def train(cfg: TrainConfig, *, hooks: dict | None = None) -> dict:
    """Train as configured; returns a summary dict (steps, tokens, final loss, val ppl, paths, sample).

    `hooks` (tests): {"after_forward": fn(step, micro, out) -> out} may replace a model output.
    """
    hooks = hooks or {}
    cfg.validate()
    t = cfg.train
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    if t.zero_stage == 3 and t.engine != "torch" and _is_implicit(cfg):
        raise ValueError("train.zero_stage: ZeRO-3 is refused for implicit models: the fixed-point solver calls the "
                         "same layers a data-dependent number of times, which breaks ZeRO-3's parameter prefetch. "
                         "Use train.zero_stage=2 (or 1); the parameters of these models fit on one device.")
    dist = Dist(cfg)
    try:
        return _train(cfg, dist, hooks)
    finally:
        dist.close()


def _train(cfg: TrainConfig, dist: Dist, hooks: dict) -> dict:
    t, d = cfg.train, cfg.data
    run_dir = Path(cfg.run_dir)
    root = ckpt_lib.checkpoints_root(run_dir)
    resume_from = None
    resume = cfg.checkpoint.resume
    if resume == "auto":  # continue when the run has a checkpoint (SLURM requeue), else start fresh
        resume = True if (root / ckpt_lib.LATEST).is_file() else False
    if resume:
        # verify before anything else is touched: a bad checkpoint is reported, nothing is written
        resume_from = ckpt_lib.resolve(run_dir if resume is True else resume)
    elif (root / ckpt_lib.LATEST).is_file():
        raise ValueError(f"run_dir: {run_dir} already holds checkpoints of a run; continue it with --resume "
                         "(checkpoint.resume=true|auto) or choose another run_dir (nothing was changed)")
    metrics = run_dir / "metrics.jsonl"
    if resume_from is None and metrics.is_file() and dist.is_main:  # a fresh start keeps the old log aside
        os.replace(metrics, run_dir / f"metrics.{int(metrics.stat().st_mtime)}.jsonl")

    # batch arithmetic
    per_micro = t.micro_batch_size * d.seq_len * dist.world
    if t.global_batch_tokens % per_micro:
        raise ValueError(f"train.global_batch_tokens: {t.global_batch_tokens} is not a multiple of micro_batch_size * "
                         f"seq_len * world_size = {t.micro_batch_size} * {d.seq_len} * {dist.world} = {per_micro}")
    accumulation = t.global_batch_tokens // per_micro
    total_steps = t.steps if t.steps is not None else math.ceil(t.tokens / t.global_batch_tokens)
    total_tokens = total_steps * t.global_batch_tokens

    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)

    if d.source == "task":  # a synthetic task: its reader, and its evaluation per length (lm.eval.synthetic)
        from lm.eval.synthetic import TaskEvalHook

        train_reader, make_val, tokenizer, data_vocab = build_task_data(cfg, rank=dist.rank, world_size=dist.world)
        task_hook = TaskEvalHook(cfg, train_reader, run_dir, device=dist.device, is_main=dist.is_main)
        hooks = {**hooks, "after_forward": _chain(hooks.get("after_forward"), task_hook.after_forward)}
    else:
        train_reader, make_val, tokenizer, data_vocab = build_data(
            d, seed=t.seed, micro_batch_size=t.micro_batch_size, rank=dist.rank, world_size=dist.world)
        task_hook = None
    preset_type = _preset_model_type(cfg)
    phases = parse_curriculum(cfg.curriculum, preset_type)
    model = build_model(cfg, phases, data_vocab)
    implicit = model.config.is_implicit
    if dist.engine == "deepspeed" and t.zero_stage == 3 and implicit:
        raise ValueError("train.zero_stage: ZeRO-3 is refused for implicit models: the fixed-point solver calls the "
                         "same layers a data-dependent number of times, which breaks ZeRO-3's parameter prefetch. "
                         "Use train.zero_stage=2 (or 1); the parameters of these models fit on one device.")
    model.to(dist.device)
    model.train()

    optimizer = make_optimizer(model, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                               weight_decay=cfg.optim.weight_decay, device=dist.device)
    if dist.engine == "deepspeed":
        ds_cfg = deepspeed_config(base=t.deepspeed_config, micro_batch_size=t.micro_batch_size,
                                  accumulation=accumulation, world_size=dist.world, grad_clip=cfg.optim.grad_clip,
                                  precision=t.precision, zero_stage=t.zero_stage)
        engine = DeepSpeedEngine(model, optimizer, ds_cfg)
    else:
        engine = TorchEngine(model, optimizer, accumulation=accumulation, grad_clip=cfg.optim.grad_clip,
                             precision=t.precision, device=dist.device)
    model = engine.module

    warmup = warmup_steps_of(cfg.schedule.warmup, total_steps)
    ds = cfg.schedule.decay_start
    decay_frac = phase_start(phases, len(phases) - 1) if ds == "last_phase" else float(ds)
    sched = dict(kind=cfg.schedule.kind, peak_lr=cfg.optim.lr, min_lr=cfg.schedule.min_lr, warmup_steps=warmup,
                 decay_start_step=int(round(decay_frac * total_steps)))

    step, bad_in_row, phase_i = 0, 0, -1
    budget = TimeBudget(t.max_minutes, t.stop_after_minutes)
    if resume_from is not None:
        step, bad_in_row, phase_i = _resume(resume_from, engine, train_reader, dist, cfg)
        budget.resume(json.loads((resume_from / "client.json").read_text()).get("train_s", 0.0))
        if phases and phase_i >= 0:
            apply_phase(model.config, phases[phase_i])

    logger = MetricsLogger(run_dir, enabled=dist.is_main,
                           wandb_cfg={"project": cfg.log.wandb_project} if cfg.log.wandb else None,
                           config=cfg.to_dict())
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    n_params = sum(p.numel() for p in model.parameters())
    logger.log({"event": "start", "step": step, "total_steps": total_steps, "total_tokens": total_tokens,
                "accumulation": accumulation, "world_size": dist.world, "engine": dist.engine,
                "device": str(dist.device), "params": n_params, "resumed_from": str(resume_from) if resume_from else None})
    progress = Progress(total_steps, step, enabled=dist.is_main and cfg.log.progress)
    if dist.is_main:
        progress.write(f"lm train: {model.config.model_type} {n_params / 1e6:.2f}M params, {total_steps} steps x "
                       f"{t.global_batch_tokens} tokens ({accumulation} x {t.micro_batch_size} x {d.seq_len} x "
                       f"{dist.world} ranks), engine {dist.engine} on {dist.device}"
                       + (f", resumed at step {step}" if step else ""))

    flops_cache: dict = {}
    last_loss = float("nan")
    stop_at = min(total_steps, t.stop_after_steps) if t.stop_after_steps else total_steps
    last_saved = step if resume_from is not None else -1
    summary: dict = {}
    window_tokens, window_time = 0, 0.0

    # why the loop ended before stop_at: "time budget" (complete) | "target accuracy" (complete) | "slice"
    stopped = "time budget" if budget.out_of_time() else None
    while step < stop_at and not stopped:
        # curriculum
        if phases:
            i = phase_index(phases, step * t.global_batch_tokens / total_tokens)
            if i != phase_i:
                apply_phase(model.config, phases[i])
                if phase_i >= 0:
                    logger.log({"event": "phase_switch", "step": step, "tokens": step * t.global_batch_tokens,
                                "phase": phases[i].name, "implicit": phases[i].implicit})
                if dist.is_main:
                    progress.write(f"step {step}: curriculum phase {phases[i].describe()}")
                phase_i = i
        lr = lr_at(budget.schedule_step(step, total_steps, warmup), total_steps, **sched)
        t0 = time.perf_counter()
        micro_losses = []
        fp_stats: list[dict] = []
        result = None
        for micro in range(accumulation):
            inputs = to_model_inputs(next(train_reader), dist.device)
            if t.fused_loss:
                inputs["fused_loss"] = True
            out = engine.forward(inputs)
            if "after_forward" in hooks:
                out = hooks["after_forward"](step, micro, out)
            micro_losses.append(out.loss.detach().float())  # read after the step: no sync per micro-batch
            if out.fixed_point_stats:
                fp_stats.append(out.fixed_point_stats)
            engine.backward(out.loss)
            result = engine.micro_end(micro == accumulation - 1, lr)
        applied, grad_norm = result
        losses_t = torch.stack(micro_losses)
        finite = torch.isfinite(losses_t)
        loss_sum = float(torch.where(finite, losses_t, torch.zeros_like(losses_t)).sum())
        nonfinite = float((~finite).sum())
        loss_sum, nonfinite, n_micro = dist.all_reduce_sum([loss_sum, nonfinite, float(accumulation)])
        n_good = n_micro - nonfinite
        step_loss = loss_sum / n_good if n_good else float("nan")
        if dist.device.type == "cuda":
            torch.cuda.synchronize(dist.device)
        dt = time.perf_counter() - t0
        step += 1
        skipped = (not applied) or nonfinite > 0
        if skipped:
            bad_in_row += 1
            why = "non-finite loss" if nonfinite else "non-finite gradient"
            msg = (f"warning: step {step} skipped ({why}; parameters unchanged), "
                   f"{bad_in_row} in a row (limit train.max_bad_steps={t.max_bad_steps})")
            if dist.is_main:
                progress.write(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=1)
            logger.log({"event": "skip", "step": step, "reason": why, "in_a_row": bad_in_row})
            if bad_in_row >= t.max_bad_steps:
                logger.log({"event": "stopped", "step": step, "reason": f"{bad_in_row} non-finite steps in a row"})
                logger.close()
                progress.close()
                latest = root / ckpt_lib.LATEST
                kept = (f"the last checkpoint ({root / latest.read_text().strip()}) is intact"
                        if latest.is_file() else "no checkpoint was written")
                raise TrainingStopped(
                    f"stopped at step {step}: {bad_in_row} steps in a row had a non-finite loss or gradient; {kept}. "
                    "Lower optim.lr or optim.grad_clip, or check the data, then resume.")
        else:
            bad_in_row = 0
            last_loss = step_loss

        # metrics
        window_tokens += t.global_batch_tokens
        window_time += dt
        stopped = "time budget" if budget.out_of_time() else "slice" if budget.slice_done() and step < stop_at else None
        if step % cfg.log.every_steps == 0 or step == stop_at or stopped:
            tps = window_tokens / window_time if window_time > 0 else float("nan")
            key = json.dumps(model.config.implicit, sort_keys=True)
            if key not in flops_cache:
                from lm.models.presets import flops_per_token

                flops_cache[key] = flops_per_token(model.config, d.seq_len)["train"]
            rec = {"step": step, "tokens": step * t.global_batch_tokens, "loss": step_loss, "lr": lr,
                   "grad_norm": grad_norm, "tokens_per_s": tps, "step_time": window_time / max(1, window_tokens // t.global_batch_tokens),
                   "mfu": mfu(tps, flops_cache[key], cfg.log.peak_flops, dist.world),
                   "mem_gb": memory_gb(dist.device), "skipped": skipped}
            if phases:
                rec["phase"] = phases[phase_i].name
            if fp_stats:
                for k in fp_stats[0]:
                    vals = [s[k] for s in fp_stats if k in s]
                    rec[f"fp/{k}"] = sum(vals) / len(vals)
            if task_hook is not None:
                rec.update(task_hook.log_fields())
                if task_hook.reached_target(step):
                    stopped = "target accuracy"
            logger.log(rec)
            postfix = {"loss": f"{step_loss:.3f}", "lr": f"{lr:.2e}", "tok/s": f"{tps:,.0f}"}
            it = rec.get("fp/iterations", rec.get("fp/layer_iterations"))  # implicit model / FP-Mamba's layers
            if it is not None:
                postfix["it"] = f"{it:.1f}"
            progress.update(step - progress.bar.n if progress.bar is not None else 0, **postfix)
            window_tokens, window_time = 0, 0.0

        if stopped:
            break
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < stop_at:
            t_eval = time.perf_counter()
            if task_hook is not None:
                task_hook.evaluate(model, step, logger)
            ev = evaluate(model, make_val(cfg.eval.batches), dist.device, dist, t.precision)
            if ev:
                logger.log({"event": "eval", "step": step, "tokens": step * t.global_batch_tokens, **ev})
                if dist.is_main:
                    progress.write(f"step {step}: held-out loss {ev['val_loss']:.4f}, perplexity {ev['val_ppl']:.2f}")
            tasks = run_tasks(model, tokenizer, cfg.eval, dist)
            if tasks:
                logger.log({"event": "lm_eval", "step": step, "tokens": step * t.global_batch_tokens, **tasks})
            budget.exclude(time.perf_counter() - t_eval)  # evaluation is not charged to the training time
        if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < stop_at and not skipped:
            # (no periodic checkpoint right after a skipped step: keep the last K good ones)
            _save(engine, train_reader, dist, cfg, root, step, total_steps, phases, phase_i, bad_in_row, logger,
                  budget)
            last_saved = step
    progress.close()

    summary.update({"steps": step, "total_steps": total_steps, "tokens": step * t.global_batch_tokens,
                    "final_loss": last_loss, "run_dir": str(run_dir)})
    if last_saved != step and cfg.checkpoint.at_end:
        _save(engine, train_reader, dist, cfg, root, step, total_steps, phases, phase_i, bad_in_row, logger,
              budget)
        last_saved = step
    if last_saved == step:
        summary["checkpoint"] = str(root / ckpt_lib.tag_of(step))
    finished = step >= total_steps or stopped in ("time budget", "target accuracy")
    summary.update({"complete": finished, "stopped": stopped, "train_s": budget.elapsed_s()})
    if finished and cfg.checkpoint.export and last_saved == step:
        if dist.is_main:
            from .export import export_checkpoint

            out = export_checkpoint(root / ckpt_lib.tag_of(step), run_dir / "hf")
            summary["export"] = str(out)
            logger.log({"event": "export", "step": step, "path": str(out)})
        dist.barrier()
    if finished and cfg.eval.at_end:
        ev = evaluate(model, make_val(cfg.eval.batches), dist.device, dist, t.precision)
        if ev:
            summary.update(ev)
            logger.log({"event": "eval", "step": step, "tokens": step * t.global_batch_tokens, **ev})
        tasks = run_tasks(model, tokenizer, cfg.eval, dist)
        if tasks:
            summary.update(tasks)
            logger.log({"event": "lm_eval", "step": step, "tokens": step * t.global_batch_tokens, **tasks})
    if finished and dist.is_main and cfg.eval.sample_tokens and tokenizer is not None:
        summary["sample"] = sample_text(model, tokenizer, cfg.eval.sample_prompt, cfg.eval.sample_tokens, t.seed)
        logger.log({"event": "sample", "step": step, "text": summary["sample"]})
    if task_hook is not None:
        summary.update(task_hook.finish(model, step, summary, logger, complete=finished, train_s=budget.elapsed_s()))
    logger.log({"event": "end", **{k: v for k, v in summary.items() if k not in ("sample", "results")}})
    logger.close()
    return summary


def _chain(first, second):
    """Two after_forward hooks as one (either may be None)."""
    if first is None:
        return second
    return lambda step, micro, out: second(step, micro, first(step, micro, out))


def _is_implicit(cfg: TrainConfig) -> bool:
    if cfg.curriculum is not None or cfg.model.implicit is not None:
        return True
    p = Path(cfg.model.init_from or cfg.model.preset)
    path = p / "config.json" if p.is_dir() else p
    if not path.is_file():
        from lm.models.presets import presets_dir

        path = presets_dir() / f"{cfg.model.preset}.json"
    if not path.is_file():
        return False
    return {**json.loads(path.read_text()), **cfg.model.overrides}.get("implicit") is not None


def _preset_model_type(cfg: TrainConfig) -> str:
    p = Path(cfg.model.init_from or cfg.model.preset)
    path = p / "config.json" if p.is_dir() else p
    if path.is_file():
        return json.loads(path.read_text()).get("model_type", "lm_mamba2")
    return cfg.model.preset.split("-")[0]


def _save(engine, reader, dist: Dist, cfg: TrainConfig, root: Path, step: int, total_steps: int, phases,
          phase_i: int, bad_in_row: int, logger: MetricsLogger, budget: TimeBudget) -> Path:
    tag = ckpt_lib.tag_of(step)
    stage = ckpt_lib.staging_dir(root, tag)
    if dist.is_main:
        shutil.rmtree(stage, ignore_errors=True)
        stage.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    engine.save(stage.parent, tag)
    stage.mkdir(parents=True, exist_ok=True)
    torch.save({"rng": _rng_state(), "data": reader.state_dict()}, stage / f"client_rank{dist.rank}.pt")
    dist.barrier()
    if dist.is_main:
        client = {"step": step, "tokens": step * cfg.train.global_batch_tokens, "total_steps": total_steps,
                  "world_size": dist.world, "engine": dist.engine, "bad_in_row": bad_in_row,
                  "phase_index": phase_i if phases else None, "phase": phases[phase_i].name if phases else None,
                  "implicit": engine.module.config.implicit, "train_s": budget.elapsed_s(),
                  "train_config": cfg.to_dict()}
        (stage / "client.json").write_text(json.dumps(client, indent=1))
        engine.module.config.to_json_file(str(stage / "config.json"))
        ckpt_lib.write_manifest(stage, {"step": step, "engine": dist.engine, "world_size": dist.world})
        path = ckpt_lib.publish(root, tag, cfg.checkpoint.keep_last)
        logger.log({"event": "checkpoint", "step": step, "path": str(path),
                    "phase": client["phase"]})
    dist.barrier()
    return root / tag


def _resume(ckpt: Path, engine, reader, dist: Dist, cfg: TrainConfig) -> tuple[int, int, int]:
    client = json.loads((ckpt / "client.json").read_text())
    if client["world_size"] != dist.world:
        raise ValueError(f"checkpoint.resume: {ckpt} was written by {client['world_size']} ranks, this run has "
                         f"{dist.world}; resume with the same number of ranks")
    if client["engine"] != dist.engine:
        raise ValueError(f"checkpoint.resume: {ckpt} was written by the {client['engine']} engine, this run uses "
                         f"{dist.engine}; set train.engine={client['engine']}")
    rank_file = ckpt / f"client_rank{dist.rank}.pt"
    try:
        engine.load(ckpt)
        rank_state = torch.load(rank_file, weights_only=False)
    except ValueError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged file: say which checkpoint
        raise ValueError(f"checkpoint {ckpt} could not be loaded ({type(err).__name__}: {err}); it may be corrupt: "
                         "resume from an earlier one with checkpoint.resume=<path>") from None
    reader.load_state_dict(rank_state["data"])
    _set_rng_state(rank_state["rng"])
    phase = client.get("phase_index")
    return int(client["step"]), int(client.get("bad_in_row", 0)), -1 if phase is None else int(phase)
