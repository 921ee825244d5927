"""Packed documents without a host wait in the forward: lm.train.data.to_model_inputs checks the offsets on the host
before their copy and hands the longest document's length on as `max_seqlen` and the offsets' host tensor as
`cu_seqlens_cpu`; LMModel.forward then reads nothing back from the offsets, the Llama attention pads to that host int,
the Mamba2 layers do not check the offsets again and the DeltaProduct layers build their chunk tables from the CPU
copy. Results equal the forward that measures the offsets itself (or reads them in every layer) and the per-document
reference; bad offsets still raise; a compiled block takes the int (and the CPU offsets) without a graph break of
its own and recompiles once."""
import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.data.reader import packed_cu_seqlens
from lm.models import LMDeltaProductConfig, LMFPMambaConfig, LMLlamaConfig, LMMamba2Config
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
    if family == "fp_mamba":
        return LMFPMambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=layers, d_state=8, headdim=16,
                               chunk_size=8, layer_solver={"max_iter": 3})
    if family == "deltaproduct":
        return LMDeltaProductConfig(vocab_size=V, hidden_size=32, num_hidden_layers=layers, num_heads=2, head_dim=16,
                                    intermediate_size=64, chunk_size=16, use_forget_gate=True, implicit=implicit)
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
    device): the methods that do it and, below them, aten._local_scalar_dense (what item/int/bool come down to);
    `reads` their names, `tensors` the tensors read."""

    def __init__(self):
        super().__init__()
        self.reads, self.tensors = [], []
        outer = self

        class _Scalars(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    outer.reads.append(str(func))
                    outer.tensors.append(args[0])
                return func(*args, **(kwargs or {}))

        self._scalars = _Scalars()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            self.reads.append(getattr(func, "__name__", str(func)))
            self.tensors.append(args[0])
        return func(*args, **(kwargs or {}))

    def besides(self, host) -> list[str]:
        """The reads of tensors other than `host` (the offsets' CPU copy, which ops may read: no wait for a
        device)."""
        return [r for r, t in zip(self.reads, self.tensors) if t is not host]

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
    assert inputs["cu_seqlens_cpu"].device == CPU and torch.equal(inputs["cu_seqlens_cpu"], cu)
    plain = to_model_inputs({k: v for k, v in batch.items() if k != "cu_seqlens"}, CPU)
    assert "max_seqlen" not in plain and "cu_seqlens_cpu" not in plain


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
    Python: on CUDA it queues without waiting for the device. Without max_seqlen and the host copy the model reads the
    offsets once per forward, not per layer or per fixed-point iteration (the detector is live: those reads are
    seen)."""
    def reads(layers, with_max):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            small_config("llama", dict(implicit) if implicit else None, layers=layers)).train()
        inputs = to_model_inputs(reader_batch(2), CPU)
        if not with_max:
            del inputs["max_seqlen"], inputs["cu_seqlens_cpu"]
        with HostReads() as seen:
            model(**inputs, fused_loss=True).loss.backward()
        return seen.reads

    assert reads(2, True) == []
    once = reads(2, False)
    assert once and "tolist" in once
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


# --- DeltaProduct and Mamba2: no read per layer ------------------------------------------------------------

# the backends of the mixers' ops: the CPU default (PyTorch references) and the Triton kernels (interpreter); Mamba2
# on Triton runs its conv, SSD and gated norm as the one operator lm_kernels.mamba2
BACKENDS = {"deltaproduct": ("LM_DELTAPRODUCT_BACKEND",),
            "mamba2": ("LM_SSD_BACKEND", "LM_CONV1D_BACKEND", "LM_RMSNORM_BACKEND")}


def _set_backend(monkeypatch, family: str, backend: str) -> None:
    for var in BACKENDS[family]:
        if backend == "triton":
            monkeypatch.setenv(var, "triton")
        else:
            monkeypatch.delenv(var, raising=False)


def _mixer_class(family: str):
    from lm.models.deltaproduct import DeltaProductMixer
    from lm.models.fp_mamba import FPMambaMixer
    from lm.models.mamba2 import Mamba2Mixer
    return {"deltaproduct": DeltaProductMixer, "mamba2": Mamba2Mixer, "fp_mamba": FPMambaMixer}[family]


