"""The training loop: it wires the components and runs the steps.

    from lm.train import load_train_config, train
    summary = train(load_train_config("default", ["train.tokens=1e6"]))

A step = `accumulation` micro-batches per rank; global batch tokens = micro_batch_size * seq_len *
world_size * accumulation. Before each step the curriculum phase for the fraction of tokens already seen
is set on the model (model.set_solver); the LR comes from the schedule. A step whose loss or gradient is
not finite is skipped with a warning (parameters unchanged); `train.max_bad_steps` in a row stop the run,
leaving the last checkpoint intact. SIGTERM / SIGINT finish the step, checkpoint and raise Preempted.
On CUDA the loop reads each step's results (loss, skipped or not, gradient norm) after the next step is queued
(_one_behind), so the GPU never waits for the host between steps.

Components: distributed.py (ranks, device, engine kind), model.py (config, checks, model), data.py,
engine.py (torch / DeepSpeed), optim.py, schedule.py, curriculum.py, checkpoint.py (save / resume), resume.py (what
a resume may change, another number of ranks), rundir.py (run lock, metrics across restarts), preempt.py (signals),
evaluation.py, metrics.py (metrics.jsonl, MFU), console.py (the bar or step lines, messages), export.py.
Nothing in run_dir is written or renamed before the config (against the checkpoint's, on resume), the resume
checkpoint, the data and the model are checked and rank 0 holds the run's lock.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..host_copy import queue_to_host, read_host
from . import checkpoint as ckpt
from .budget import TimeBudget
from .config import TrainConfig
from .curriculum import curriculum_phases, phase_index, phase_start
from .data import build_data, build_task_data, to_model_inputs
from .distributed import Dist, resolve_auto_engine, shutdown  # noqa: F401  (re-exported)
from .engine import DeepSpeedEngine, TorchEngine, deepspeed_config
from .evaluation import Evaluator
from .console import Console
from .metrics import MetricsLogger, StepWindow, memory_gb
from .model import build_model, check_model_settings, load_model_config
from .optim import make_optimizer
from .preempt import Preempted, StopSignals
from .resume import check_config
from .rundir import RunLock, archive_metrics, truncate_metrics
from .schedule import lr_at, warmup_steps_of


class TrainingStopped(RuntimeError):
    """Raised when training cannot go on (e.g. too many non-finite steps in a row)."""


@dataclass
class Plan:
    """The run's batch arithmetic."""
    accumulation: int
    total_steps: int
    tokens_per_step: int

    @classmethod
    def of(cls, cfg: TrainConfig, world: int) -> "Plan":
        t, d = cfg.train, cfg.data
        per_micro = t.micro_batch_size * d.seq_len * world
        if t.global_batch_tokens % per_micro:
            raise ValueError(f"train.global_batch_tokens: {t.global_batch_tokens} is not a multiple of micro_batch_size"
                             f" * seq_len * world_size = {t.micro_batch_size} * {d.seq_len} * {world} = {per_micro}")
        total = t.steps if t.steps is not None else math.ceil(t.tokens / t.global_batch_tokens)
        return cls(t.global_batch_tokens // per_micro, total, t.global_batch_tokens)


def find_resume(cfg: TrainConfig, dist: Dist) -> Path | None:
    """The verified checkpoint to resume from (None: a fresh start); refuses a fresh start over checkpoints.
    Rank 0 re-reads and hashes the files; every rank gets its answer (or its error)."""
    run_dir = Path(cfg.run_dir)
    has_latest = ckpt.latest_tag(run_dir) is not None
    resume = cfg.checkpoint.resume
    if resume == "auto":  # continue when the run has a checkpoint (SLURM requeue), else start fresh
        resume = has_latest
    if not resume:
        if has_latest:
            raise ValueError(f"run_dir: {run_dir} already holds checkpoints of a run; continue it with --resume "
                             "(checkpoint.resume=true|auto) or choose another run_dir (nothing was changed)")
        return None
    found = dist.on_main(lambda: str(ckpt.resolve(run_dir if resume is True else resume)))
    return Path(found)


def _resumed_engine(cfg: TrainConfig) -> str | None:
    """The engine that wrote the checkpoint a resume will load (read before any process group exists, without
    hashing: find_resume verifies it), or None."""
    resume = cfg.checkpoint.resume
    if resume is False:
        return None
    try:
        found = ckpt.resolve(cfg.run_dir if resume in (True, "auto") else resume, hashes=False)
        return ckpt.read_client(found).get("engine")
    except (ValueError, OSError, KeyError):
        return None  # no checkpoint (or a broken one): find_resume says what is wrong


def build_run_data(cfg: TrainConfig, dist: Dist):
    """(train reader, make_val(n) -> batches, tokenizer or None, data vocabulary size)."""
    if cfg.data.source == "task":  # a synthetic task (lm.data.synthetic.source)
        return build_task_data(cfg, rank=dist.rank, world_size=dist.world)
    return build_data(cfg.data, seed=cfg.train.seed, micro_batch_size=cfg.train.micro_batch_size, rank=dist.rank,
                      world_size=dist.world)


def build_engine(cfg: TrainConfig, model, dist: Dist, plan: Plan, universal: bool = False):
    """The engine; `universal`: it loads a checkpoint of another number of ranks (lm.train.resume)."""
    t = cfg.train
    optimizer = make_optimizer(model, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                               weight_decay=cfg.optim.weight_decay, device=dist.device)
    if dist.engine == "deepspeed":
        ds_cfg = deepspeed_config(base=t.deepspeed_config, micro_batch_size=t.micro_batch_size,
                                  accumulation=plan.accumulation, world_size=dist.world,
                                  grad_clip=cfg.optim.grad_clip, precision=t.precision, zero_stage=t.zero_stage,
                                  universal=universal)
        return DeepSpeedEngine(model, optimizer, ds_cfg)
    return TorchEngine(model, optimizer, accumulation=plan.accumulation, grad_clip=cfg.optim.grad_clip,
                       precision=t.precision, device=dist.device)


def train(cfg: TrainConfig, *, hooks: dict | None = None) -> dict:
    """Train as configured; returns a summary dict (steps, tokens, final loss, val ppl, paths, sample).
    Raises Preempted after a SIGTERM/SIGINT checkpoint, TrainingStopped after too many bad steps, ValueError
    for what is wrong in the config, the data or the run folder.

    `hooks` (tests): {"after_forward": fn(step, micro, out) -> out} may replace a model output.
    """
    cfg.validate()
    t = cfg.train
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    model_config = load_model_config(cfg)  # the preset, read once
    phases = curriculum_phases(cfg.curriculum, model_config.model_type)
    check_model_settings(cfg, model_config, phases)
    dist = Dist(t, resumed_engine=_resumed_engine(cfg))
    plan = Plan.of(cfg, dist.world)
    resume_from = find_resume(cfg, dist)
    resumed = None
    if resume_from is not None:
        client = ckpt.read_client(resume_from)
        changes = check_config(resume_from, client, cfg)  # another model or data: refused here
        done = client["step"]
        if done >= plan.total_steps:
            return {"finished": True, "steps": done, "total_steps": plan.total_steps, "run_dir": cfg.run_dir,
                    "checkpoint": str(resume_from), "tokens": done * plan.tokens_per_step}
        ckpt.check_resumable(resume_from, dist)  # the same engine
        resumed = _Resumed(resume_from, changes, int(client["world_size"]),
                           ckpt.reshards(resume_from, client, dist))
    random.seed(t.seed)
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)
    data = build_run_data(cfg, dist)
    model = build_model(cfg, model_config, phases, data[3])

    lock = RunLock(cfg.run_dir)
    dist.on_main(lambda: bool(lock.acquire()))  # every rank gets rank 0's refusal, if any
    try:
        with StopSignals(cfg.run_dir) as signals:
            return _run(cfg, dist, plan, phases, model, data, resumed, signals, hooks or {})
    finally:
        lock.release()


