"""The training config: one typed, validated tree read from YAML plus `key=value` overrides.

    cfg = load_train_config("configs/train/default.yaml", ["train.tokens=2e6", "optim.lr=1e-3"])

Sections: model, data, optim, schedule, curriculum, train, checkpoint, log, eval, task (data.source=task)
(+ run_dir). Every key is declared below with its type and default; an unknown key, a wrong type or an
out-of-range value is a ValueError naming the dotted field (e.g. `train.micro_batch_size`). Overrides use dotted paths and
YAML values (`curriculum=paper`, `model.overrides={hidden_size: 256}`, `train.tokens=1e6`).
Solver settings are typed when read: `model.implicit` becomes an ImplicitSettings and a curriculum list
a list of Phase (each with its ImplicitSettings), the objects the model's `set_solver` takes (they are set in
these two places only: `model.overrides.implicit` is refused). The model holds the active settings and hands them
to the solver (ImplicitSettings.solve_args); FP-Mamba's per-layer solve takes the same type from its config's
`layer_solver` (model.overrides).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from lm.models.config import ImplicitSettings

from ..resources import config_path
from .curriculum import parse_curriculum
from .length_warmup import parse_stages


def _implicit(value):
    try:
        return ImplicitSettings.from_value(value)
    except ValueError as err:
        raise ValueError(f"model.{err}") from None


@dataclasses.dataclass
class ModelSection:
    preset: str = "lm_mamba2-tiny"          # preset name (configs/models) or a config.json path / HF folder
    overrides: dict = dataclasses.field(default_factory=dict)  # model config fields, e.g. {hidden_size: 256}
    # solver settings when there is no curriculum (None: those of the preset, explicit when it has none)
    implicit: Union[ImplicitSettings, None] = dataclasses.field(default=None, metadata={"parse": _implicit})
    init_from: Union[str, None] = None       # an HF folder (lm export output) to start from
    activation_checkpointing: bool = False   # model.gradient_checkpointing_enable()
    compile: bool = False                    # torch.compile each block (a Mamba2 block: one graph)


@dataclasses.dataclass
class DataSection:
    source: str = "shards"                   # "shards" (lm prepare-data output), "synthetic" (benchmarks) or
                                             # "task" (a synthetic task of lm.data.synthetic: the `task` section)
    path: str = "data/shakespeare"
    seq_len: int = 256
    tokenizer: Union[str, None] = None       # None: the shipped default (must match the shards)
    # pass document boundaries (packed varlen) to the model: the micro-batch becomes one (1, B*T) row, so
    # an implicit model's tolerance-stopped solve then judges convergence over the whole micro-batch
    cu_seqlens: bool = False
    synthetic_vocab: int = 256               # synthetic source: token ids drawn from [0, synthetic_vocab)
    # sequence-length warm-up: [{until: 0.02, seq_len: 2048}, ...] trains rows of seq_len tokens cut into rows of
    # the stage's length while the fraction of steps done is below `until` (lm.train.length_warmup)
    seq_len_warmup: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class OptimSection:
    lr: float = 3e-3
    betas: list = dataclasses.field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1                # none on norms, biases and params marked _no_weight_decay
    grad_clip: float = 1.0                   # 0 = off


@dataclasses.dataclass
class ScheduleSection:
    kind: str = "cosine"                     # cosine | wsd | constant_sqrt | constant
    warmup: float = 0.01                     # < 1: fraction of the steps; >= 1: steps
    min_lr: float = 1e-5
    decay_start: Union[float, str] = 0.8     # wsd/constant_sqrt: fraction where the cooldown starts, or "last_phase"


@dataclasses.dataclass
class TrainSection:
    tokens: Union[int, float, None] = None   # training tokens (steps = ceil(tokens / global_batch_tokens))
    steps: Union[int, None] = None           # or the number of optimizer steps
    global_batch_tokens: int = 8192          # = micro_batch_size * seq_len * world_size * accumulation
    micro_batch_size: int = 8
    precision: str = "fp32"                  # bf16 | fp32
    engine: str = "auto"                     # auto (deepspeed for several ranks or a deepspeed_config, else torch) | deepspeed | torch
    zero_stage: int = 2
    deepspeed_config: Union[str, None] = None  # a base DeepSpeed json; batch/clip/precision/zero are set from here
    device: str = "auto"                     # auto | cpu | cuda
    seed: int = 0
    max_bad_steps: int = 5                   # stop after this many non-finite steps in a row
    stop_after_steps: Union[int, None] = None  # stop early (the schedule still spans all steps)
    num_threads: Union[int, None] = None     # torch.set_num_threads on CPU
    fused_loss: bool = True                  # LM-head cross-entropy in token chunks: no (tokens x vocab) logits held
    # ranks that share each sequence, each holding a contiguous slice of it (lm.train.context_parallel): the
    # world is context_parallel x data-parallel ranks; 1 = off
    context_parallel: int = 1
    # wall-clock budget of the training (evaluation time not counted): the LR schedule then runs on
    # max(step, steps * elapsed / budget), so its decay ends when the first of the two budgets runs out
    max_minutes: Union[float, None] = None
    # stop this process after that much training and save a checkpoint: a run longer than one allocation
    # goes on in slices (resume it; the schedule counts the training time of every slice)
    stop_after_minutes: Union[float, None] = None


@dataclasses.dataclass
class CheckpointSection:
    every_steps: int = 0                     # 0: only at the end
    keep_last: int = 2
    resume: Union[bool, str] = False         # true: the run's latest checkpoint; "auto": it if any; or a path
    export: bool = True                      # HF export (run_dir/hf) at the end
    at_end: bool = True                      # checkpoint at the end (false: benchmarks)
    # keys (or sections) a resume may change although they define the run (lm.train.resume.FIXED): e.g.
    # [data.path] after the shards moved; `lm train --allow-change KEY`
    allow_change: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class LogSection:
    every_steps: int = 1
    progress: bool = True                    # tqdm bar on rank 0
    wandb: bool = False                      # optional; offline unless WANDB_MODE says otherwise
    wandb_project: str = "lm"
    peak_flops: float = 989e12               # per device, for MFU (H100 bf16 dense)


@dataclasses.dataclass
class EvalSection:
    every_steps: int = 0                     # held-out loss every N steps (0: only at the end)
    batches: int = 8                         # validation batches per evaluation (per rank)
    at_end: bool = True
    sample_prompt: str = "ROMEO:"
    sample_tokens: int = 48                  # 0: no sample
    # lm-eval-harness tasks run in process at every_steps (when > 0) and at the end; results logged
    tasks: str | list = ""                   # e.g. "lambada_openai,hellaswag" or a YAML list; "" = none
    tasks_limit: int | None = None           # examples per task (None = all)
    tasks_batch_size: int = 16
    include_path: str | None = None          # folder of extra task YAMLs (lm.eval.local_tasks)
    num_fewshot: int = 0

    @property
    def task_list(self) -> list[str]:
        items = self.tasks.split(",") if isinstance(self.tasks, str) else self.tasks
        return [str(t).strip() for t in items if str(t).strip()]


@dataclasses.dataclass
class TaskSection:
    """data.source=task: a synthetic task (lm.data.synthetic.registry.TASKS) as the training data, evaluated
    per length (lm.eval.synthetic: RUN/results.json + accuracy_per_length.png) at eval.every_steps and the end."""
    name: Union[str, None] = None            # e.g. word_problem, parity, mad_compression
    run_name: Union[str, None] = None        # the run's label in results.json and plots (None: run_dir's name)
    params: dict = dataclasses.field(default_factory=dict)  # the task's parameters, e.g. {group: S5}
    lengths: Union[list, None] = None        # [min, max] training lengths, one drawn per batch (None: the task's)
    examples: Union[int, None] = None        # None: fresh batches; N: a fixed training set of N sequences
    prefetch: int = 0                        # batches made ahead in a background thread (GPU runs)
    target_accuracy: Union[float, None] = None  # stop once the running training accuracy reaches it (log steps)
    eval_lengths: Union[list, None] = None   # None: the task's
    eval_examples: int = 512                 # sequences per evaluated length (a fixed set, seeded by eval_seed)
    eval_batch_size: int = 256
    eval_seed: int = 12345
    eval_params: dict = dataclasses.field(default_factory=dict)  # task parameters changed for evaluation
                                             # (e.g. {p: 0.5}: the training distribution is then evaluated too)


@dataclasses.dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    optim: OptimSection = dataclasses.field(default_factory=OptimSection)
    schedule: ScheduleSection = dataclasses.field(default_factory=ScheduleSection)
    # None, "paper", or a list of phases {name, until, implicit} (read into a list of curriculum.Phase)
    curriculum: Union[str, list, None] = dataclasses.field(default=None, metadata={"parse": parse_curriculum})
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    log: LogSection = dataclasses.field(default_factory=LogSection)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    task: TaskSection = dataclasses.field(default_factory=TaskSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        validate(self)


# ------------------------------------------------------------------------------------------ parsing


def _type_ok(value: Any, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp in (list, dict, str):
        return isinstance(value, tp)
    return True


def _type_name(tp) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _build(cls, data: Any, prefix: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ValueError(f"unknown config key(s) {[where + k for k in unknown]}; valid keys{' in ' + prefix if prefix else ''}: "
                         f"{sorted(fields)}")
    kwargs = {}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, path)
            continue
        parse = fields[name].metadata.get("parse")
        if parse is not None:
            value = parse(value)
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not _type_ok(value, tp):
            raise ValueError(f"{path}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
        kwargs[name] = value
    return cls(**kwargs)


def _parse_value(text: str) -> Any:
    v = yaml.safe_load(text) if text.strip() else ""
    if isinstance(v, str):  # YAML reads 1e6 as a string
        try:
            f = float(v)
            return int(f) if f.is_integer() and "e" in v.lower() else f
        except ValueError:
            pass
    return v


def apply_override(tree: dict, item: str) -> None:
    """Set `a.b.c=value` in a nested dict (value parsed as YAML)."""
    if "=" not in item:
        raise ValueError(f"override {item!r}: expected key=value (e.g. train.tokens=1e6)")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    node = tree
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {} if node.get(p) is None else node[p]
            if not isinstance(node[p], dict):
                raise ValueError(f"override {item!r}: {p} is not a section")
        node = node[p]
    try:
        node[parts[-1]] = _parse_value(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(
            f"override {item!r}: the value {text!r} is not valid YAML ({problem}). Values are read as YAML: "
            "close every bracket and quote, and quote the whole item for the shell, e.g. "
            "'model.overrides={hidden_size: 256}'") from None


def _numbers(tree: Any) -> Any:
    """YAML 1.1 reads `1e6` as a string: turn such strings into numbers."""
    if isinstance(tree, dict):
        return {k: _numbers(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_numbers(v) for v in tree]
    if isinstance(tree, str):
        return _parse_value(tree) if _looks_numeric(tree) else tree
    return tree


def _looks_numeric(s: str) -> bool:
    try:
        float(s)
        return s.strip().lower() not in ("nan", "inf", "-inf", "infinity")
    except ValueError:
        return False


def read_tree(path: str | Path, kind: str, what: str) -> dict:
    """The YAML mapping of a file, or of a packaged config of `kind` by name (lm.resources.config_path)."""
    try:
        p = config_path(path, kind)
    except FileNotFoundError as err:
        raise ValueError(f"{what}: {err}") from None
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{p}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{p}: expected a mapping at the top level")
    return tree


def load_train_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    tree = _numbers(read_tree(path, "train", "training config")) if path is not None else {}
    for item in overrides or []:
        apply_override(tree, item)
    cfg = _build(TrainConfig, tree, "")
    validate(cfg)
    return cfg


def config_from_dict(tree: dict) -> TrainConfig:
    cfg = _build(TrainConfig, _numbers(tree), "")
    validate(cfg)
    return cfg


# ---------------------------------------------------------------------------------------- validation


def _validate_task(cfg: TrainConfig) -> None:
    """The task section (data.source=task); the data's sequence length is the longest training length."""
    from ..data.synthetic.registry import build_task

    k = cfg.task
    _need(bool(k.name), "task.name", "missing: one of the registered tasks (lm synth --list-tasks)", k.name)
    try:
        task = build_task(k.name, **k.params)
        build_task(k.name, **{**k.params, **k.eval_params})
    except ValueError as err:
        raise ValueError(f"task: {err}") from None
    lengths = k.lengths if k.lengths is not None else list(task.train_lengths)
    _need(len(lengths) == 2 and all(isinstance(n, int) for n in lengths) and 1 <= lengths[0] <= lengths[1],
          "task.lengths", "must be [min, max] with 1 <= min <= max", k.lengths)
    _need(k.examples is None or k.examples >= 1, "task.examples", "must be null or >= 1", k.examples)
    _need(k.examples is None or lengths[0] == lengths[1], "task.examples",
          "a fixed training set needs one training length (task.lengths [n, n])", k.lengths)
    _need(k.prefetch >= 0, "task.prefetch", "must be >= 0", k.prefetch)
    if k.target_accuracy is not None:
        _need(0 < k.target_accuracy <= 1, "task.target_accuracy", "must be null or in (0, 1]", k.target_accuracy)
        _need(not cfg.train.fused_loss, "task.target_accuracy",
              "needs the logits: set train.fused_loss=false", cfg.train.fused_loss)
    _need(k.eval_lengths is None or (len(k.eval_lengths) > 0 and all(isinstance(n, int) and n >= 1
                                                                     for n in k.eval_lengths)),
          "task.eval_lengths", "must be null or a non-empty list of lengths >= 1", k.eval_lengths)
    _need("name" not in k.eval_params, "task.eval_params", "takes task parameters, not the name", k.eval_params)
    _need(k.eval_examples >= 1, "task.eval_examples", "must be >= 1", k.eval_examples)
    _need(k.eval_batch_size >= 1, "task.eval_batch_size", "must be >= 1", k.eval_batch_size)
    _need(cfg.data.seq_len == lengths[1], "data.seq_len",
          f"must be the longest training length {lengths[1]} with data.source=task (`lm synth` sets it)",
          cfg.data.seq_len)


