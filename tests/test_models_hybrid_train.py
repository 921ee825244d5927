"""A hybrid through the trainer and the evaluation, CPU: an implicit Mamba2 + DeltaProduct + attention hybrid trains
(single-process torch engine) with its curriculum's bounded-then-free switch, resumes exactly, exports a folder
that from_pretrained loads, and runs lm-eval in process on a local task; the packaged hybrid recipes parse and name
their presets."""
import json

import pytest
import torch
from test_train_loop import PHASES, _losses, corpus  # noqa: F401  (the prepared corpus fixture)
from train_checks import tiny_run_tree

from lm.train.config import config_from_dict, load_train_config
from lm.train.trainer import train

HYBRID = {"hidden_size": 32, "layer_pattern": "M*D", "intermediate_size": 64,
          "attention": {"num_attention_heads": 4, "num_key_value_heads": 2},
          "mamba2": {"d_state": 8, "headdim": 16, "chunk_size": 16},
          "deltaproduct": {"num_heads": 2, "head_dim": 16, "chunk_size": 16, "use_forget_gate": True}}


@pytest.fixture(scope="module")
def eval_corpus(tmp_path_factory):
    """A prepared corpus large enough for the local lm-eval tasks (as tests/test_eval.py's)."""
    import shutil

    from lm.data.prepare import prepare_data
    from lm.data.sources import shakespeare_files

    root = tmp_path_factory.mktemp("eval_corpus")
    (root / "txt").mkdir()
    for f in shakespeare_files()[:6]:
        shutil.copy(f, root / "txt" / (f.stem + ".txt"))
    prepare_data(str(root / "txt" / "*.txt"), root / "data", val_fraction=0.34, workers=0, progress=False)
    return root / "data"


def _cfg(run_dir, data, **over):
    tree = tiny_run_tree(run_dir, {
        "data": {"path": str(data), "seq_len": 32},
        "curriculum": PHASES,
        "schedule": {"kind": "constant_sqrt", "warmup": 1, "decay_start": "last_phase"},
        "train": {"global_batch_tokens": 128},
        "checkpoint": {"every_steps": 0},
    }, over)
    tree["model"] = {"preset": "lm_hybrid-tiny", "overrides": dict(HYBRID)}
    return config_from_dict(tree)


@pytest.mark.slow  # (three training runs and lm-eval)
def test_implicit_hybrid_trains_with_curriculum_resumes_and_exports(tmp_path, corpus, eval_corpus):  # noqa: F811
    full = tmp_path / "full"
    train(_cfg(full, corpus, checkpoint={"every_steps": 3, "export": True}))
    losses, recs = _losses(full)
    steps = [r for r in recs if "event" not in r]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(list(losses.values()))))
    assert [r["phase"] for r in steps] == ["bounded"] * 3 + ["free"] * 3
    assert all(r["fp/iterations"] <= 2 for r in steps[:3]) and all(r["mfu"] > 0 for r in steps)

    part = tmp_path / "part"
    train(_cfg(part, corpus, train={"stop_after_steps": 3}))
    train(_cfg(part, corpus, checkpoint={"resume": "auto"}))
    resumed, _ = _losses(part)
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(losses[step], rel=1e-6, abs=1e-6), step

    from transformers import AutoModelForCausalLM

    import lm  # noqa: F401

    hf = AutoModelForCausalLM.from_pretrained(str(full / "hf"))
    assert hf.config.model_type == "lm_hybrid" and hf.config.layer_kinds == ["mamba2", "attention", "deltaproduct"]
    assert hf.config.implicit.max_iter == 6
    sd = torch.load(full / "checkpoints" / "step_00000006" / "model_optim.pt", weights_only=False)["model"]
    for k, v in hf.state_dict().items():
        assert torch.equal(v, sd[k]), k

    lm_eval = pytest.importorskip("lm_eval")  # noqa: F841
    from lm.eval.checkpoint import load_checkpoint
    from lm.eval.harness import run_lm_eval
    from lm.eval.local_tasks import build_local_tasks

    tasks = build_local_tasks(eval_corpus, tmp_path / "tasks", n_lastword=12, n_continuation=12)
    model, tok = load_checkpoint(full / "hf", device="cpu")
    res = run_lm_eval(model, tok, ["lm_local_lastword"], batch_size=3, limit=6, include_path=tasks)
    assert 0 <= res["results"]["lm_local_lastword"]["acc"] <= 1


@pytest.mark.parametrize("recipe,preset", [("dpile-hybrid-mamba2-350m", "lm_hybrid-mamba2-350m"),
                                           ("dpile-hybrid-mamba2-1.3b", "lm_hybrid-mamba2-1.3b"),
                                           ("fineweb-hybrid-gdp-400m", "lm_hybrid-gdp-400m")])
def test_hybrid_recipes_parse(recipe, preset):
    from lm.resources import configs_dir

    cfg = load_train_config(configs_dir("train") / f"{recipe}.yaml")
    assert cfg.model.preset == preset
    assert [p.name for p in cfg.curriculum] == ["bounded", "free"]  # implicit (curriculum=null: explicit)
    assert json.loads((configs_dir("models") / f"{preset}.json").read_text())["model_type"] == "lm_hybrid"


@pytest.mark.multirank
def test_deepspeed_two_ranks_equal_one(tmp_path):
    """scripts/gpu_scaling.sh --dry-run on the implicit hybrid: DeepSpeed ZeRO-2 (gloo, CPU, fp32) at 2 ranks takes
    the 1-rank run's steps (the same global batch by accumulation): the losses agree up to rounding."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OUT": str(tmp_path), "CASES": "hybrid-tiny-implicit-4+1",
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(["bash", str(repo / "scripts" / "gpu_scaling.sh"), "--dry-run"], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    runs = json.loads((tmp_path / "scaling.json").read_text())["cases"]["hybrid-tiny-implicit-4+1"]
    assert runs["1"]["engine"] == runs["2"]["engine"] == "deepspeed"
    assert len(runs["2"]["losses"]) == 4 and runs["2"]["max_rel_loss_diff_vs_1"] < 1e-5