@dataclass
class _Resumed:
    """The checkpoint a run resumes from: its path, the config changes since it (lines), the number of ranks that
    wrote it, and whether its ZeRO partitions are re-split for this number of ranks."""
    path: Path
    changes: list
    world_size: int
    reshard: bool


def _run(cfg: TrainConfig, dist: Dist, plan: Plan, phases, model, data, resumed, signals, hooks) -> dict:
    t = cfg.train
    resume_from = resumed.path if resumed is not None else None
    run_dir, root = Path(cfg.run_dir), ckpt.checkpoints_root(cfg.run_dir)
    train_reader, make_val, tokenizer, _ = data
    task_hook = None
    if cfg.data.source == "task":  # its evaluation per length and target-accuracy stop (lm.eval.synthetic)
        from lm.eval.synthetic import TaskEvalHook

        task_hook = TaskEvalHook(cfg, train_reader, run_dir, device=dist.device, is_main=dist.is_main)
        hooks = {**hooks, "after_forward": _chain(hooks.get("after_forward"), task_hook.after_forward)}
    model.to(dist.device)
    model.train()
    engine = build_engine(cfg, model, dist, plan, universal=resumed is not None and resumed.reshard)
    model = engine.module

    total_steps = plan.total_steps
    warmup = warmup_steps_of(cfg.schedule.warmup, total_steps)
    ds = cfg.schedule.decay_start
    decay_frac = phase_start(phases, len(phases) - 1) if ds == "last_phase" else float(ds)
    sched = dict(kind=cfg.schedule.kind, peak_lr=cfg.optim.lr, min_lr=cfg.schedule.min_lr, warmup_steps=warmup,
                 decay_start_step=int(round(decay_frac * total_steps)))

    step, bad_in_row, phase_i = 0, 0, -1
    budget = TimeBudget(t.max_minutes, t.stop_after_minutes)
    if resume_from is not None:
        client = ckpt.load(resume_from, engine=engine, reader=train_reader, dist=dist)
        step, bad_in_row = int(client["step"]), int(client.get("bad_in_row", 0))
        budget.resume(client.get("train_s", 0.0))
        phase_i = -1 if client.get("phase_index") is None else int(client["phase_index"])
        if phases and phase_i >= 0:
            model.set_solver(phases[phase_i].implicit)
    if dist.world > 1:  # the ranks decide on one clock: the mean of theirs, read with each step (_results)
        budget.agree(0.0)
    if dist.is_main:
        if resume_from is None:
            archive_metrics(run_dir)
        else:
            truncate_metrics(run_dir, step)
        (run_dir / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))

    logger = MetricsLogger(run_dir, enabled=dist.is_main,
                           wandb_cfg={"project": cfg.log.wandb_project} if cfg.log.wandb else None,
                           config=cfg.to_dict())
    n_params = sum(p.numel() for p in model.parameters())
    logger.log({"event": "start", "step": step, "total_steps": total_steps, "total_tokens": total_steps *
                plan.tokens_per_step, "accumulation": plan.accumulation, "world_size": dist.world,
                "engine": dist.engine, "device": str(dist.device), "params": n_params,
                "resumed_from": str(resume_from) if resume_from else None,
                **({"resumed_world_size": resumed.world_size, "config_changes": resumed.changes} if resumed else {})})
    progress = Console(total_steps, step, enabled=dist.is_main, progress=cfg.log.progress)
    if dist.is_main:
        progress.write(f"lm train: {model.config.model_type} {n_params / 1e6:.2f}M params, {total_steps} steps x "
                       f"{t.global_batch_tokens} tokens ({plan.accumulation} x {t.micro_batch_size} x "
                       f"{cfg.data.seq_len} x {dist.world} ranks), engine {dist.engine} on {dist.device}"
                       + (f", resumed at step {step}" if step else "")
                       + (f" (written by {resumed.world_size} ranks)" if resumed and resumed.world_size != dist.world
                          else ""))
        for line in resumed.changes if resumed else ():
            progress.write(f"changed since the checkpoint: {line}")
    evaluator = Evaluator(cfg.eval, model, make_val, tokenizer, dist, logger, progress, precision=t.precision,
                          seed=t.seed, tokens_per_step=plan.tokens_per_step)
    window = StepWindow(cfg.data.seq_len, plan.tokens_per_step, cfg.log.peak_flops, dist.world)

    def save(at: int) -> Path:
        client = {"step": at, "tokens": at * plan.tokens_per_step, "total_steps": total_steps,
                  "world_size": dist.world, "engine": dist.engine, "bad_in_row": st.bad_in_row,
                  "phase_index": phase_i if phases else None, "phase": phases[phase_i].name if phases else None,
                  "implicit": model.config.implicit.to_dict() if model.config.implicit is not None else None,
                  "train_s": budget.elapsed_s(), "train_config": cfg.to_dict()}
        path = ckpt.save(root, at, engine=engine, reader=train_reader, dist=dist, keep_last=cfg.checkpoint.keep_last,
                         client=client)
        logger.log({"event": "checkpoint", "step": at, "path": str(path), "phase": client["phase"]})
        return path

    stop_at = min(total_steps, t.stop_after_steps) if t.stop_after_steps else total_steps
    last_saved = step if resume_from is not None else -1
    st = _LoopState(bad_in_row=bad_in_row)
    stop_signal = None
    # why the loop ended before stop_at: "time budget" (complete) | "target accuracy" (complete) | "slice"
    stopped = "time budget" if budget.out_of_time() else None

    def finish(p: _Pending) -> bool:
        """Read step p's results (the host waits for its last kernel; the next step may already be queued
        behind it), count a skipped step, log; True when a signal asks every rank to stop."""
        nonlocal stopped
        loss_sum, nonfinite, n_micro, stops, applied, grad_norm, clock_s = _read_step(p)
        if dist.world == 1:  # a signal that came while the step ran stops after it (several ranks: a step later)
            stops = stops or signals.signal_name is not None
        else:
            budget.agree(clock_s / dist.world)
        now = time.perf_counter()
        window.add(_step_seconds(p, now, st.done_at), p.fp_stats)
        st.done_at = now
        step_loss = loss_sum / (n_micro - nonfinite) if n_micro > nonfinite else float("nan")
        p.skipped = (not applied) or nonfinite > 0
        if p.skipped:
            st.bad_in_row += 1
            _skipped(p.step, nonfinite, st.bad_in_row, t.max_bad_steps, dist, progress, logger, run_dir)
        else:
            st.bad_in_row = 0
            st.last_loss = step_loss
        if p.step % cfg.log.every_steps == 0 or p.step == stop_at or stops or p.last:
            rec = {"step": p.step, "tokens": p.step * plan.tokens_per_step, "loss": step_loss, "lr": p.lr,
                   "grad_norm": grad_norm, **window.record(model.config), "mem_gb": memory_gb(dist.device),
                   "skipped": p.skipped, **({"phase": p.phase} if p.phase else {})}
            if task_hook is not None:
                rec.update(task_hook.log_fields())
                if task_hook.reached_target(p.step):
                    stopped = "target accuracy"
            logger.log(rec)
            progress.step(p.step, rec)
        return bool(stops)

    one_behind = _one_behind(dist)
    pending = None
    while step < stop_at and not stopped:
        if phases:  # curriculum
            i = phase_index(phases, step / total_steps)
            if i != phase_i:
                model.set_solver(phases[i].implicit)
                if phase_i >= 0:
                    logger.log({"event": "phase_switch", "step": step, "tokens": step * plan.tokens_per_step,
                                "phase": phases[i].name, "implicit": phases[i].implicit.to_dict()})
                if dist.is_main:
                    progress.write(f"step {step}: curriculum phase {phases[i].describe()}")
                phase_i = i
        lr = lr_at(budget.schedule_step(step, total_steps, warmup), total_steps, **sched)
        t0 = time.perf_counter()
        # where the step's time starts on the device: the end of the step before it when that one was queued
        # straight ahead of this one, else a marker now
        start = pending.results[1] if pending is not None else _device_marker(dist.device)
        losses, fp_stats, (applied, grad_norm) = _step(engine, train_reader, plan.accumulation, dist, lr,
                                                       t.fused_loss, step, hooks)
        step += 1
        cur = _Pending(step, lr, t0, start, _results(losses, applied, grad_norm, dist, plan.accumulation,
                                                     signals.signal_name is not None, budget.clock_s()), fp_stats,
                       phases[phase_i].name if phases else None)
        stops = finish(pending) if pending is not None else False
        pending = cur
        stopped = stopped or ("time budget" if budget.out_of_time()
                              else "slice" if budget.slice_done() and step < stop_at else None)
        eval_due = bool(cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < stop_at)
        save_due = bool(cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < stop_at)
        hook_due = task_hook is not None and step % cfg.log.every_steps == 0
        if (not one_behind or stops or stopped or step >= stop_at or eval_due or save_due or hook_due
                or (dist.world == 1 and signals.signal_name is not None)):
            cur.last = bool(stops or stopped)
            pending = None
            stops = finish(cur) or stops
        if stops:
            stop_signal = signals.signal_name or "a signal on another rank"
            break
        if stopped:
            break
        if pending is not None:
            continue
        t_eval = time.perf_counter()
        if task_hook is not None and eval_due:
            task_hook.evaluate(model, step, logger)
        evaluator.periodic(step, stop_at)
        budget.exclude(time.perf_counter() - t_eval)  # evaluation is not charged to the training time
        if save_due and not cur.skipped:
            save(step)  # (none right after a skipped step: keep the last K good ones)
            last_saved = step
    last_loss = st.last_loss
    progress.close()

    summary = {"steps": step, "total_steps": total_steps, "tokens": step * plan.tokens_per_step,
               "final_loss": last_loss, "run_dir": str(run_dir)}
    if last_saved != step and (cfg.checkpoint.at_end or stop_signal):
        save(step)
        last_saved = step
    if last_saved == step:
        summary["checkpoint"] = str(root / ckpt.tag_of(step))
    if stop_signal and step < total_steps:  # (a signal in the last step: the run finishes, without final eval)
        logger.log({"event": "preempted", "step": step, "signal": stop_signal, "checkpoint": summary["checkpoint"]})
        logger.close()
        raise Preempted(f"stopped by {stop_signal} after step {step} of {total_steps}; checkpoint "
                        f"{summary['checkpoint']} written. Continue with the same command plus --resume "
                        "(checkpoint.resume=auto does it when there is a checkpoint).", summary)
    finished = step >= total_steps or stopped in ("time budget", "target accuracy")
    summary.update({"complete": finished, "stopped": stopped, "train_s": budget.elapsed_s()})
    if finished and cfg.checkpoint.export and last_saved == step:
        if dist.is_main:
            from .export import export_checkpoint

            out = export_checkpoint(root / ckpt.tag_of(step), run_dir / "hf")
            summary["export"] = str(out)
            logger.log({"event": "export", "step": step, "path": str(out)})
        dist.barrier()
    if finished and signals.signal_name is None:
        summary.update(evaluator.final(step))
    if task_hook is not None:
        summary.update(task_hook.finish(model, step, summary, logger, complete=finished, train_s=budget.elapsed_s()))
    logger.log({"event": "end", "step": step, **{k: v for k, v in summary.items() if k not in ("sample", "results")}})
    logger.close()
    return summary