def _packed_step(family: str, implicit, layers: int, offsets_only: bool = False):
    """A training micro-step on the reader's packed batch through to_model_inputs, with the offsets' "device" copy a
    tensor of its own (on CPU to_model_inputs hands over the reader's tensor itself): (the reads of anything but the
    host copy, or with `offsets_only` those of the device copy's values alone, loss, parameter gradients)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(family, dict(implicit) if implicit else None,
                                                          layers=layers)).train()
    inputs = to_model_inputs(reader_batch(2), CPU)
    cu = inputs["cu_seqlens"] = inputs["cu_seqlens"].clone()
    with HostReads() as seen:
        loss = model(**inputs, fused_loss=True).loss
        loss.backward()
    ptr = cu.untyped_storage().data_ptr()  # (a read may be of a view, e.g. cu.detach())
    reads = ([r for r, t in zip(seen.reads, seen.tensors) if t.untyped_storage().data_ptr() == ptr] if offsets_only
             else seen.besides(inputs["cu_seqlens_cpu"]))
    return reads, loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("family,implicit,backend", [
    ("deltaproduct", None, "reference"), ("deltaproduct", IMPLICIT, "reference"), ("deltaproduct", None, "triton"),
    ("mamba2", None, "reference"), ("mamba2", IMPLICIT, "reference"), ("mamba2", None, "triton")],
    ids=["deltaproduct", "deltaproduct-implicit", "deltaproduct-triton", "mamba2", "mamba2-implicit", "mamba2-triton"])
def test_packed_step_reads_nothing_back_per_layer(family, implicit, backend, monkeypatch, request):
    """DeltaProduct's ops take the offsets' CPU copy (its Triton path builds its chunk tables from it; the checks read
    it) and Mamba2's take max_seqlen as the sign that the model has checked the offsets: a micro-step reads nothing
    back from the offsets, in no layer and no fixed-point iteration. With the mixers' shared inputs taken away every
    layer reads them back (the detector sees those reads, more with more layers), with bit-identical results."""
    if backend == "triton":
        request.getfixturevalue("fast_interpreter")
    _set_backend(monkeypatch, family, backend)
    layers = 2 if backend == "reference" else 1  # (the Triton kernels in the interpreter take a while)
    reads, loss, grads = _packed_step(family, implicit, layers)
    assert reads == []
    monkeypatch.setattr(_mixer_class(family), "shared_inputs", lambda self, *a, **kw: {})
    per_layer, ref_loss, ref_grads = _packed_step(family, implicit, layers)
    assert torch.equal(loss, ref_loss)
    assert all((g is None and r is None) or torch.equal(g, r) for g, r in zip(grads, ref_grads))
    if backend == "reference":  # more layers, more reads (the reads per layer are the same on either backend)
        one_layer = _packed_step(family, implicit, 1)[0]
        assert 0 < len(one_layer) < len(per_layer), (one_layer, per_layer)
    else:
        assert per_layer


def test_fp_mamba_iterations_do_not_check_the_offsets_again(monkeypatch):
    """FP-Mamba's scans (one per fixed-point iteration of every layer) take max_seqlen too: the offsets are not read
    (its solver reads its residuals for its stopping rule: those reads stay), with bit-identical results."""
    reads, loss, grads = _packed_step("fp_mamba", None, 2, offsets_only=True)
    assert reads == []
    monkeypatch.setattr(_mixer_class("fp_mamba"), "shared_inputs", lambda self, *a, **kw: {})
    per_iteration, ref_loss, ref_grads = _packed_step("fp_mamba", None, 2, offsets_only=True)
    assert len(per_iteration) > 2  # read in every scan
    assert torch.equal(loss, ref_loss)
    assert all((g is None and r is None) or torch.equal(g, r) for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("family", ["deltaproduct", "mamba2"])
def test_packed_model_equals_each_document_alone(family):
    """The packed forward through to_model_inputs (host offsets, max_seqlen) gives each document's logits alone."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(family)).eval()
    inputs = to_model_inputs(reader_batch(1), CPU)
    ids, cu = inputs["input_ids"], inputs["cu_seqlens"].tolist()
    with torch.no_grad():
        packed = model(ids, cu_seqlens=inputs["cu_seqlens"].clone(), max_seqlen=inputs["max_seqlen"],
                       cu_seqlens_cpu=inputs["cu_seqlens_cpu"]).logits
        alone = torch.cat([model(ids[:, a:b]).logits for a, b in zip(cu, cu[1:]) if b > a], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["deltaproduct", "mamba2"])
