"""Left-padded batches on CUDA (issue 61, item 2): the CPU checks of tests/test_left_padding.py on the Triton kernels
(Mamba2's fused operator, the SSD / conv / DeltaProduct / LRU kernels, the rope step of unpadded rows), with the
CUDA-graph decode step (decode="graph": the padded step, which reads the cache's pad buffers, captured), the implicit
prefill through its captured solve and committing pass (solve_graph: a key is captured at its second call), and the
masked path's backward through the fused kernels. Float32; the kernels' float32 products may round differently per
matrix shape (TF32 in Triton dots), so logits are compared to 2e-2 and the greedy tokens exactly.

    python -m pytest tests/test_left_padding_gpu.py -q
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import lm  # noqa: F401
from lm.models import decode as D
from lm.models import solve_graph as SG
from lm.models.presets import load_config

pytestmark = pytest.mark.gpu

V = 256
SMALL = dict(vocab_size=V, hidden_size=128, num_hidden_layers=3)
FAMILIES = {
    "llama": ("lm_llama-tiny", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)),
    "mamba2": ("lm_mamba2-tiny", dict(d_state=32, headdim=32, chunk_size=32)),
    "deltaproduct": ("lm_deltaproduct-tiny", dict(num_heads=2, head_dim=64, intermediate_size=256, chunk_size=32)),
    "deltaproduct_gated": ("lm_deltaproduct-tiny", dict(num_heads=2, head_dim=64, intermediate_size=256,
                                                        chunk_size=32, use_forget_gate=True, use_output_gate=True,
                                                        num_householder=3)),
    "lru": ("lm_lru-tiny", dict(intermediate_size=256, chunk_size=32)),
    "hlru": ("lm_lru-tiny-hlru", dict(intermediate_size=256, num_states=32, block_size=3, chunk_size=32)),
    "bdlru": ("lm_lru-tiny-bdlru", dict(intermediate_size=256, num_states=32, block_size=4, chunk_size=32)),
    "fp_mamba": ("lm_fp_mamba-tiny", dict(d_state=32, headdim=32, chunk_size=32, layer_solver={"eval_cap": 30})),
}
IMPLICIT = dict(max_iter=4, tol=0.1, eval_factor=3)
LENGTHS = (9, 1, 40, 23)  # across chunk boundaries (32)
TOL = dict(rtol=2e-2, atol=2e-2)


def make(family, implicit=None):
    preset, kw = FAMILIES[family]
    torch.manual_seed(0)
    init = 0.1 if implicit else 0.2  # (see tests/test_left_padding.py)
    cfg = load_config(preset, **{**SMALL, **kw}, initializer_range=init, implicit=implicit)
    return AutoModelForCausalLM.from_config(cfg).cuda().eval()


def prompts(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g).cuda() for n in lengths]


def left_pad(ps):
    T = max(len(p) for p in ps)
    ids = torch.zeros(len(ps), T, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):
        ids[i, T - len(p):] = p
        mask[i, T - len(p):] = 1
    return ids, mask


def generate(model, ids, mask, decode, n=12):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, decode=decode, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def assert_batch_equals_alone(model, ps, decode, n=12):
    ids, mask = left_pad(ps)
    tokens, logits = generate(model, ids, mask, decode, n)
    for i, p in enumerate(ps):
        alone_tokens, alone_logits = generate(model, p[None], torch.ones_like(p)[None], decode, n)
        diff = (logits[i] - alone_logits[0]).abs().max().item()
        print(f"row {i} (length {len(p)}): logits differ by {diff:.2e}")
        torch.testing.assert_close(logits[i], alone_logits[0], **TOL)
        assert torch.equal(tokens[i], alone_tokens[0]), f"row {i} (length {len(p)})"


GRAPH_FAMILIES = [f for f in FAMILIES if f != "fp_mamba"]  # FP-Mamba's step stops at its tolerance: no capture


@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
@pytest.mark.parametrize("family", GRAPH_FAMILIES)
def test_graph_decode_padded_batch_equals_each_prompt(family, implicit):
    model = make(family, implicit)
    assert_batch_equals_alone(model, prompts(), "graph")
    decoders = D._DECODERS[model]
    assert any(k[2] and d.graph is not None for k, d in decoders.items()), "no padded decode step was captured"


@pytest.mark.parametrize("implicit", [None, IMPLICIT], ids=["explicit", "implicit"])
def test_fp_mamba_padded_batch(implicit):
    model = make("fp_mamba", implicit)
    assert_batch_equals_alone(model, prompts(lengths=(5, 1, 20)), "eager", n=6)


@pytest.mark.parametrize("family", ["llama", "mamba2", "deltaproduct_gated", "bdlru"])
def test_implicit_captured_prefill_padded(family):
    """The implicit prefill of a padded batch through the captured solve and committing pass (the second call with
    a key captures it): the same tokens as the uncaptured first call and as each prompt alone."""
    model = make(family, IMPLICIT)
    ps = prompts()
    ids, mask = left_pad(ps)
    first = generate(model, ids, mask, "graph")
    second = generate(model, ids, mask, "graph")
    graphs, _ = SG._GRAPHS[model]
    assert any(k[0] for k in graphs) and any(not k[0] for k in graphs), "the prefill's solve / commit not captured"
    assert torch.equal(second[0], first[0])
    torch.testing.assert_close(second[1], first[1], **TOL)
    assert_batch_equals_alone(model, ps, "graph")


@pytest.mark.parametrize("family", ["llama", "mamba2", "deltaproduct_gated", "hlru"])
def test_loss_and_gradients_with_right_padding(family):
    """The masked path's backward on the Triton kernels (Mamba2's fused operator with -inf dt at pads): the padded
    batch's summed loss and gradients are those of the prompts one by one."""
    model = make(family)
    ps = prompts(lengths=(20, 3, 33))
    T = max(len(p) for p in ps)
    ids = torch.zeros(len(ps), T, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):
        ids[i, :len(p)] = p
        mask[i, :len(p)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    n_targets = int((labels[:, 1:] != -100).sum())

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads(lambda: model(ids, attention_mask=mask, labels=labels).loss * n_targets)
    ref_loss, ref_grads = loss_and_grads(lambda: sum(model(p[None], labels=p[None]).loss * (len(p) - 1)
                                                     for p in ps))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    for n in grads:
        assert grads[n].isfinite().all(), n
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=2e-2, atol=1e-3, msg=n)
