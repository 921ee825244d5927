"""Solver settings take one path: YAML / CLI (model.implicit, curriculum phases) or config.json -> one ImplicitSettings
-> the model (set_solver holds it; the shared config keeps its saved default) -> ImplicitSettings.solve_args ->
lm.fixed_point.solve. FP-Mamba's per-layer solve takes the same type (layer_solver; tests/test_models_fp_mamba.py)."""
import pytest
import torch

import lm  # noqa: F401  (registers the model types)
from lm.models.config import ImplicitSettings, update_settings
from lm.models.presets import build_model, load_config

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, d_state=8, headdim=16, chunk_size=8)


def test_solve_args_of_training_and_evaluation():
    s = ImplicitSettings(max_iter=3, tol=0.1, eval_tol=0.01, stop_quantile=0.5, eval_stop_quantile=0.9, damping=0.8,
                         norm="inf_rows", anderson=2, patience=4, damping_decay=0.5, eval_factor=2.5)
    common = dict(damping=0.8, norm="inf_rows", anderson=2, patience=4, damping_decay=0.5)
    assert s.solve_args(training=True) == dict(max_iter=3, tol=0.1, stop_quantile=0.5, **common)
    assert s.solve_args(training=False) == dict(max_iter=8, tol=0.01, stop_quantile=0.9, **common)  # ceil(2.5 * 3)
    plain = ImplicitSettings(max_iter=3, tol=0.1)  # evaluation falls back to the training values
    assert plain.solve_args(False)["tol"] == 0.1 and plain.solve_args(False)["stop_quantile"] == 1.0
    capped = ImplicitSettings(max_iter=3, eval_cap=7, eval_factor=10.0)
    assert capped.eval_max_iter == 7  # an absolute cap replaces the factor
    assert update_settings(capped.to_dict(), {"eval_factor": 2.0})["eval_cap"] is None  # and a factor the cap
    assert ImplicitSettings.from_value({"eval_factor": 2.0}, capped).eval_max_iter == 6
    with pytest.raises(ValueError, match=r"^implicit.patience: must be None or an integer >= 1"):
        ImplicitSettings(patience=0)
    with pytest.raises(ValueError, match=r"^implicit: unknown key\(s\) \['max_iters'\]"):
        ImplicitSettings.from_value({"max_iters": 3})
    assert hash(ImplicitSettings(train_iter_gamma=[2.0, 1.0])) == hash(ImplicitSettings(train_iter_gamma=(2.0, 1.0)))


def test_the_model_hands_its_settings_to_the_solver(spy_solve):
    """Training and evaluation forwards and the one-token decode step call solve with the settings' solve_args;
    set_solver switches them without writing the shared config, whose `implicit` stays the saved default."""
    import lm.models.modeling as modeling

    seen = spy_solve(modeling)
    first = ImplicitSettings(max_iter=2, phantom_steps=1)
    second = ImplicitSettings(max_iter=3, tol=0.2, stop_quantile=0.5, eval_factor=2.0, damping=0.9)
    torch.manual_seed(0)
    model = build_model(load_config("lm_mamba2-tiny", **TINY, implicit=first), device="cpu")
    config = model.config
    ids = torch.randint(0, 64, (2, 5))
    model.train()
    model(ids)
    assert seen[-1] == first.solve_args(True)
    model.set_solver(second)
    assert model.solver is second and model.config is config and config.implicit is first
    model(ids)
    assert seen[-1] == second.solve_args(True)
    model.eval()
    with torch.no_grad():
        model(ids)
    assert seen[-1] == second.solve_args(False)
    saved = model.solver_config()
    assert saved.implicit is second and config.implicit is first and saved.to_dict()["implicit"]["max_iter"] == 3
    assert model.solver_config() is not config
    model.set_solver(first)
    assert model.solver_config() is config  # the saved default again: no copy


def test_decode_step_solves_with_the_evaluation_cap_and_no_tolerance(spy_solve):
    import lm.models.modeling as modeling

    seen = spy_solve(modeling)
    torch.manual_seed(0)
    model = build_model(load_config("lm_mamba2-tiny", **TINY, implicit={"max_iter": 2}), device="cpu").eval()
    s = ImplicitSettings(max_iter=3, tol=0.2, eval_factor=2.0, damping=0.9)
    model.set_solver(s)
    with torch.no_grad():
        model.generate(torch.randint(0, 64, (1, 4)), max_new_tokens=2, do_sample=False, pad_token_id=0,
                       decode="static")
    assert seen[-1] == {**s.solve_args(False), "tol": None} and seen[-1]["max_iter"] == 6


def test_training_config_takes_solver_settings_in_one_place():
    from lm.train.config import config_from_dict

    with pytest.raises(ValueError, match=r"model.overrides.implicit: the solver settings of an implicit model go in "
                                         r"model.implicit"):
        config_from_dict({"train": {"steps": 1}, "model": {"overrides": {"implicit": {"max_iter": 2}}}})
    cfg = config_from_dict({"train": {"steps": 1}, "model": {"implicit": {"max_iter": 2, "eval_cap": 9}}})
    assert cfg.model.implicit == ImplicitSettings(max_iter=2, eval_cap=9)


def test_preset_layer_solver_updated_by_an_override():
    """An override of a preset's solver settings given as a dict updates them (lm_fp_mamba-tiny: eval_cap 100)."""
    s = load_config("lm_fp_mamba-tiny", layer_solver={"max_iter": 4}).layer_solver
    assert (s.max_iter, s.eval_max_iter, s.tol) == (4, 100, 0.1)
    assert load_config("lm_fp_mamba-tiny", layer_solver={"eval_factor": 3.0}).layer_solver.eval_max_iter == 48


def test_mfu_counts_the_settings_the_model_runs_with():
    """The step record's FLOPs per token follow the phase set on the model (its phantom steps), not the config's
    saved default."""
    from lm.models.presets import flops_per_token
    from lm.train.metrics import StepWindow

    model = build_model(load_config("lm_mamba2-tiny", **TINY, implicit={"max_iter": 2, "phantom_steps": 1}),
                        device="cpu")
    window = StepWindow(seq_len=16, tokens_per_step=32, peak_flops=1e12, world_size=1)
    window.add(1.0, [{"iterations": 2.0}])
    one = window.record(model)["flops_per_token"]
    model.set_solver(ImplicitSettings(max_iter=2, phantom_steps=3))
    window.add(1.0, [{"iterations": 2.0}])
    three = window.record(model)["flops_per_token"]
    assert one == pytest.approx(flops_per_token(model.config, 16, iterations=2.0)["train"])
    assert three == pytest.approx(flops_per_token(model.solver_config(), 16, iterations=2.0)["train"]) and three > one
