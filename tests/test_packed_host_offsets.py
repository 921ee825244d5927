"""Packed documents without a host wait in the forward: lm.train.data.to_model_inputs checks the offsets on the host
before their copy and hands the longest document's length on as `max_seqlen`; LMModel.forward then reads nothing
back from the offsets and the Llama attention pads to that host int. Results equal the forward that measures the
offsets itself and the per-document reference; bad offsets still raise; a compiled block takes the int without a
graph break and recompiles once."""
import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.data.reader import packed_cu_seqlens
from lm.models import LMLlamaConfig, LMMamba2Config
from lm.models.layers import position_in_document
from lm.models.llama import varlen_causal_attention
from lm.train.data import to_model_inputs

V, EOS = 64, 1
IMPLICIT = dict(max_iter=4, tol=None, phantom_steps=1, damping=1.0)
CPU = torch.device("cpu")


def small_config(family: str, implicit=None, layers: int = 2):
    if family == "llama":
        return LMLlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                             intermediate_size=64, implicit=implicit)
    return LMMamba2Config(vocab_size=V, hidden_size=32, num_hidden_layers=layers, d_state=8, headdim=8,
                          chunk_size=16, implicit=implicit)


def reader_batch(seed: int, b: int = 3, t: int = 16) -> dict:
    """A (b, t) batch as TrainReader yields it with cu_seqlens=True (documents end at EOS, rows are cut)."""
    g = np.random.default_rng(seed)
    ids = g.integers(2, V, size=(b, t + 1))
    ids[g.random(ids.shape) < 0.15] = EOS
    return {"input_ids": torch.from_numpy(ids[:, :-1].copy()), "targets": torch.from_numpy(ids[:, 1:].copy()),
            "cu_seqlens": torch.from_numpy(packed_cu_seqlens(ids[:, :-1], EOS))}


_T = torch.Tensor
_READS = {_T.item, _T.tolist, _T.cpu, _T.numpy, _T.__int__, _T.__bool__, _T.__float__, _T.__index__}


