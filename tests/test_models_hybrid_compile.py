"""torch.compile of hybrid blocks (as the trainer compiles them: one graph per block), CPU: the hybrid's own pieces
(each layer's kind's shared inputs picked from the stack's, the injection's columns of its kind) add no graph break.

With the Triton conv, SSD and norms (the interpreter) a Mamba2 + attention hybrid's blocks compile with fullgraph=True
on the aot_eager backend and give the eager loss and gradients: explicit on a batch, and implicit on packed sequences
(the blocks with the injection's columns and cu_seqlens). The DeltaProduct chunk op and the LRU scan are opaque to
torch.compile by design (lm_kernels: torch.compiler.disable, their own autograd.Function), so their blocks break
there, as the pure families' blocks do: in the implicit pattern of every kind, the Mamba2 and attention blocks compile
whole and every graph break of the others is one of those calls. Small shapes: the cost is the Triton interpreter's,
per row and per block call."""
from __future__ import annotations

import pytest
import torch
from model_checks import loss_and_grads
from test_models_hybrid import V, hybrid

pytest.importorskip("triton")
pytestmark = [pytest.mark.usefixtures("fast_interpreter"), pytest.mark.slow]  # the Triton interpreter under dynamo
# two iterations and a phantom step: the solve re-enters each compiled block
IMPLICIT = dict(max_iter=2, tol=None, phantom_steps=1)
FULLGRAPH = ("mamba2", "attention")  # the blocks that compile whole; the others break at their opaque kernel calls


@pytest.fixture
def triton_backends(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    for op in ("SSD", "CONV1D", "RMSNORM"):
        monkeypatch.setenv(f"LM_{op}_BACKEND", "triton")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def assert_compiled_equals_eager(model, ids, cu=None):
    ref_loss, ref_grads = loss_and_grads(model, ids, cu)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager", fullgraph=layer.kind in FULLGRAPH)  # a graph break there raises
    loss, grads = loss_and_grads(model, ids, cu)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-5, msg=n)


def test_mamba2_attention_hybrid_blocks_compile_fullgraph(triton_backends):
    model = hybrid("M*").train()
    assert_compiled_equals_eager(model, torch.randint(0, V, (2, 18)))  # Mamba2's chunks of 16: a partial second


def test_implicit_packed_blocks_compile_and_break_only_at_the_opaque_kernel_calls(triton_backends):
    from torch._dynamo.utils import counters

    model = hybrid("M*DLHB", implicit=IMPLICIT).train()
    counters.clear()
    ids, cu = torch.randint(0, V, (1, 24)), torch.tensor([0, 10, 24], dtype=torch.int32)  # the second crosses a chunk
    assert_compiled_equals_eager(model, ids, cu)
    reasons = list(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] > 0
    assert reasons, "expected the opaque DeltaProduct / LRU calls to break their blocks"
    for r in reasons:  # only the ops' own opaque calls, nothing from the hybrid stack
        assert "torch.compiler.disable" in r and ("chunk_deltaproduct" in r or "block_scan" in r), r[:300]
