"""`train.context_parallel` end to end: DeepSpeed ZeRO-2 training on CPU (gloo, torchrun) with the ranks of a context
group sharing each sequence gives the losses (every step's and the held-out loss) of one rank training the same
batches, to float32 rounding (1e-5 relative): 2 ranks in one context group, and 4 ranks as 2 data-parallel x 2
context ranks (ZeRO over all 4; the 1-rank run, launched once for both, accumulates the 2 data ranks' micro-batches).
Packed documents of mixed lengths (data.cu_seqlens) cross the slice borders; the model mixes attention (with GQA) and
Mamba2; the first step runs the sequence-length warm-up's shorter rows. The config's refusals are checked without
launching ranks."""
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from train_checks import tiny_run_tree

from lm.train.config import config_from_dict
from lm.train.context_parallel import ContextGroups, check_context_parallel

# initializer_range 0.3: at the default 0.02 the Mamba2 states that cross a slice border are ~1e-4 and the loss would
# not tell a dropped state from float32 rounding (checked: without the exchange the losses differ by 2e-3 here)
HYBRID = {"vocab_size": 8192, "hidden_size": 32, "num_hidden_layers": 2, "layer_pattern": "M*",
          "initializer_range": 0.3, "intermediate_size": 48,
          "attention": {"num_attention_heads": 4, "num_key_value_heads": 2},
          "mamba2": {"d_state": 8, "headdim": 8, "chunk_size": 8}}


def _corpus(tmp_path_factory):
    """Many short documents (5 to 60 words), so that packed rows of 32 tokens hold several, some crossing a slice
    border."""
    from lm.data.prepare import main as prepare_main

    src = tmp_path_factory.mktemp("cp_corpus")
    words = "the king shall speak and the queen doth answer him with love and fear".split()
    g = torch.Generator().manual_seed(0)
    for d in range(80):
        n = int(torch.randint(5, 60, (1,), generator=g))
        idx = torch.randint(0, len(words), (n,), generator=g).tolist()
        (src / f"doc{d:03d}.txt").write_text(" ".join(words[i] for i in idx) + ".")
    out = tmp_path_factory.mktemp("cp_data") / "corpus"
    assert prepare_main(["--input", str(src), "--output", str(out), "--val-fraction", "0.2", "--no-progress",
                         "--workers", "1"]) == 0
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _corpus(tmp_path_factory)


def _tree(run, data, context_parallel: int, eval_batches: int) -> dict:
    return tiny_run_tree(run, {
        "model": {"preset": "lm_hybrid-tiny", "overrides": HYBRID},
        "data": {"path": str(data), "seq_len": 32, "cu_seqlens": True,
                 "seq_len_warmup": [{"until": 0.3, "seq_len": 16}]},  # the first step: documents cut at 16 tokens
        "schedule": {"kind": "constant", "warmup": 1},
        # one row per micro-batch: the slice border is inside it (with 2 rows, the packed row's border would be the
        # second row's start, where a document always starts, and no state would cross it)
        "train": {"steps": 3, "micro_batch_size": 1, "global_batch_tokens": 128, "engine": "deepspeed",
                  "zero_stage": 2, "context_parallel": context_parallel},
        "checkpoint": {"export": False, "at_end": False},
        "eval": {"batches": eval_batches, "at_end": True, "sample_tokens": 0}})


def _launch(cfg, ranks: int, *extra) -> str:
    from lm.train.distributed import free_port

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
           str(free_port()), "-m", "lm.train", str(cfg), *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p.stdout + p.stderr


def _run(tmp_path, data, ranks: int, context_parallel: int, eval_batches: int) -> tuple[list, float]:
    """(every step's loss, the held-out loss) of a torchrun launch of `ranks` processes."""
    run = tmp_path / f"run_{ranks}_{context_parallel}"
    cfg = tmp_path / f"cfg_{ranks}_{context_parallel}.yaml"
    cfg.write_text(yaml.safe_dump(_tree(run, data, context_parallel, eval_batches)))
    _launch(cfg, ranks)
    recs = [json.loads(line) for line in open(run / "metrics.jsonl")]
    start = next(r for r in recs if r.get("event") == "start")
    assert start["world_size"] == ranks, start
    losses = [r["loss"] for r in recs if "event" not in r]
    val = [r["val_loss"] for r in recs if r.get("event") == "eval"]
    assert len(losses) == 3 and len(val) == 1, recs
    return losses, val[0]