class HostReads(TorchFunctionMode):
    """Records every read of a tensor's values into Python (on CUDA each is a copy to the host that waits for the
    device): the methods that do it and, below them, aten._local_scalar_dense (what item/int/bool come down to)."""

    def __init__(self):
        super().__init__()
        self.reads = []
        outer = self

        class _Scalars(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    outer.reads.append(str(func))
                return func(*args, **(kwargs or {}))

        self._scalars = _Scalars()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._scalars.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._scalars.__exit__(*exc)


# --- the data side ---------------------------------------------------------------------------------------

def test_to_model_inputs_carries_the_longest_document():
    batch = reader_batch(0)
    cu = batch["cu_seqlens"].clone()
    inputs = to_model_inputs(batch, CPU)
    assert inputs["input_ids"].shape == inputs["targets"].shape == (1, 48)
    assert torch.equal(inputs["cu_seqlens"], cu) and inputs["cu_seqlens"].dtype == torch.int32
    assert isinstance(inputs["max_seqlen"], int) and inputs["max_seqlen"] == int((cu[1:] - cu[:-1]).max())
    assert "max_seqlen" not in to_model_inputs({k: v for k, v in batch.items() if k != "cu_seqlens"}, CPU)


@pytest.mark.parametrize("cu", [[0, 5, 40], [1, 5, 48], [0, 30, 20, 48], [[0, 48]], [0.0, 48.0], [0]],
                         ids=["short", "not-from-0", "decreasing", "2-d", "float", "one-offset"])
def test_bad_offsets_raise_on_the_host(cu):
    batch = reader_batch(0)
    batch["cu_seqlens"] = torch.tensor(cu)
    with pytest.raises(ValueError, match=r"^data: cu_seqlens (must be non-decreasing|must be a 1-D)"):
        to_model_inputs(batch, CPU)


# --- the model side --------------------------------------------------------------------------------------

def test_model_still_checks_offsets_given_without_max_seqlen():
    model = AutoModelForCausalLM.from_config(small_config("llama")).eval()
    ids = torch.randint(0, V, (1, 20))
    with pytest.raises(ValueError, match=r"model: cu_seqlens must be non-decreasing from 0 to seq_len \(20\)"):
        model(ids, cu_seqlens=torch.tensor([0, 7, 19], dtype=torch.int32))
    with pytest.raises(ValueError, match="model: cu_seqlens needs packed inputs with batch size 1"):
        model(ids.reshape(2, 10), cu_seqlens=torch.tensor([0, 10, 20]), max_seqlen=10)
    with pytest.raises(ValueError, match="model: cu_seqlens must be a 1-D int32/int64"):
        model(ids, cu_seqlens=torch.tensor([0.0, 20.0]), max_seqlen=20)
    for bad in (-1, 7.0, True, torch.tensor(13)):
        with pytest.raises(ValueError, match="model: max_seqlen must be a non-negative int"):
            model(ids, cu_seqlens=torch.tensor([0, 7, 20]), max_seqlen=bad)


@pytest.mark.parametrize("family,implicit", [("llama", None), ("llama", IMPLICIT), ("mamba2", None),
                                             ("mamba2", IMPLICIT)],
                         ids=["llama", "llama-implicit", "mamba2", "mamba2-implicit"])
def test_packed_results_unchanged(family, implicit):
    """The reader's batch through to_model_inputs (max_seqlen from the host) gives the loss and gradients of the
    forward that measures the offsets itself, bit for bit, and the logits of each document run alone."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(family, dict(implicit) if implicit else None)).train()
    params = [p for p in model.parameters() if p.requires_grad]
    inputs = to_model_inputs(reader_batch(1), CPU)
    assert inputs["max_seqlen"] < 16  # several documents per row: the padding is shorter than a row

    def loss_and_grads(**kw):
        loss = model(**kw).loss
        return loss.detach(), torch.autograd.grad(loss, params)

    loss, grads = loss_and_grads(**inputs)
    ref_loss, ref_grads = loss_and_grads(**{k: v for k, v in inputs.items() if k != "max_seqlen"})
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))

    model.eval()
    ids, cu = inputs["input_ids"], inputs["cu_seqlens"].tolist()
    with torch.no_grad():
        packed = model(ids, cu_seqlens=inputs["cu_seqlens"], max_seqlen=inputs["max_seqlen"]).logits
        alone = torch.cat([model(ids[:, a:b]).logits for a, b in zip(cu, cu[1:]) if b > a], dim=1)
        longer = model(ids, cu_seqlens=inputs["cu_seqlens"], max_seqlen=ids.shape[1]).logits  # an upper bound
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(longer, packed, rtol=1e-5, atol=1e-6)


def test_varlen_attention_host_length_equals_measured():
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 5, 12, 30, 31], dtype=torch.int32)  # includes an empty document
    n = 31
    q, k, v = (torch.randn(1, 3, n, 8, dtype=torch.float64) for _ in range(3))
    pos = position_in_document(n, cu, q.device)
    measured = varlen_causal_attention(q, k, v, cu, pos)
    assert torch.equal(varlen_causal_attention(q, k, v, cu, pos, 18), measured)
    torch.testing.assert_close(varlen_causal_attention(q, k, v, cu, pos, 32), measured, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
def test_packed_llama_step_reads_nothing_back(implicit):
    """A training micro-step (to_model_inputs, forward with the fused loss, backward) reads no tensor's values into
    Python: on CUDA it queues without waiting for the device. Without max_seqlen the model reads the offsets once per
    forward, not per layer or per fixed-point iteration (the detector is live: those reads are seen)."""
    def reads(layers, with_max):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            small_config("llama", dict(implicit) if implicit else None, layers=layers)).train()
        inputs = to_model_inputs(reader_batch(2), CPU)
        if not with_max:
            del inputs["max_seqlen"]
        with HostReads() as seen:
            model(**inputs, fused_loss=True).loss.backward()
        return seen.reads

    assert reads(2, True) == []
    once = reads(2, False)
    assert once and "cpu" in once
    assert reads(4, False) == once


def test_evaluation_passes_the_host_length(monkeypatch):
    from lm.train import evaluation

    seen = []
    model = AutoModelForCausalLM.from_config(small_config("llama")).eval()
    real = model.forward

    def forward(*a, **kw):
        seen.append(kw.get("max_seqlen"))
        return real(*a, **kw)

    monkeypatch.setattr(model, "forward", forward)
    dist = type("OneRank", (), {"all_reduce_sum": staticmethod(lambda values: values)})()
    batch = reader_batch(3)
    out = evaluation.evaluate(model, [batch], CPU, dist, "fp32")
    cu = batch["cu_seqlens"]
    assert seen == [int((cu[1:] - cu[:-1]).max())] and out["val_tokens"] == 48


# --- torch.compile -----------------------------------------------------------------------------------------

def test_compiled_blocks_take_the_host_length_without_graph_break():
    """Blocks compiled as the trainer does (model.compile): batches whose offsets and longest document differ run
    without a graph break (reading the length from the offsets inside the attention would break every block's graph)
    and recompile once (both sizes become symbolic), with the eager model's loss."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config("llama")).train()
    batches = [to_model_inputs(reader_batch(s), CPU) for s in range(5)]
    assert len({b["max_seqlen"] for b in batches}) >= 3 and len({b["cu_seqlens"].numel() for b in batches}) >= 3
    eager = [model(**b).loss.detach() for b in batches]
    cnt = CompileCounter()
    try:
        for layer in model.model.layers:
            layer.compile(backend=cnt)
        frames = []
        for b, ref in zip(batches, eager):
            loss = model(**b).loss
            loss.backward()
            torch.testing.assert_close(loss.detach(), ref, rtol=1e-6, atol=1e-6)
            frames.append(cnt.frame_count)
        breaks = dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert not breaks, breaks
    assert frames[0] > 0 and frames[-1] <= 2 * frames[0], frames  # at most one recompile per block