def _need(cond: bool, field: str, why: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"{field}: {why} (got {value!r})")


def validate(cfg: TrainConfig) -> None:
    d, o, s, t, c, lg, e = cfg.data, cfg.optim, cfg.schedule, cfg.train, cfg.checkpoint, cfg.log, cfg.eval
    _need(d.source in ("shards", "synthetic", "task"), "data.source", "must be 'shards', 'synthetic' or 'task'",
          d.source)
    _need(d.seq_len >= 1, "data.seq_len", "must be >= 1", d.seq_len)
    _need(d.synthetic_vocab >= 2, "data.synthetic_vocab", "must be >= 2", d.synthetic_vocab)
    _need(o.lr > 0, "optim.lr", "must be > 0", o.lr)
    _need(len(o.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas),
          "optim.betas", "must be two numbers in [0, 1)", o.betas)
    _need(o.eps > 0, "optim.eps", "must be > 0", o.eps)
    _need(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0", o.weight_decay)
    _need(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 = off)", o.grad_clip)
    _need(s.kind in ("cosine", "wsd", "constant_sqrt", "constant"), "schedule.kind",
          "must be cosine, wsd, constant_sqrt or constant", s.kind)
    _need(s.warmup >= 0, "schedule.warmup", "must be >= 0 (a fraction < 1 or a number of steps)", s.warmup)
    _need(0 <= s.min_lr <= o.lr, "schedule.min_lr", f"must be in [0, optim.lr={o.lr}]", s.min_lr)
    if isinstance(s.decay_start, str):
        _need(s.decay_start == "last_phase", "schedule.decay_start", "must be a fraction in [0, 1] or 'last_phase'",
              s.decay_start)
        _need(cfg.curriculum is not None, "schedule.decay_start", "'last_phase' needs a curriculum", s.decay_start)
    else:
        _need(0 <= s.decay_start <= 1, "schedule.decay_start", "must be a fraction in [0, 1] or 'last_phase'",
              s.decay_start)
    if t.tokens is not None and t.steps is not None:  # e.g. train.steps=N over a recipe that sets train.tokens
        raise ValueError(f"train.steps: both train.steps={t.steps} and train.tokens={t.tokens} are set (a recipe "
                         "sets one of them); the run's length is one of the two: add train.tokens=null to train "
                         f"{t.steps} steps, or train.steps=null to train {t.tokens} tokens")
    _need(t.tokens is not None or t.steps is not None, "train.tokens",
          "set one of train.tokens and train.steps (the run's length)", (t.tokens, t.steps))
    if t.tokens is not None:
        _need(t.tokens > 0 and math.isfinite(t.tokens), "train.tokens", "must be > 0", t.tokens)
    if t.steps is not None:
        _need(t.steps >= 1, "train.steps", "must be >= 1", t.steps)
    _need(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1", t.micro_batch_size)
    _need(t.context_parallel >= 1, "train.context_parallel", "must be >= 1 (1 = off)", t.context_parallel)
    if d.seq_len_warmup:
        _need(d.source != "task", "data.seq_len_warmup", "takes rows of data.seq_len tokens: not with data.source=task "
              "(its batches have their own lengths)", d.seq_len_warmup)
        parse_stages(d.seq_len_warmup, d.seq_len, t.context_parallel)
    _need(t.global_batch_tokens >= 1, "train.global_batch_tokens", "must be >= 1", t.global_batch_tokens)
    _need(t.precision in ("bf16", "fp32"), "train.precision", "must be bf16 or fp32", t.precision)
    _need(t.engine in ("auto", "deepspeed", "torch"), "train.engine", "must be auto, deepspeed or torch", t.engine)
    _need(t.zero_stage in (0, 1, 2, 3), "train.zero_stage", "must be 0, 1, 2 or 3", t.zero_stage)
    _need(t.device in ("auto", "cpu", "cuda"), "train.device", "must be auto, cpu or cuda", t.device)
    _need(t.max_bad_steps >= 1, "train.max_bad_steps", "must be >= 1", t.max_bad_steps)
    if t.stop_after_steps is not None:
        _need(t.stop_after_steps >= 1, "train.stop_after_steps", "must be >= 1", t.stop_after_steps)
    if t.num_threads is not None:
        _need(t.num_threads >= 1, "train.num_threads", "must be >= 1", t.num_threads)
    _need(c.every_steps >= 0, "checkpoint.every_steps", "must be >= 0 (0 = only at the end)", c.every_steps)
    _need(c.keep_last >= 1, "checkpoint.keep_last", "must be >= 1", c.keep_last)
    from .resume import FIXED, NEVER

    for key in c.allow_change:
        _need(isinstance(key, str) and not any(key == n or n.startswith(key + ".") for n in NEVER),
              "checkpoint.allow_change", f"takes dotted config keys; {', '.join(NEVER)} never changes in a run "
              "(start a new run from its weights instead)", c.allow_change)
        _need(any(f == key or f.startswith(key + ".") or key.startswith(f + ".") for f in FIXED),
              "checkpoint.allow_change", f"{key!r} is not a key a resume keeps (those are {', '.join(FIXED)}; "
              "every other key may change on resume without it)", c.allow_change)
    _need(lg.every_steps >= 1, "log.every_steps", "must be >= 1", lg.every_steps)
    _need(lg.peak_flops > 0, "log.peak_flops", "must be > 0", lg.peak_flops)
    _need(e.every_steps >= 0, "eval.every_steps", "must be >= 0", e.every_steps)
    _need(e.batches >= 1, "eval.batches", "must be >= 1", e.batches)
    _need(e.sample_tokens >= 0, "eval.sample_tokens", "must be >= 0", e.sample_tokens)
    _need(e.tasks_limit is None or e.tasks_limit >= 1, "eval.tasks_limit", "must be None or >= 1", e.tasks_limit)
    _need(e.tasks_batch_size >= 1, "eval.tasks_batch_size", "must be >= 1", e.tasks_batch_size)
    _need(not e.task_list or importlib.util.find_spec("lm_eval") is not None, "eval.tasks",
          "needs lm-eval, which is not installed: pip install -e '.[eval]'", e.tasks)
    for k in ("max_minutes", "stop_after_minutes"):
        v = getattr(t, k)
        _need(v is None or (v > 0 and math.isfinite(v)), f"train.{k}", "must be null or a number of minutes > 0", v)
    _need(t.stop_after_minutes is None or c.at_end, "checkpoint.at_end",
          "must be true with train.stop_after_minutes (a slice ends with the checkpoint the next one resumes)",
          c.at_end)
    if d.source == "task":
        _validate_task(cfg)
    _need(e.include_path is None or Path(e.include_path).is_dir(), "eval.include_path",
          "must be an existing folder of task YAMLs (python -m lm.eval.local_tasks writes one)", e.include_path)
    _need("implicit" not in cfg.model.overrides, "model.overrides.implicit",
          "the solver settings of an implicit model go in model.implicit (or the curriculum's phases), one place",
          cfg.model.overrides.get("implicit"))
    if cfg.curriculum is not None:
        _need(cfg.model.implicit is None, "model.implicit",
              "set either model.implicit (fixed settings) or curriculum (phases), not both", cfg.model.implicit)
