"""The training loop: it wires the components and runs the steps.

    from lm.train import load_train_config, train
    summary = train(load_train_config("default", ["train.tokens=1e6"]))

A step = `accumulation` micro-batches per rank; global batch tokens = micro_batch_size * seq_len *
world_size * accumulation. Before each step the curriculum phase for the fraction of tokens already seen
is set on the model (model.set_solver); the LR comes from the schedule. A step whose loss or gradient is
not finite is skipped with a warning (parameters unchanged); `train.max_bad_steps` in a row stop the run,
leaving the last checkpoint intact. SIGTERM / SIGINT finish the step, checkpoint and raise Preempted.
On CUDA the loop reads each step's results (loss, skipped or not, gradient norm) after the next step is queued
(lm.train.step.one_behind), so the GPU never waits for the host between steps.

The loop (`_run`) goes over components with small interfaces: step.py (Stepper: the step through the engine, its
results read on the host), stopping.py (Stop: steps, time budget, slice, target accuracy, NaN policy, signals; why
the run stopped), metrics.py (StepLog: step records and skip warnings; metrics.jsonl, MFU), curriculum.py
(Curriculum: the phase and its solver settings), schedule.py (RunSchedule: the LR), evaluation.py (Evaluator),
checkpointer.py (Checkpointer: when to save, the client state), synth.py (task_component: a synthetic task's
accuracy, evaluation and target, or NoTask). Built before it: distributed.py (ranks, device, engine kind), model.py
(config, checks, model), data.py, engine.py (torch / DeepSpeed), optim.py, checkpoint.py (checkpoint folders),
resume.py (what a resume may change, another number of ranks), rundir.py (run lock, metrics across restarts),
preempt.py (signals), console.py (the bar or step lines, messages), export.py.
Nothing in run_dir is written or renamed before the config (against the checkpoint's, on resume), the resume
checkpoint, the data and the model are checked and rank 0 holds the run's lock.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import checkpoint as ckpt
from .budget import TimeBudget
from .checkpointer import Checkpointer
from .config import TrainConfig
from .console import Console
from .context_parallel import ContextGroups, check_context_parallel
from .curriculum import Curriculum, curriculum_phases
from .data import build_data, build_task_data
from .distributed import Dist, resolve_auto_engine, shutdown  # noqa: F401  (re-exported)
from .engine import DeepSpeedEngine, TorchEngine, deepspeed_config
from .evaluation import Evaluator
from .length_warmup import LengthWarmup, parse_stages
from .metrics import MetricsLogger, StepLog, StepWindow
from .model import build_model, check_model_settings, load_model_config
from .optim import make_optimizer
from .preempt import Preempted, StopSignals
from .resume import check_config
from .rundir import RunLock, archive_metrics, truncate_metrics
from .schedule import RunSchedule
from .step import Stepper
from .stopping import Stop, TrainingStopped  # noqa: F401  (TrainingStopped re-exported)
from .synth import task_component


@dataclass
class Plan:
    """The run's batch arithmetic."""
    accumulation: int
    total_steps: int
    tokens_per_step: int

    @classmethod
    def of(cls, cfg: TrainConfig, world: int) -> "Plan":
        """`world`: the data-parallel ranks (the world size / train.context_parallel: a context group's ranks share
        their sequences)."""
        t, d = cfg.train, cfg.data
        per_micro = t.micro_batch_size * d.seq_len * world
        ranks = "world_size" if t.context_parallel == 1 else "(world_size / context_parallel)"
        if t.global_batch_tokens % per_micro:
            raise ValueError(f"train.global_batch_tokens: {t.global_batch_tokens} is not a multiple of micro_batch_size"
                             f" * seq_len * {ranks} = {t.micro_batch_size} * {d.seq_len} * {world} = {per_micro}")
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