def test_model_checks_the_host_offsets(family):
    """Offsets are still checked once per forward: on the host copy where one is given without max_seqlen, which
    must be a CPU integer tensor of the offsets' shape."""
    model = AutoModelForCausalLM.from_config(small_config(family)).eval()
    ids = torch.randint(0, V, (1, 20))
    good = torch.tensor([0, 7, 20], dtype=torch.int32)
    bad = torch.tensor([0, 7, 19], dtype=torch.int32)
    values = r"model: cu_seqlens must be non-decreasing from 0 to seq_len \(20\)"
    with pytest.raises(ValueError, match=values):
        model(ids, cu_seqlens=bad)
    with pytest.raises(ValueError, match=values):
        model(ids, cu_seqlens=good.clone(), cu_seqlens_cpu=bad)
    for wrong in (good[:2], good.float(), good.reshape(1, 3), torch.empty(3, dtype=torch.int32, device="meta")):
        with pytest.raises(ValueError, match="model: cu_seqlens_cpu must be a CPU int32/int64 tensor"):
            model(ids, cu_seqlens=good.clone(), cu_seqlens_cpu=wrong)
    with pytest.raises(ValueError, match="model: max_seqlen must be a non-negative int"):
        model(ids, cu_seqlens=good, max_seqlen=-1)


def _deltaproduct_inputs(cu):
    """Op inputs for packed documents at offsets cu: q (1,T,H,K); k, v, beta over T*nh rows (nh = 2); g (1,T,H)."""
    g = torch.Generator().manual_seed(0)
    T, H, K, nh = cu[-1], 2, 16, 2
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(1, T, H, K), r(1, T * nh, H, K), r(1, T * nh, H, K), torch.rand(1, T * nh, H, generator=g),
            -torch.rand(1, T, H, generator=g)), dict(num_householder=nh, use_qk_l2norm=True, chunk_size=16)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_deltaproduct_op_reads_the_host_copy(backend):
    """chunk_deltaproduct with cu_seqlens_cpu reads the offsets only there, with the results of the call that reads
    cu_seqlens; bad offsets raise from either, and a host copy that is not one."""
    from lm_kernels.deltaproduct import chunk_deltaproduct

    offsets = [0, 5, 5, 21, 40]  # an empty document; chunks of 16 rows over 2 rows per token
    cu = torch.tensor(offsets, dtype=torch.int32)
    host = cu.clone()
    args, kw = _deltaproduct_inputs(offsets)
    with HostReads() as seen:
        o, ht = chunk_deltaproduct(*args, **kw, cu_seqlens=cu, cu_seqlens_cpu=host, output_final_state=True,
                                   backend=backend)
    assert seen.besides(host) == [] and "tolist" in seen.reads
    with HostReads() as seen:
        ref_o, ref_ht = chunk_deltaproduct(*args, **kw, cu_seqlens=cu, output_final_state=True, backend=backend)
    assert seen.besides(None)  # without the copy, the offsets are read (the detector sees it)
    assert torch.equal(o, ref_o) and torch.equal(ht, ref_ht)
    bad = torch.tensor([0, 5, 3, 21, 40], dtype=torch.int32)
    values = r"deltaproduct: cu_seqlens must be non-decreasing from 0 to seq_len \(40\)"
    with pytest.raises(ValueError, match=values):
        chunk_deltaproduct(*args, **kw, cu_seqlens=bad, backend=backend)
    with pytest.raises(ValueError, match=values):
        chunk_deltaproduct(*args, **kw, cu_seqlens=cu, cu_seqlens_cpu=bad, backend=backend)
    with pytest.raises(ValueError, match="deltaproduct: cu_seqlens_cpu must be a CPU int32/int64 tensor"):
        chunk_deltaproduct(*args, **kw, cu_seqlens=cu, cu_seqlens_cpu=host[:-1], backend=backend)


