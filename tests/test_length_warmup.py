"""Sequence-length warm-up (lm.train.length_warmup, data.seq_len_warmup): the stages' config refusals, the rows and
packed offsets of a cut micro-batch, the stage at each step, and a training run whose model receives the cut rows at
the warm-up's steps and full rows after it, with the stage switches logged."""
import json

import pytest
import torch
from test_train_loop import corpus  # noqa: F401  (the module-scoped fixture)
from train_checks import tiny_run_tree

from lm.train import step as step_module
from lm.resources import configs_dir
from lm.train.config import config_from_dict, load_train_config
from lm.train.length_warmup import LengthWarmup, cut_rows, parse_stages
from lm.train.trainer import train


@pytest.mark.parametrize("value, message", [
    ("x", "expected a list"),
    ([{"until": 0.5}], "expected {until"),
    ([{"until": 1.0, "seq_len": 8}], "fraction in"),
    ([{"until": 0.5, "seq_len": 8}, {"until": 0.4, "seq_len": 16}], "fraction in"),
    ([{"until": 0.5, "seq_len": 12}], "divisor of data.seq_len 32"),
    ([{"until": 0.5, "seq_len": 32}], "divisor of data.seq_len 32 below it"),
    ([{"until": 0.2, "seq_len": 16}, {"until": 0.4, "seq_len": 8}], "must grow"),
    ([{"until": 0.5, "seq_len": 2}], "multiple of train.context_parallel 4"),
])
def test_stage_refusals(value, message):
    with pytest.raises(ValueError, match=message):
        parse_stages(value, 32, context_parallel=4)


def test_config_validates_the_stages(tmp_path):
    tree = tiny_run_tree(tmp_path, {"data": {"seq_len": 32, "seq_len_warmup": [{"until": 0.5, "seq_len": 64}]}})
    with pytest.raises(ValueError, match=r"data.seq_len_warmup\[0\].seq_len"):
        config_from_dict(tree)


def test_cut_rows_keep_every_token_and_target():
    ids = torch.arange(2 * 12).reshape(2, 12)
    targets = ids + 1
    out = cut_rows({"input_ids": ids, "targets": targets}, 4)
    assert out["input_ids"].tolist() == ids.reshape(6, 4).tolist()
    assert out["targets"].tolist() == targets.reshape(6, 4).tolist()
    packed = cut_rows({"input_ids": ids, "targets": targets, "cu_seqlens": torch.tensor([0, 3, 4, 10, 17, 24],
                                                                                          dtype=torch.int32)}, 8)
    assert packed["cu_seqlens"].tolist() == [0, 3, 4, 8, 10, 16, 17, 24]
    assert packed["cu_seqlens"].dtype == torch.int32
    same = {"input_ids": ids, "targets": targets}
    assert cut_rows(same, 12) is same


def test_stage_per_step():
    reader = iter([{"input_ids": torch.zeros(1, 32, dtype=torch.long), "targets": torch.zeros(1, 32)}] * 10)
    w = LengthWarmup(reader, [(0.2, 8), (0.5, 16)], 32, total_steps=10)
    got = [w.enter(s) for s in range(10)]
    assert got == [8, None, 16, None, None, 32, None, None, None, None]
    assert next(w)["input_ids"].shape == (1, 32)
    w = LengthWarmup(reader, [(0.2, 8), (0.5, 16)], 32, total_steps=10)
    assert w.enter(3) == 16  # a resumed run: its first stage
    assert next(w)["input_ids"].shape == (2, 16)
    assert LengthWarmup(reader, [], 32, 10).enter(0) is None


@pytest.mark.parametrize("packed", [False, True])
def test_training_runs_the_stages(tmp_path, corpus, monkeypatch, packed):  # noqa: F811
    seen = []
    inner = step_module.to_model_inputs

    def spy(batch, device):
        out = inner(batch, device)
        seen.append((tuple(out["input_ids"].shape), out["cu_seqlens"].tolist() if "cu_seqlens" in out else None))
        return out

    monkeypatch.setattr(step_module, "to_model_inputs", spy)
    run = tmp_path / "run"
    tree = tiny_run_tree(run, {"data": {"path": str(corpus), "seq_len": 32, "cu_seqlens": packed,
                                        "seq_len_warmup": [{"until": 0.25, "seq_len": 8},
                                                           {"until": 0.5, "seq_len": 16}]},
                               "train": {"steps": 4, "global_batch_tokens": 64}})
    s = train(config_from_dict(tree))
    assert s["steps"] == 4
    if packed:
        assert [shape for shape, _ in seen] == [(1, 64)] * 4
        for (_, cu), length in zip(seen, (8, 16, 32, 32)):
            assert set(range(0, 65, length)) <= set(cu), (length, cu)
    else:
        assert [shape for shape, _ in seen] == [(8, 8), (4, 16), (2, 32), (2, 32)]
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [(r["step"], r["seq_len"]) for r in recs if r.get("event") == "seq_len"] == [(0, 8), (1, 16), (2, 32)]
    assert all(r["loss"] == r["loss"] for r in recs if "event" not in r)


@pytest.mark.parametrize("name, seq_len, stages", [("long-16k", 16384, 2), ("long-32k", 32768, 3),
                                                   ("long-64k", 65536, 4)])
def test_long_context_recipes_parse(name, seq_len, stages):
    cfg = load_train_config(configs_dir("train") / f"{name}.yaml")
    assert cfg.data.seq_len == seq_len and cfg.data.cu_seqlens
    parsed = parse_stages(cfg.data.seq_len_warmup, seq_len, context_parallel=8)  # also valid over 8 context ranks
    assert len(parsed) == stages and parsed[0][1] == 2048
