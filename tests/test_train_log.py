"""What a training job prints (issue 58): a log file written from a redirected stdout has one readable line per
logged step (no carriage returns, no bar glued to messages), with log.progress on or off; on a terminal the bar
shows instead. Tiny synthetic-data runs through `python -m lm.train`, one thread."""
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import yaml
from train_checks import tiny_run_tree

from lm.train.console import eta, step_line

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^step (\d+)/(\d+) \| loss \d+\.\d{4} \| lr \d\.\d\de[-+]\d\d \| grad [0-9.e+-]+ \| [\d,]+ tok/s "
                  r"\| MFU [0-9.e+-]+% \| it \d+\.\d \| ETA (\d+s|\d+m\d\ds|\d+h\d\dm)$")


def _config(tmp_path, **over):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny_run_tree(tmp_path / "run", {
        "model": {"overrides": {"vocab_size": 64}, "implicit": {"max_iter": 3, "phantom_steps": 1}},
        "data": {"source": "synthetic", "synthetic_vocab": 64, "seq_len": 16},
        "train": {"global_batch_tokens": 64},
    }, over)))
    return cfg


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TERM": "xterm"}


def _train_to_file(tmp_path, *items):
    log = tmp_path / "job.log"
    with open(log, "w") as f:  # as a cluster job: stdout and stderr into one file
        p = subprocess.run([sys.executable, "-m", "lm.train", str(_config(tmp_path)), *items], cwd=tmp_path,
                           env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert p.returncode == 0, text[-3000:]
    return text


def _step_lines(text):
    return [line for line in text.splitlines() if line.startswith("step ") and " | " in line]


@pytest.mark.slow
def test_log_file_has_one_line_per_logged_step_with_the_bar_on(tmp_path):
    text = _train_to_file(tmp_path, "log.progress=true")
    assert "\r" not in text  # no bar redrawn into the file
    lines = _step_lines(text)
    assert [int(LINE.match(line).group(1)) for line in lines] == [1, 2, 3, 4, 5, 6], text
    assert all(LINE.match(line).group(2) == "6" for line in lines)
    # messages on lines of their own, before the steps
    first = text.splitlines().index(lines[0])
    assert any(line.startswith("lm train: lm_mamba2") for line in text.splitlines()[:first]), text


@pytest.mark.slow
def test_progress_off_still_prints_every_log_step(tmp_path):
    text = _train_to_file(tmp_path, "log.progress=false", "log.every_steps=2", "train.steps=7")
    steps = [int(LINE.match(line).group(1)) for line in _step_lines(text)]
    assert steps == [2, 4, 6, 7], text  # every log.every_steps, and the last step


@pytest.mark.slow
def test_a_terminal_gets_the_bar_not_the_lines(tmp_path):
    """stdout and stderr on a pseudo-terminal: the tqdm bar (carriage returns) and no step lines."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a 160-column terminal
    p = subprocess.Popen([sys.executable, "-m", "lm.train", str(_config(tmp_path)), "log.progress=true"],
                         cwd=tmp_path, env=_env(), stdout=follower, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process ended
            break
        if not chunk:
            break
        out += chunk
    assert p.wait(timeout=300) == 0, out[-3000:]
    text = out.decode(errors="replace")
    assert "train: 100%" in text and "6/6" in text, text[-3000:]
    assert not _step_lines(text.replace("\r", "\n")), text[-3000:]


def test_step_line_format():
    rec = {"loss": 3.21409, "lr": 2.9e-3, "grad_norm": 0.4123, "tokens_per_s": 1234.4, "mfu": 1.2e-5,
           "fp/iterations": 4.0}
    assert step_line(120, 500, rec, 245) == ("step 120/500 | loss 3.2141 | lr 2.90e-03 | grad 0.412 | 1,234 tok/s | "
                                             "MFU 0.0012% | it 4.0 | ETA 4m05s")
    skipped = step_line(3, 6, {"loss": float("nan"), "lr": 1e-3, "grad_norm": float("nan"), "skipped": True})
    assert skipped == "step 3/6 | loss nan | lr 1.00e-03 | grad nan | skipped"
    assert (eta(45), eta(3 * 3600 + 7 * 60)) == ("45s", "3h07m")