def build_run_data(cfg: TrainConfig, groups: ContextGroups, total_steps: int):
    """(train reader, make_val(n) -> batches, tokenizer or None, data vocabulary size). The training reader cuts its
    rows to the sequence-length warm-up's stage (LengthWarmup, `enter(step)`); with context parallelism the readers
    of a context group's ranks read the same batches and each yields its slice (`groups`)."""
    if cfg.data.source == "task":  # a synthetic task (lm.data.synthetic.source)
        return build_task_data(cfg, rank=groups.data_rank, world_size=groups.data_world)
    train, make_val, tokenizer, vocab = build_data(cfg.data, seed=cfg.train.seed,
                                                   micro_batch_size=cfg.train.micro_batch_size,
                                                   rank=groups.data_rank, world_size=groups.data_world)
    stages = parse_stages(cfg.data.seq_len_warmup, cfg.data.seq_len, cfg.train.context_parallel)
    train = LengthWarmup(train, stages, cfg.data.seq_len, total_steps)
    return groups.reader(train), groups.val(make_val), tokenizer, vocab


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
    check_context_parallel(cfg)
    dist = Dist(t, resumed_engine=_resumed_engine(cfg))
    groups = ContextGroups(t.context_parallel, dist.world, dist.rank)
    plan = Plan.of(cfg, groups.data_world)
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
    data = build_run_data(cfg, groups, plan.total_steps)
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
    """The loop over the run's components (_Run): each step's curriculum phase and LR, the step, its record and stop
    conditions, then evaluation and a checkpoint where due; one stop path (lm.train.stopping.Stop) ends it."""
    r = _Run(cfg, dist, plan, phases, model, data, resumed, signals, hooks)
    step, stop, stepper = r.step, r.stop, r.stepper
    while step < stop.at and not stop.now:
        r.curriculum.enter(step)
        r.enter_length(step)
        queued = stepper.queue(step, r.schedule.lr(step), r.curriculum.phase)
        step += 1
        behind, stepper.behind = stepper.behind, None
        if behind is not None:  # the step before, read now that this one is queued behind it
            r.read(behind)
            if stop.failed:
                break
        stop.check_time(step)
        periodic = r.evaluator.due(step, stop.at) or r.checkpoints.due(step, stop.at)
        if (stepper.one_behind and not stop.now and step < stop.at and not periodic and not r.log.due(step)
                and not stop.signal_local()):
            stepper.behind = queued  # nothing needs its results or its parameters yet: read after the next step
            continue
        res = r.read(queued, last=stop.now)
        if stop.now:
            break
        with r.budget.paused():  # evaluation is not charged to the training time
            r.evaluator.periodic(step, stop.at)
        if r.checkpoints.due(step, stop.at) and not res.skipped:  # (after a skipped step: keep the last K good ones)
            r.checkpoints.save(step)
    return r.finish(step)