@pytest.mark.parametrize("op", ["ssd_scan-reference", "ssd_scan-triton", "mamba2_inner"])
def test_ssd_ops_skip_the_check_with_max_seqlen(op):
    """The SSD scan and Mamba2's inner operator read and check the offsets unless given max_seqlen (the caller has
    checked them): then nothing is read, with the same results; bad offsets without it and a max_seqlen that is not
    an int raise."""
    from lm_kernels.mamba2 import mamba2_inner
    from lm_kernels.ssd import ssd_scan

    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 9, 9, 30, 37], dtype=torch.int32)
    b, t, h, p, n = 1, 37, 4, 8, 8
    if op == "mamba2_inner":
        d_inner, conv_dim = h * p, h * p + 2 * n
        args = (torch.randn(b, t, 2 * d_inner + 2 * n + h, generator=g), torch.randn(conv_dim, 4, generator=g) / 2,
                torch.randn(conv_dim, generator=g), -torch.rand(h, generator=g))
        kw = dict(d_inner=d_inner, headdim=p, ngroups=1, dstate=n, chunk_size=16, D=torch.ones(h),
                  dt_bias=torch.zeros(h), norm_weight=torch.ones(d_inner))

        def run(**extra):
            return mamba2_inner(*args, **kw, **extra)[0]
    else:
        args = (torch.randn(b, t, h, p, generator=g), torch.randn(b, t, h, generator=g), -torch.rand(h, generator=g),
                torch.randn(b, t, 1, n, generator=g), torch.randn(b, t, 1, n, generator=g))
        backend = op.split("-")[1]

        def run(**extra):
            return ssd_scan(*args, chunk_size=16, backend=backend, **extra)[0]

    with HostReads() as seen:
        y = run(cu_seqlens=cu, max_seqlen=21)
    assert seen.reads == []
    with HostReads() as seen:
        ref = run(cu_seqlens=cu)
    assert seen.reads  # the check reads the offsets (the detector sees it)
    assert torch.equal(y, ref)
    with pytest.raises(ValueError, match=r"ssd: cu_seqlens must be non-decreasing from 0 to seq_len \(37\)"):
        run(cu_seqlens=torch.tensor([0, 9, 30, 36], dtype=torch.int32))
    for wrong in (-1, 21.0, True):
        with pytest.raises(ValueError, match="ssd: max_seqlen must be a non-negative int"):
            run(cu_seqlens=cu, max_seqlen=wrong)


# --- torch.compile -----------------------------------------------------------------------------------------

def _run_compiled(model, batches, eager, backend):
    """The blocks compiled as the trainer does (with a dynamo test `backend`), a training micro-step per batch, each
    loss equal to the eager model's: (the backend's frame count after each batch, the graph breaks)."""
    from torch._dynamo.utils import counters

    counters.clear()
    try:
        for layer in model.model.layers:
            layer.compile(backend=backend)
        frames = []
        for b, ref in zip(batches, eager):
            loss = model(**b).loss
            loss.backward()
            torch.testing.assert_close(loss.detach(), ref, rtol=1e-6, atol=1e-6)
            frames.append(backend.frame_count)
        return frames, dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()


def test_compiled_blocks_take_the_host_length_without_graph_break():
    """Blocks compiled as the trainer does (model.compile): batches whose offsets and longest document differ run
    without a graph break (reading the length from the offsets inside the attention would break every block's graph)
    and recompile once (both sizes become symbolic), with the eager model's loss."""
    from torch._dynamo.testing import CompileCounterWithBackend, EagerAndRecordGraphs

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config("llama")).train()
    batches = [to_model_inputs(reader_batch(s), CPU) for s in range(5)]
    assert len({b["max_seqlen"] for b in batches}) >= 3 and len({b["cu_seqlens"].numel() for b in batches}) >= 3
    eager = [model(**b).loss.detach() for b in batches]
    graphs = EagerAndRecordGraphs()
    frames, breaks = _run_compiled(model, batches, eager, CompileCounterWithBackend(graphs))
    assert not breaks, breaks
    assert frames[0] > 0 and frames[-1] <= 2 * frames[0], frames  # at most one recompile per block
    # the document lookup runs once per forward outside the blocks (inductor of torch 2.11 fails to lower a
    # searchsorted on a slice of the offsets inside a block's graph)
    ops = {str(n.target) for g in graphs.graphs for n in g.graph.nodes}
    assert graphs.graphs and not any("searchsorted" in o for o in ops), sorted(o for o in ops if "search" in o)


