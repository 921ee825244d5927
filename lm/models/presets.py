"""Model presets (lm/configs/models/<model_type>-<size>.json), parameter counts and training FLOPs.

    load_config("lm_mamba2-130m")              a preset name
    load_config("path/to/config.json", implicit={...})   a file, with overrides
    `lm info PRESET` prints parameters and per-token training FLOPs.

FLOPs per token (forward, "2 x MACs"): 2 x (non-embedding matmul parameters + LM head) plus each
mixer's sequence-mixing term (`Mixer.flops_per_token`: attention scores, SSD / scan work). Training of
an explicit model costs 3x the forward. An implicit (s+k) step costs s no-grad forwards plus k
forward+backward passes of the stack: (s + 3k) x the stack's forward, plus 3x the head.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from . import MODEL_TYPES
from ..resources import configs_dir
from .config import LMConfig, update_settings


def presets_dir() -> Path:
    return configs_dir("models")


def list_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.json"))


def load_config(name_or_path: str, **overrides) -> LMConfig:
    """A config from a preset name, a config.json file, a directory holding config.json, or a bare model type
    (`lm_mamba2`: that type's defaults). An override of solver settings given as a dict updates the preset's
    (FP-Mamba's layer_solver={"max_iter": 4} keeps the preset's other layer-solver settings)."""
    if name_or_path in MODEL_TYPES:
        try:
            return MODEL_TYPES[name_or_path][0](**overrides)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name_or_path}: {err}") from None
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        cand = presets_dir() / f"{name_or_path}.json"
        if not cand.is_file():
            raise ValueError(
                f"unknown model preset or config file {name_or_path!r}. Presets: {', '.join(list_presets())}"
            )
        path = cand
    d = json.loads(path.read_text())
    model_type = overrides.get("model_type", d.get("model_type"))
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} is not one of {sorted(MODEL_TYPES)}")
    config_cls = MODEL_TYPES[model_type][0]
    for key, value in overrides.items():
        solver = key in config_cls._solver_fields and isinstance(value, dict) and isinstance(d.get(key), dict)
        d[key] = update_settings(d[key], value) if solver else value
    d.pop("model_type", None)
    return config_cls(**d)


def build_model(config: LMConfig, device="meta"):
    """The causal LM for a config (on the meta device by default: sizes only, no memory)."""
    lm_cls = MODEL_TYPES[config.model_type][2]
    with torch.device(device):
        return lm_cls(config)


def count_parameters(config: LMConfig) -> dict[str, int]:
    model = build_model(config)
    total = sum(p.numel() for p in model.parameters())  # tied head counted once
    emb = model.get_input_embeddings().weight.numel()
    return {"total": total, "embedding": emb, "non_embedding": total - emb}


def flops_per_token(config: LMConfig, seq_len: int = 2048, iterations: float | None = None,
                    layer_iterations: float | None = None) -> dict[str, float]:
    """Forward and training FLOPs per token (see the module docstring). `iterations`: the solver iterations
    an implicit model actually ran (the trainer's measured mean; a tolerance stops the solve before
    max_iter); None counts max_iter. `layer_iterations`: those of layers that iterate inside (FP-Mamba's
    measured mean; counted in explicit stacks), None: not counted (one application per layer)."""
    model = build_model(config)
    matmul = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not name.endswith("lm_head") and "injection" not in name:
            matmul += mod.weight.numel()
    head = config.vocab_size * config.hidden_size
    mixing = sum(layer.mixer.flops_per_token(seq_len) for layer in model.model.layers)
    stack_fwd = 2 * matmul + mixing
    head_fwd = 2 * head
    inj_fwd = 0
    if model.model.injection is not None:
        inj_fwd = 2 * model.model.injection.proj.weight.numel()
    s = config.implicit
    if s is None:
        train = 3 * (stack_fwd + head_fwd)
        if layer_iterations is not None:
            train += sum(layer.mixer.solver_flops_per_token(seq_len, layer_iterations)
                         for layer in model.model.layers if hasattr(layer.mixer, "solver_flops_per_token"))
    else:
        iters = s.max_iter if iterations is None else iterations
        train = (iters + 3 * s.phantom_steps) * stack_fwd + 3 * (head_fwd + inj_fwd)
    return {"forward_stack": stack_fwd, "forward_head": head_fwd, "train": train}


def info(name_or_path: str, seq_len: int = 2048) -> dict:
    cfg = load_config(name_or_path)
    params = count_parameters(cfg)
    fl = flops_per_token(cfg, seq_len)
    implicit = cfg.implicit.to_dict() if cfg.implicit is not None else None
    return {"preset": name_or_path, "model_type": cfg.model_type, "implicit": implicit,
            "seq_len": seq_len, **{f"params_{k}": v for k, v in params.items()},
            "train_flops_per_token": fl["train"], "forward_flops_per_token": fl["forward_stack"] + fl["forward_head"]}


def info_main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="lm info", description="parameter count and per-token training FLOPs")
    ap.add_argument("preset", nargs="*", help="preset names or config paths (default: all presets)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--json", action="store_true", help="print JSON lines")
    args = ap.parse_args(argv)
    names = args.preset or list_presets()
    for n in names:
        r = info(n, args.seq_len)
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{n:32s} {r['model_type']:16s} params {r['params_total'] / 1e6:9.2f}M "
                  f"(non-emb {r['params_non_embedding'] / 1e6:8.2f}M)  train FLOPs/token "
                  f"{r['train_flops_per_token'] / 1e9:8.3f} G  @T={args.seq_len}"
                  + ("  implicit" if r["implicit"] else ""))
    return 0
