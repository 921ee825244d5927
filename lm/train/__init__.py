"""Pretraining: config, DeepSpeed/torch engine, curriculum, LR schedules, checkpoints, logging, export.

    from lm.train import load_train_config, train
    summary = train(load_train_config("configs/train/default.yaml", ["train.tokens=1e6"]))

- config.py      TrainConfig (typed sections, unknown keys rejected), load_train_config(path, overrides)
- schedule.py    lr_at(step, total, kind=cosine|wsd|constant_sqrt|constant, ...)
- curriculum.py  Phase, paper_curriculum(model_type), parse_curriculum, phase_index, apply_phase
- engine.py      TorchEngine (one process) and DeepSpeedEngine (ZeRO 0/1/2) behind one interface
- checkpoint.py  atomic checkpoint folders with a manifest, `latest`, keep-last-K, resolve/verify
- metrics.py     metrics.jsonl, wandb (optional), tqdm progress, MFU, memory
- trainer.py     train(cfg): the loop;  budget.py: train.max_minutes / stop_after_minutes
- synth.py       `lm synth`: a synthetic-task recipe -> a training config with data.source=task
- export.py      `lm export`: checkpoint -> Hugging Face folder;  plot.py: `lm plot`;  cli.py: `lm train`
"""
from .config import TrainConfig, load_train_config

__all__ = ["TrainConfig", "load_train_config", "train"]


def __getattr__(name):
    if name == "train":
        from .trainer import train

        return train
    raise AttributeError(name)