def _same(got, want):
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, corpus):
    """The 1-rank run both tests compare with: 4 micro-batches per step (accumulated), 4 held-out batches."""
    return _run(tmp_path_factory.mktemp("cp_one"), corpus, 1, 1, 4)


@pytest.mark.multirank
def test_two_context_ranks_train_as_one_rank(tmp_path, corpus, one_rank):
    two = _run(tmp_path, corpus, 2, 2, 4)
    _same(two[0], one_rank[0])
    _same([two[1]], [one_rank[1]])


@pytest.mark.multirank
def test_two_data_by_two_context_ranks_train_as_one_rank(tmp_path, corpus, one_rank):
    """ZeRO-2 over 4 ranks, context groups {0, 1} and {2, 3}: each group reads its own batches, as the 2 ranks of a
    data-parallel run do, which together read the micro-batches that one rank accumulates (and the held-out windows
    of its 4 batches: each data rank evaluates 2 batches)."""
    four = _run(tmp_path, corpus, 4, 2, 2)
    _same(four[0], one_rank[0])
    _same([four[1]], [one_rank[1]])


@pytest.mark.multirank
def test_context_parallel_run_resumes_as_uninterrupted(tmp_path, corpus, one_rank):
    """2 context ranks stopped after step 2 (its checkpoint written) and resumed: step 3 (its warm-up stage, reader
    position and each rank's slice) and the held-out loss are the uninterrupted 1-rank run's; resumed from the same
    checkpoint as 2 data-parallel ranks (train.context_parallel 2 -> 1, reported as a change), step 3 is too (its
    held-out loss is over each data rank's own batches: another set)."""
    import shutil

    run = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(_tree(run, corpus, 2, 4)))
    _launch(cfg, 2, "train.stop_after_steps=2", "checkpoint.at_end=true")
    assert (run / "checkpoints" / "step_00000002").is_dir()
    data_parallel = tmp_path / "data_parallel"
    shutil.copytree(run, data_parallel)
    out = _launch(cfg, 2, "--resume")
    assert "resumed at step 2" in out, out[-3000:]
    out = _launch(cfg, 2, f"run_dir={data_parallel}", "train.context_parallel=1", "--resume")
    assert "train.context_parallel: 2 -> 1" in out, out[-3000:]
    for folder, same_eval in ((run, True), (data_parallel, False)):
        recs = [json.loads(line) for line in open(folder / "metrics.jsonl")]
        losses = {r["step"]: r["loss"] for r in recs if "event" not in r}
        assert sorted(losses) == [1, 2, 3], recs
        _same([losses[s] for s in (1, 2, 3)], one_rank[0])
        if same_eval:
            _same([r["val_loss"] for r in recs if r.get("event") == "eval"][-1:], [one_rank[1]])


@pytest.mark.parametrize("over, message", [
    ({"train": {"context_parallel": 0}}, "train.context_parallel"),
    ({"data": {"seq_len": 30}, "train": {"context_parallel": 4}}, "not a multiple of 4"),
    ({"train": {"context_parallel": 2, "engine": "torch"}}, "needs several ranks"),
])
def test_config_refusals(tmp_path, over, message):
    tree = tiny_run_tree(tmp_path / "run", {"data": {"seq_len": 32}}, over)
    with pytest.raises(ValueError, match=message):
        cfg = config_from_dict(tree)
        cfg.validate()
        check_context_parallel(cfg)


def test_world_not_divisible_by_the_context_ranks():
    with pytest.raises(ValueError, match="does not divide the 3 ranks"):
        ContextGroups(2, 3, 0)
    g = ContextGroups(1, 3, 2)
    assert (g.data_rank, g.data_world, g.active) == (2, 3, False)