@pytest.mark.parametrize("family,backend", [("deltaproduct", "reference"), ("mamba2", "reference"),
                                            ("mamba2", "triton")], ids=["deltaproduct", "mamba2", "mamba2-triton"])
def test_compiled_blocks_take_the_host_offsets(family, backend, monkeypatch, request):
    """DeltaProduct and Mamba2 blocks compiled as the trainer does: the CPU offsets (DeltaProduct) and max_seqlen
    (Mamba2) are graph inputs that change from batch to batch, so the blocks recompile once (the sizes become
    symbolic) and no more, and give the eager model's loss. On CPU DeltaProduct's op and the reference SSD are
    torch.compiler.disable calls (graph breaks of their own); Mamba2's Triton operator is traced, with max_seqlen
    symbolic in its argument check, without a graph break."""
    from torch._dynamo.testing import CompileCounter

    if backend == "triton":
        request.getfixturevalue("fast_interpreter")
    _set_backend(monkeypatch, family, backend)
    torch._dynamo.reset()
    torch.manual_seed(0)
    # (the Triton operator in the interpreter takes a while: one layer, three batches)
    model = AutoModelForCausalLM.from_config(small_config(family, layers=2 if backend == "reference" else 1)).train()
    batches = [to_model_inputs(reader_batch(s), CPU) for s in range(5 if backend == "reference" else 3)]
    assert len({b["max_seqlen"] for b in batches}) == len(batches)
    eager = [model(**b).loss.detach() for b in batches]
    frames, breaks = _run_compiled(model, batches, eager, CompileCounter())
    assert frames[0] > 0 and frames[-1] <= 2 * frames[0], frames  # at most one recompile per compiled frame
    if backend == "triton":
        assert not breaks, breaks


def test_compiled_fp_mamba_blocks_hold_no_document_lookup():
    """FP-Mamba's document mask is formed once per forward outside its compiled blocks: no searchsorted in a block's
    graph (torch 2.11's inductor cannot lower one on a slice of the offsets), with the eager model's loss."""
    from torch._dynamo.testing import CompileCounterWithBackend, EagerAndRecordGraphs

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config("fp_mamba")).train()
    inputs = to_model_inputs(reader_batch(1), CPU)
    graphs = EagerAndRecordGraphs()
    _run_compiled(model, [inputs], [model(**inputs).loss.detach()], CompileCounterWithBackend(graphs))
    # (on CPU the conv runs its PyTorch reference, which looks the documents up itself; on CUDA the Triton conv does not)
    lookups = [n.meta.get("stack_trace", "") for g in graphs.graphs for n in g.graph.nodes
               if "searchsorted" in str(n.target)]
    assert graphs.graphs and not [s for s in lookups if "conv1d/reference.py" not in s], lookups


def test_bad_offsets_error_names_the_first_bad_one_and_stays_short():
    """A long cu_seqlens that decreases somewhere is refused with the offending pair and the list's ends only
    (not tens of thousands of offsets in the message); a wrong first or last offset is named as such."""
    from lm_kernels.varlen import check_cu_seqlens

    cu = torch.arange(0, 20001, dtype=torch.int64)
    cu[7000] = 5
    with pytest.raises(ValueError, match=r"^ssd: cu_seqlens must be non-decreasing from 0 to seq_len \(20000\), got "
                                         r"\[0, 1, 2, 3, 4, 5, \.\.\., 19995, 19996, 19997, 19998, 19999, 20000\] "
                                         r"\(20001 offsets\): cu_seqlens\[7000\] = 5 < cu_seqlens\[6999\] = 6999$") as e:
        check_cu_seqlens(cu, 1, 20000, "ssd")
    assert len(str(e.value)) < 300
    with pytest.raises(ValueError, match=r"\): cu_seqlens\[-1\] = 20000$"):
        check_cu_seqlens(cu.sort().values, 1, 19999, "ssd")
    with pytest.raises(ValueError, match=r"got \[1, 3, 4\] \(3 offsets\): cu_seqlens\[0\] = 1$"):
        check_cu_seqlens(torch.tensor([1, 3, 4]), 1, 4, "ssd")