class _Run:
    """The components of a run, wired: the engine (resumed from a checkpoint), the curriculum, the LR schedule, the
    stepper, the stop conditions, the step log, evaluation, checkpoints and the task component (a synthetic task's, or
    NoTask); `finish` is the end of the run."""

    def __init__(self, cfg: TrainConfig, dist: Dist, plan: Plan, phases, model, data, resumed, signals, hooks):
        t = cfg.train
        self.cfg, self.dist, self.plan, self.signals = cfg, dist, plan, signals
        self.run_dir, self.total_steps = Path(cfg.run_dir), plan.total_steps
        reader, make_val, tokenizer, _ = data
        self.task = task_component(cfg, reader, self.run_dir, dist)
        self.lengths = reader if cfg.data.source != "task" else None  # (LengthWarmup, or ShardedReader over one)
        model.to(dist.device)
        model.train()
        engine = build_engine(cfg, model, dist, plan, universal=resumed is not None and resumed.reshard)
        self.model = model = engine.module
        self.budget = budget = TimeBudget(t.max_minutes, t.stop_after_minutes)
        client = ckpt.load(resumed.path, engine=engine, reader=reader, dist=dist) if resumed is not None else {}
        self.step = int(client.get("step", 0))
        budget.resume(client.get("train_s", 0.0))
        if dist.world > 1:  # the ranks decide on one clock: the mean of theirs, read with each step (lm.train.step)
            budget.agree(0.0)
        if dist.is_main:
            if resumed is None:
                archive_metrics(self.run_dir)
            else:
                truncate_metrics(self.run_dir, self.step)
            (self.run_dir / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        self.logger = logger = MetricsLogger(self.run_dir, enabled=dist.is_main, config=cfg.to_dict(),
                                             wandb_cfg={"project": cfg.log.wandb_project} if cfg.log.wandb else None)
        self.console = console = Console(plan.total_steps, self.step, enabled=dist.is_main, progress=cfg.log.progress)
        _announce(cfg, dist, plan, model, resumed, self.step, logger, console)
        self.curriculum = Curriculum(phases, model, total_steps=plan.total_steps, tokens_per_step=plan.tokens_per_step,
                                     logger=logger, console=console)
        self.curriculum.resume(client.get("phase_index"))
        self.schedule = RunSchedule(cfg, plan.total_steps, phases, budget)
        self.stop = Stop(at=min(plan.total_steps, t.stop_after_steps) if t.stop_after_steps else plan.total_steps,
                         budget=budget, signals=signals, dist=dist, max_bad_steps=t.max_bad_steps,
                         bad_in_row=int(client.get("bad_in_row", 0)))
        self.stepper = Stepper(engine, reader, dist, accumulation=plan.accumulation, fused_loss=t.fused_loss,
                               signals=signals, budget=budget,
                               after_forward=_chain(hooks.get("after_forward"), self.task.after_forward))
        window = StepWindow(cfg.data.seq_len, plan.tokens_per_step, cfg.log.peak_flops, dist.world)
        self.log = StepLog(every=cfg.log.every_steps, window=window, model=model, logger=logger, console=console,
                           device=dist.device, task=self.task, tokens_per_step=plan.tokens_per_step,
                           max_bad_steps=t.max_bad_steps, live=cfg.data.source == "task")
        self.evaluator = Evaluator(cfg.eval, model, make_val, tokenizer, dist, logger, console, precision=t.precision,
                                   seed=t.seed, tokens_per_step=plan.tokens_per_step, task=self.task)
        self.checkpoints = Checkpointer(cfg, total_steps=plan.total_steps, tokens_per_step=plan.tokens_per_step,
                                        engine=engine, reader=reader, dist=dist, logger=logger, state=self._state,
                                        last_saved=self.step if resumed is not None else -1)

    def enter_length(self, step: int) -> None:
        """Before step `step` + 1: the sequence-length warm-up's stage (data.seq_len_warmup), logged where it
        changes."""
        length = self.lengths.enter(step) if self.lengths is not None else None
        if length is not None:
            self.logger.log({"event": "seq_len", "step": step, "seq_len": length})
            self.console.write(f"step {step}: sequences of {length} tokens")

    def _state(self) -> dict:
        """The loop's part of a checkpoint's client.json."""
        implicit = self.model.solver
        return {"bad_in_row": self.stop.bad_in_row, **self.curriculum.client(),
                "implicit": implicit.to_dict() if implicit is not None else None, "train_s": self.budget.elapsed_s()}

    def read(self, queued, last: bool = False):
        """A queued step's results: the stop conditions read them, then the step log."""
        res = self.stepper.read(queued)
        self.stop.read(res)
        self.log.step(res, self.stop, last=last)
        return res

    def finish(self, step: int) -> dict:
        """The end of the run: a failed run raises TrainingStopped; else the last checkpoint (checkpoint.at_end, or a
        signal), Preempted after a signal before the last step, else the export, the final evaluation and the
        task's results. Returns the summary."""
        cfg, dist, stop, logger, ck = self.cfg, self.dist, self.stop, self.logger, self.checkpoints
        if stop.failed:
            logger.log({"event": "stopped", "step": stop.failed_at,
                        "reason": f"{stop.bad_in_row} non-finite steps in a row"})
            logger.close()
            self.console.close()
            raise stop.failure(self.run_dir)
        self.console.close()
        summary = {"steps": step, "total_steps": self.total_steps, "tokens": step * self.plan.tokens_per_step,
                   "final_loss": self.log.last_loss, "run_dir": str(self.run_dir)}
        if ck.last_saved != step and (cfg.checkpoint.at_end or stop.signal):
            ck.save(step)
        if ck.last_saved == step:
            summary["checkpoint"] = str(ck.path_of(step))
        if stop.signal and step < self.total_steps:  # (a signal in the last step: the run finishes, without final eval)
            name = stop.signal_name()
            logger.log({"event": "preempted", "step": step, "signal": name, "checkpoint": summary["checkpoint"]})
            logger.close()
            raise Preempted(f"stopped by {name} after step {step} of {self.total_steps}; checkpoint "
                            f"{summary['checkpoint']} written. Continue with the same command plus --resume "
                            "(checkpoint.resume=auto does it when there is a checkpoint).", summary)
        finished = stop.complete(step, self.total_steps)
        summary.update({"complete": finished, "stopped": stop.summary_reason(), "train_s": self.budget.elapsed_s()})
        if finished and cfg.checkpoint.export and ck.last_saved == step:
            if dist.is_main:
                from .export import export_checkpoint

                out = export_checkpoint(ck.path_of(step), self.run_dir / "hf")
                summary["export"] = str(out)
                logger.log({"event": "export", "step": step, "path": str(out)})
            dist.barrier()
        if finished and self.signals.signal_name is None:
            summary.update(self.evaluator.final(step))
        summary.update(self.task.finish(self.model, step, summary, logger, complete=finished,
                                        train_s=self.budget.elapsed_s()))
        logger.log({"event": "end", "step": step,
                    **{k: v for k, v in summary.items() if k not in ("sample", "results")}})
        logger.close()
        return summary


def _announce(cfg: TrainConfig, dist: Dist, plan: Plan, model, resumed, step: int, logger, console) -> None:
    """The run's "start" event and its first console lines (the run, the config changes of a resume)."""
    n_params = sum(p.numel() for p in model.parameters())
    logger.log({"event": "start", "step": step, "total_steps": plan.total_steps, "total_tokens": plan.total_steps *
                plan.tokens_per_step, "accumulation": plan.accumulation, "world_size": dist.world,
                "context_parallel": cfg.train.context_parallel, "engine": dist.engine, "device": str(dist.device), "params": n_params,
                "resumed_from": str(resumed.path) if resumed else None,
                **({"resumed_world_size": resumed.world_size, "config_changes": resumed.changes} if resumed else {})})
    t = cfg.train
    console.write(f"lm train: {model.config.model_type} {n_params / 1e6:.2f}M params, {plan.total_steps} steps x "
                  f"{t.global_batch_tokens} tokens ({plan.accumulation} x {t.micro_batch_size} x {cfg.data.seq_len} x "
                  f"{dist.world // t.context_parallel} ranks"
                  + (f", each sequence over {t.context_parallel} context ranks" if t.context_parallel > 1 else "")
                  + f"), engine {dist.engine} on {dist.device}" + (f", resumed at step {step}" if step else "")
                  + (f" (written by {resumed.world_size} ranks)" if resumed and resumed.world_size != dist.world
                     else ""))
    for line in resumed.changes if resumed else ():
        console.write(f"changed since the checkpoint: {line}")


def _chain(first, second):
    """Two after_forward hooks as one (either may be None)."""
    if first is None:
        return second
    return lambda step, micro, out: second(step, micro, first(step, micro, out))
