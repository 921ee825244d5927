"""Test setup shared by every test file.

On a machine without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before
any kernel module is imported (triton.jit reads it at decoration time), so it is set here.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests use tiny tensors, for which intra-op threads cost more than they give (several-fold on a
# loaded 2-core machine); subprocess tests (DeepSpeed ranks) set their own.
torch.set_num_threads(1)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def fast_interpreter():
    """The Triton interpreter checks every int32 op for overflow (slow in Python). Kernel test modules whose index
    math is bounded by the tensor sizes turn the check off: `pytestmark = pytest.mark.usefixtures("fast_interpreter")`."""
    if torch.cuda.is_available():
        yield
        return
    import dataclasses

    from triton.runtime import interpreter as interp
    old = interp.interpreter_builder.options
    interp.interpreter_builder.options = dataclasses.replace(old, sanitize_overflow=False)
    yield
    interp.interpreter_builder.options = old


@pytest.fixture
def autotuner_runs(monkeypatch):
    """The names of the kernels triton's Autotuner runs from here on (appended per call), with the kept launch
    configs (lm_kernels.autotune.launch) and the SSD's cached plans emptied first."""
    import lm_kernels.autotune as at
    import lm_kernels.ssd.launch as ln
    from triton.runtime.autotuner import Autotuner

    runs = []
    orig = Autotuner.run

    def counting(self, *a, **k):
        runs.append(self.base_fn.__name__)
        return orig(self, *a, **k)

    monkeypatch.setattr(Autotuner, "run", counting)
    monkeypatch.setattr(at, "_BEST", {})
    monkeypatch.setattr(ln, "_PLANS", {})
    return runs


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