def _one_behind(dist: Dist) -> bool:
    """Whether the loop reads each step's results one step late: step k's (loss, skipped or not, grad norm) after
    step k + 1 is queued, so that the device goes from one step into the next without waiting for the host (a
    host slower than the device in the forward catches up during the backward). Whatever needs a step's results
    or its parameters first (the log of a synthetic task, evaluation, a checkpoint, the end, a signal) reads them
    before the next step is queued. On CUDA only: on the CPU the host computes each step itself (nothing to
    overlap). With several ranks every rank reads and drains at the same steps: what decides (a stop signal on any
    rank, the time budget's clock) is all-reduced with the step's values (_results), so a signal stops the ranks
    one step later than in one process. With nothing in the step waiting for the device either, ZeRO-2 on 2 x H100
    trains Mamba2-350M at 1.00x the 1-GPU plain engine's tokens/s per GPU (docs/performance.md)."""
    return dist.device.type == "cuda"


@dataclass
class _LoopState:
    bad_in_row: int
    last_loss: float = float("nan")
    done_at: float = 0.0  # perf_counter when the last step's results were read


@dataclass
class _Pending:
    """A queued step whose results are not read yet: (values, event) of _results."""
    step: int
    lr: float
    t0: float
    start: "torch.cuda.Event | None"  # CUDA: where its time starts on the device (the loop)
    results: tuple
    fp_stats: list
    phase: str | None
    last: bool = False  # the loop ends after it: log it whatever the step
    skipped: bool = False


