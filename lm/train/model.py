"""The model of a training run: its config (the preset or `init_from` folder, read once), the checks that
need it, and the causal LM with the first solver settings applied."""
from __future__ import annotations

from pathlib import Path

import torch


def load_model_config(cfg):
    """The model config of the run: the preset (or config.json) with model.overrides, or init_from's config."""
    import lm.models  # noqa: F401  (registers the model types)

    m = cfg.model
    if m.init_from:
        if not (Path(m.init_from) / "config.json").is_file():
            raise ValueError(f"model.init_from: {m.init_from} is not a model folder (an `lm export` output "
                             "with config.json)")
        from transformers import AutoConfig

        from .export import verify_export

        verify_export(m.init_from)  # its manifest (lm export writes one): a damaged file is named here
        return AutoConfig.from_pretrained(m.init_from)
    from lm.models.presets import load_config

    try:
        return load_config(m.preset, **m.overrides)
    except ValueError as err:
        raise ValueError(f"model: {err}") from None


def initial_solver(cfg, config, phases):
    """The solver settings the run starts with: the first curriculum phase, model.implicit, or the preset's."""
    if phases:
        return phases[0].implicit
    return cfg.model.implicit if cfg.model.implicit is not None else config.implicit


def check_model_settings(cfg, config, phases) -> None:
    """Refusals that need the model config, before any process group or file exists."""
    implicit = initial_solver(cfg, config, phases) is not None
    # engine auto counts too: it runs DeepSpeed as soon as there are several ranks
    if cfg.train.zero_stage == 3 and cfg.train.engine != "torch" and implicit:
        raise ValueError("train.zero_stage: ZeRO-3 is refused for implicit models: the fixed-point solver calls the "
                         "same layers a data-dependent number of times, which breaks ZeRO-3's parameter prefetch. "
                         "Use train.zero_stage=2 (or 1); the parameters of these models fit on one device.")
    if phases and cfg.model.init_from and config.implicit is None:
        raise ValueError("curriculum: set for an explicit model (the curriculum switches solver settings of "
                         "implicit models, and an explicit model has no injection module); remove it or use "
                         "an implicit model")


def build_model(cfg, config, phases, data_vocab: int):
    """The causal LM (fp32, on CPU) with the run's first solver settings."""
    from lm.models import MODEL_TYPES

    m = cfg.model
    solver = initial_solver(cfg, config, phases)
    if m.init_from:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(m.init_from, config=config, dtype=torch.float32)
        if solver is not None and solver != config.implicit:
            model.set_solver(solver)
    else:
        config.implicit = solver  # the config is built here: the model is implicit iff it has solver settings
        model = MODEL_TYPES[config.model_type][2](config)
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
