"""Pretraining: config, DeepSpeed/torch engine, curriculum, LR schedules, checkpoints, logging, export.

    from lm.train import load_train_config, train
    summary = train(load_train_config("default", ["train.tokens=1e6"]))

- config.py       TrainConfig (typed sections, unknown keys rejected), load_train_config(path, overrides)
- trainer.py      train(cfg): the loop, wiring the components below;  budget.py: train.max_minutes / stop_after_minutes
- step.py         Stepper: the step through the engine, its results read on the host (one step late on CUDA)
- stopping.py     Stop: steps, time budget, slice, target accuracy, NaN policy, signals; why the run stopped
- checkpointer.py Checkpointer: when the run saves and the training state it saves
- distributed.py  Dist: ranks, device, engine kind, collectives
- model.py        the model config (read once), checks, the model with its first solver settings
- data.py         the training / validation readers (prepared shards or synthetic tokens)
- engine.py       TorchEngine (one process) and DeepSpeedEngine (ZeRO 0/1/2) behind one interface
- optim.py        AdamW and its parameter groups
- schedule.py     lr_at(step, total, kind=cosine|wsd|constant_sqrt|constant, ...)
- curriculum.py   Phase, paper_curriculum(model_type), parse_curriculum, phase_index; Curriculum (a run's phase)
- checkpoint.py   atomic checkpoint folders with a hashed manifest, `latest`, keep-last-K, save / resume
- rundir.py       one trainer per run folder (lock), metrics.jsonl across restarts
- preempt.py      SIGTERM / SIGINT: finish the step, checkpoint, stop
- evaluation.py   held-out loss, lm-eval tasks, samples during training
- metrics.py      metrics.jsonl, wandb (optional), MFU, memory; StepLog (step records, skip warnings)
- console.py      the progress bar or step lines on rank 0
- synth.py        `lm synth`: a synthetic-task recipe -> a training config with data.source=task; the task component
- export.py       `lm export`: checkpoint -> Hugging Face folder;  plot.py: `lm plot`;  cli.py: `lm train`
"""
__all__ = ["TrainConfig", "load_train_config", "train"]


def __getattr__(name):  # lazy: `lm train --help` imports neither torch nor transformers
    if name in ("TrainConfig", "load_train_config"):
        from . import config

        return getattr(config, name)
    if name == "train":
        from .trainer import train

        return train
    raise AttributeError(name)