def _results(losses, applied, grad_norm, dist: Dist, n_micro: int, signalled: bool, clock_s: float) -> tuple:
    """A step's (sum of the finite micro losses, how many were not finite, micro-batches, ranks with a stop signal
    pending, the ranks' training clocks: each summed over the ranks; applied, grad norm: the same on every rank) as
    one float64 tensor, queued right behind the step: on CUDA copied to pinned host memory without waiting, with an
    event after the copy, so that reading it later waits for this step only, not for whatever was queued after it."""
    dev = losses.device

    def const(v):  # filled on the device: a tensor made from a Python number is a copy that waits for the stream
        return torch.full((), float(v), dtype=torch.float64, device=dev)

    finite = torch.isfinite(losses)
    summed = torch.stack([torch.where(finite, losses, torch.zeros_like(losses)).sum().double(),
                          (~finite).sum().double(), const(n_micro), const(signalled), const(clock_s)])
    dist.all_reduce_(summed)
    same = [v.to(dev, torch.float64) if isinstance(v, torch.Tensor) else const(v) for v in (applied, grad_norm)]
    return queue_to_host(torch.cat([summed, torch.stack(same)]))


def _device_marker(device) -> "torch.cuda.Event | None":
    """A timing event recorded on the device's current stream now (CUDA), else None."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _step_seconds(p: _Pending, now: float, last_read: float) -> float:
    """A step's time: on CUDA the device's, from p.start to its results' event (a step queued right behind the one
    before starts where that one ended, so time the device waited for the host between them counts, while the
    host's own wait to queue work never shifts a step's reading); on the CPU the host's, from its start or the
    read of the step before, whichever is later."""
    end = p.results[1]
    if end is not None and p.start is not None:
        return p.start.elapsed_time(end) / 1000.0
    return now - max(p.t0, last_read)


def _read_step(p: _Pending) -> tuple[float, float, float, bool, bool, float, float]:
    """The values of _results, once the step has run: (loss sum, non-finite count, micro-batches, stop, applied,
    grad norm, sum of the ranks' clocks)."""
    loss_sum, nonfinite, n_micro, stops, clock_s, applied, norm = read_host(p.results)
    return loss_sum, nonfinite, n_micro, stops > 0, bool(applied), norm, clock_s


def _step(engine, reader, accumulation: int, dist: Dist, lr: float, fused_loss: bool, step: int, hooks: dict):
    """One optimizer step over `accumulation` micro-batches: (micro losses, solver stats, (applied, grad_norm))."""
    losses, fp_stats, result = [], [], None
    for micro in range(accumulation):
        inputs = to_model_inputs(next(reader), dist.device)
        if fused_loss:
            inputs["fused_loss"] = True
        out = engine.forward(inputs)
        if "after_forward" in hooks:
            out = hooks["after_forward"](step, micro, out)
        losses.append(out.loss.detach().float())  # read after the step: no sync per micro-batch
        if out.fixed_point_stats is not None:  # (a lazy mapping: not looked into before the step is read)
            fp_stats.append(out.fixed_point_stats)
        engine.backward(out.loss)
        stacked = torch.stack(losses) if micro == accumulation - 1 else None
        result = engine.micro_end(stacked is not None, lr, losses=stacked)
    return stacked, fp_stats, result


def _chain(first, second):
    """Two after_forward hooks as one (either may be None)."""
    if first is None:
        return second
    return lambda step, micro, out: second(step, micro, first(step, micro, out))


def _skipped(step, nonfinite, bad_in_row, limit, dist, progress, logger, run_dir: Path) -> None:
    """Warn about a skipped step; raise TrainingStopped at `limit` skipped steps in a row."""
    why = "non-finite loss" if nonfinite else "non-finite gradient"
    msg = (f"warning: step {step} skipped ({why}; parameters unchanged), "
           f"{bad_in_row} in a row (limit train.max_bad_steps={limit})")
    progress.write(msg)  # rank 0, once, on its own line (metrics.jsonl gets the event)
    logger.log({"event": "skip", "step": step, "reason": why, "in_a_row": bad_in_row})
    if bad_in_row >= limit:
        logger.log({"event": "stopped", "step": step, "reason": f"{bad_in_row} non-finite steps in a row"})
        logger.close()
        progress.close()
        latest = ckpt.latest_tag(run_dir)
        if latest:
            kept = (f"the last checkpoint ({ckpt.checkpoints_root(run_dir) / latest}) is intact. Lower optim.lr or "
                    "optim.grad_clip, or check the data, then resume from it (--resume)")
        else:
            kept = ("no checkpoint was written, so there is nothing to resume. Lower optim.lr or optim.grad_clip, "
                    "or check the data, then start the run again (checkpoint.every_steps keeps checkpoints along "
                    "the way)")
        raise TrainingStopped(
            f"stopped at step {step}: {bad_in_row} steps in a row had a non-finite loss or gradient; {kept}.")
