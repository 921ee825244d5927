"""The `lm` command line as a new user meets it (issue 58): every command's --help whole and once, bad input as one
message (no traceback), --output everywhere (--out kept as an alias), `lm export` that neither overwrites another
model's folder nor leaves stale files, with the umask's permissions, and the notice before DeepSpeed's first
CPU compile."""
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import train_checks

from lm.cli import COMMANDS
from lm.cli import main as lm_main
from lm.train.config import config_from_dict
from lm.train.export import main as export_main
from lm.train.trainer import train

REPO = Path(__file__).resolve().parents[1]
CUT_WORDS = {"a", "an", "and", "by", "for", "from", "in", "of", "on", "or", "the", "to", "with"}


def _lm(*args, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lm.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env=env)


def _description(help_text: str) -> str:
    """The text between the usage block and the first argument section."""
    body = help_text.split("\n\n", 1)[1] if "\n\n" in help_text else ""
    for head in ("positional arguments:", "options:", "optional arguments:"):
        body = body.split(head)[0]
    return body.strip()


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "bench"])
def test_every_help_is_whole_and_printed_once(name, capsys):
    with pytest.raises(SystemExit) as ex:
        lm_main([name, "--help"])
    assert ex.value.code == 0
    out = capsys.readouterr().out
    assert out.count("usage:") == 1, out
    assert out.count(f"lm {name} [") + out.count(f"lm {name} (") <= 1 or name == "train", out
    text = _description(out)
    # no paragraph of the description stops mid-sentence (a docstring cut at its first line ended "... of" or
    # "... predictions,")
    for para in [p for p in text.split("\n\n") if p.strip()]:
        last = para.rstrip().split()[-1]
        assert not last.endswith((",", ";")) and last.lower() not in CUT_WORDS, (name, para)


@pytest.mark.slow
def test_train_help_shows_usage_once():
    p = _lm("train", "--help")
    assert p.returncode == 0 and p.stdout.count("lm train [CONFIG.yaml]") == 0 and p.stdout.count("usage:") == 1
    assert "--allow-change" in p.stdout and "SIGTERM" in p.stdout


@pytest.mark.slow
def test_unknown_preset_is_one_message():
    p = _lm("info", "UNKNOWN")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.startswith("lm info: unknown model preset or config file 'UNKNOWN'. Presets: "), p.stderr


@pytest.mark.slow
def test_steps_over_the_default_recipe_says_to_unset_tokens():
    p = _lm("train", "default", "train.steps=5")
    assert p.returncode == 2
    assert "add train.tokens=null to train 5 steps" in p.stderr and "train.tokens=409600" in p.stderr, p.stderr


@pytest.mark.parametrize("argv", [["ppl"], ["synth"], ["export"], ["eval"], ["duality"], ["convert"],
                                  ["bench", "train"], ["bench", "generate"]])
def test_output_is_the_spelling(argv, capsys):
    with pytest.raises(SystemExit):
        lm_main([*argv, "--help"])
    out = capsys.readouterr().out
    assert "--output" in out and "--out " not in out.split("options:")[0], out


@pytest.mark.slow
def test_local_tasks_take_output_and_out(tmp_path, tmp_path_factory):
    from test_train_loop import make_corpus

    from lm.eval.local_tasks import main as tasks_main

    data = make_corpus(tmp_path_factory)
    for flag in ("--output", "--out"):
        out = tmp_path / flag.strip("-")
        assert tasks_main(["--data", str(data), flag, str(out), "--n", "12"]) == 0
        assert (out / "lm_local_lastword.yaml").is_file()


# ----------------------------------------------------------------------------------------------- lm export


def _tiny_run(run_dir, **over):
    tree = train_checks.tiny_run_tree(run_dir, {
        "model": {"overrides": {**train_checks.TINY, "vocab_size": 64}},
        "data": {"source": "synthetic", "synthetic_vocab": 64, "seq_len": 16},
        "train": {"steps": 2, "global_batch_tokens": 64}}, over)
    train(config_from_dict(tree))
    return run_dir


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return _tiny_run(root / "a"), _tiny_run(root / "b", train={"steps": 3, "global_batch_tokens": 64})


@pytest.mark.slow
def test_export_refuses_another_models_folder_and_replaces_its_own(two_runs, tmp_path, capsys):
    a, b = two_runs
    out = tmp_path / "hf"
    assert export_main([str(a), "--output", str(out)]) == 0
    (out / "eval_results.json").write_text("{}")  # what `lm eval` leaves beside the model
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert export_main([str(b), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds the export of another run's checkpoint" in err and "--force" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written

    # the same run again (a later checkpoint): replaced whole, the stale results go
    assert export_main([str(a), "--output", str(out)]) == 0
    assert not (out / "eval_results.json").exists()
    # --force replaces another run's
    (out / "eval_results.json").write_text("{}")
    assert export_main([str(b), "--output", str(out), "--force"]) == 0
    assert not (out / "eval_results.json").exists()
    assert json.loads((out / "manifest.json").read_text())["checkpoint"].endswith("b/checkpoints/step_00000003")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]  # no staging left


@pytest.mark.slow
def test_export_refuses_a_folder_of_other_files(two_runs, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert export_main([str(two_runs[0]), "--output", str(out)]) == 2
    assert "files that are not an lm export (notes.txt" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.slow
@pytest.mark.parametrize("mask", [0o022, 0o002])
def test_export_files_follow_the_umask(two_runs, tmp_path, mask):
    old = os.umask(mask)
    try:
        assert export_main([str(two_runs[0]), "--output", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {0o666 & ~mask}, modes
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o777 & ~mask


# ------------------------------------------------------------------------------------------ DeepSpeed notice


def test_deepspeed_first_cpu_start_is_announced(tmp_path, capsys, monkeypatch):
    pytest.importorskip("deepspeed")
    from lm.train.distributed import _check_deepspeed_cpu_op

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "empty"))  # nothing compiled there
    _check_deepspeed_cpu_op(announce=True)
    err = capsys.readouterr().err
    assert "DeepSpeed compiles its CPU communication op deepspeed_shm_comm now" in err and "2 minutes" in err, err
    built = tmp_path / "built" / "deepspeed_shm_comm"
    built.mkdir(parents=True)
    (built / "deepspeed_shm_comm.so").write_bytes(b"")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "built"))
    _check_deepspeed_cpu_op(announce=True)
    assert capsys.readouterr().err == ""


def test_readme_lm_eval_line_batches_as_lm_eval_does():
    """lm-eval's own CLI runs at batch size 1 unless told (4x slower than `lm eval`): the README's line sets the
    batch size of `lm eval`."""
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("lm_eval ")]
    assert lines, "the README's lm_eval line"
    src = (REPO / "lm" / "eval" / "harness.py").read_text()
    assert 'ap.add_argument("--batch-size", type=int, default=16)' in src  # lm eval's default
    assert all("--batch_size 16" in line for line in lines), lines
