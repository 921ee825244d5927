"""Left-padded batches with their attention_mask (issue 61, item 2), CPU, float32: every family, explicit and
implicit, gives each row what its prompt gives alone. The forward's logits at a row's real positions, and `generate`
(greedy, decode "eager" and "static"; the "graph" path is the static step captured: tests/test_left_padding_gpu.py)
with the same tokens and per-step logits. Pads are identity steps of every mixer and held at zero in the implicit
solve, so the only differences are rounding (other chunk boundaries and matrix shapes): logits agree to 1e-4.
Also: the padding that is refused (pads between real tokens; right padding with a cache; pads with cu_seqlens),
the padded static decoder beside the unpadded one, chunked prefill, and lm-eval's generate_until at batch 16 against
batch 1 on a local task.

The models are built with initializer_range 0.2 (implicit ones 0.1): at the presets' 0.02 a tiny random model's next
token hardly depends on the context, and the ignored-mask bug this guards against did not change a single greedy
token. At 0.2 the implicit maps are far from contractive and their 12 iterations amplify float32 rounding to ~3e-4 in
the logits (in float64 the padded rows agree to 1e-12); at 0.1 they agree to ~2e-5 and the tolerance 0.1 stops the
rows of a batch after different iteration counts (which test_implicit_rows_stop_as_alone compares)."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import lm  # noqa: F401  (registration)
from lm.models import LMCache
from lm.models import decode as D
from lm.models.presets import load_config

V = 64
SMALL = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, initializer_range=0.2)
FAMILIES = {
    "llama": ("lm_llama-tiny", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)),
    "mamba2": ("lm_mamba2-tiny", dict(d_state=8, headdim=8, chunk_size=16)),
    "deltaproduct": ("lm_deltaproduct-tiny", dict(num_heads=2, head_dim=16, intermediate_size=64, chunk_size=16)),
    "deltaproduct_gated": ("lm_deltaproduct-tiny", dict(num_heads=2, head_dim=16, intermediate_size=64,
                                                        chunk_size=16, use_forget_gate=True, use_output_gate=True)),
    "lru": ("lm_lru-tiny", dict(intermediate_size=64, chunk_size=8)),
    "hlru": ("lm_lru-tiny-hlru", dict(intermediate_size=64, num_states=12, block_size=3, chunk_size=8)),
    "bdlru": ("lm_lru-tiny-bdlru", dict(intermediate_size=64, num_states=12, block_size=3, chunk_size=8)),
    "fp_mamba": ("lm_fp_mamba-tiny", dict(d_state=8, headdim=8, chunk_size=16, layer_solver={"eval_cap": 30})),
}
# the free phase (tolerance stop, per-row freezing) in evaluation / generation: at initializer_range 0.1 the rows of a
# batch reach tol 0.1 after different iteration counts, some not within eval_max_iter = 12
IMPLICIT = dict(max_iter=4, tol=0.1, eval_factor=3)
LENGTHS = (5, 1, 19, 11)  # longest 19: across a chunk boundary (chunk 16 / 8); the shortest is one token
TOL = dict(rtol=1e-4, atol=1e-4)
# implicit models in float32: the solve's iterations amplify the rounding of other matrix shapes (a row without pads
# of a batch differs from its prompt alone by up to ~4e-4 after 8 decode steps); test_float64 checks them to 1e-9
TOL_IMPLICIT = dict(rtol=1e-3, atol=1e-3)
TOL_64 = dict(rtol=1e-9, atol=1e-9)


def make(family, implicit=None, seed=0, **over):
    preset, kw = FAMILIES[family]
    torch.manual_seed(seed)
    init = dict(initializer_range=0.1) if implicit else {}
    cfg = load_config(preset, **{**SMALL, **init, **kw, **over}, implicit=implicit)
    return AutoModelForCausalLM.from_config(cfg).eval()


def prompts(seed=1, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=g) for n in lengths]


def left_pad(ps, pad_id=0):
    """(ids, mask): the prompts left-padded to the longest."""
    T = max(len(p) for p in ps)
    ids = torch.full((len(ps), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(ps), T, dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, T - len(p):] = p
        mask[i, T - len(p):] = 1
    return ids, mask


def generate(model, ids, mask, decode, n=8, **kw):
    args = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
                output_logits=True, return_dict_in_generate=True)
    args.update(kw)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, decode=decode, **args)
    logits = torch.stack(out.logits, dim=1) if out.logits is not None else None  # (b, n, V)
    return out.sequences[:, ids.shape[1]:], logits


def tolerance(model):
    if next(model.parameters()).dtype == torch.float64:
        return TOL_64
    return TOL_IMPLICIT if model.config.implicit is not None else TOL


def assert_batch_equals_alone(model, ps, decode, n=8, **kw):
    ids, mask = left_pad(ps)
    tokens, logits = generate(model, ids, mask, decode, n, **kw)
    for i, p in enumerate(ps):
        alone_tokens, alone_logits = generate(model, p[None], torch.ones(1, len(p), dtype=torch.long), decode, n,
                                              **kw)
        assert torch.equal(tokens[i], alone_tokens[0]), f"row {i} (length {len(p)})"
        torch.testing.assert_close(logits[i], alone_logits[0], **tolerance(model),
                                   msg=lambda m: f"row {i} (length {len(p)}): {m}")


CASES = [(f, None) for f in FAMILIES] + [(f, IMPLICIT) for f in FAMILIES]
IDS = [f for f in FAMILIES] + [f"{f}-implicit" for f in FAMILIES]


@pytest.mark.parametrize("family,implicit", CASES, ids=IDS)
def test_forward_padded_rows_equal_each_prompt(family, implicit):
    """The forward without a cache: left- and right-padded rows give each prompt's logits at its real positions."""
    model = make(family, implicit)
    ps = prompts()
    ids, mask = left_pad(ps)
    right_ids, right_mask = ids.clone(), mask.clone()
    for i, p in enumerate(ps):  # the same prompts padded on the right
        right_ids[i] = torch.cat([p, ids.new_zeros(ids.shape[1] - len(p))])
        right_mask[i] = torch.cat([mask.new_ones(len(p)), mask.new_zeros(ids.shape[1] - len(p))])
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        left = model(ids, attention_mask=mask).logits
        right = model(right_ids, attention_mask=right_mask).logits
        for i, p in enumerate(ps):
            alone = model(p[None]).logits[0]
            torch.testing.assert_close(left[i, ids.shape[1] - len(p):], alone, **tolerance(model))
            torch.testing.assert_close(right[i, :len(p)], alone, **tolerance(model))
    assert not [w for w in caught if "attention_mask" in str(w.message)], "a warning about attention_mask"


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("family,implicit", CASES, ids=IDS)
def test_generate_padded_batch_equals_each_prompt(family, implicit, decode):
    model = make(family, implicit)
    assert_batch_equals_alone(model, prompts(), decode)
    if decode == "static":
        assert D._DECODERS.get(model), "the static path did not run"


@pytest.mark.parametrize("family,implicit", CASES, ids=IDS)
def test_float64(family, implicit):
    """In float64 the rounding that float32 amplifies through the implicit solves is gone: the padded rows' logits
    (forward, and the generated steps) are their prompts' alone to 1e-9."""
    model = make(family, implicit).double()
    ps = prompts(lengths=(4, 1, 10))
    ids, mask = left_pad(ps)
    with torch.no_grad():
        left = model(ids, attention_mask=mask).logits
        for i, p in enumerate(ps):
            torch.testing.assert_close(left[i, ids.shape[1] - len(p):], model(p[None]).logits[0], **TOL_64)
    assert_batch_equals_alone(model, ps, "eager", n=4)


@pytest.mark.parametrize("family,implicit", [(f, IMPLICIT) for f in FAMILIES] + [("fp_mamba", None)],
                         ids=[f"{f}-implicit" for f in FAMILIES] + ["fp_mamba"])
def test_implicit_rows_stop_as_alone(family, implicit, monkeypatch):
    """The solve's per-row stopping: each row of the padded batch stops after the iterations its prompt alone takes
    (the pads are out of the residual), the stack's solve and FP-Mamba's solves inside its layers. (A batch runs its
    layers' solves for as many outer iterations as its slowest row: a row's own solves are the first ones.)"""
    from lm import fixed_point as fp

    counts = []
    real = fp._solve_free

    def spy(*args, **kwargs):
        z, st = real(*args, **kwargs)
        counts.append(st.sample_iterations.tolist())
        return z, st

    monkeypatch.setattr(fp, "_solve_free", spy)
    # (at tol 0.1 no row of the plain DeltaProduct's batch converges)
    model = make(family, dict(implicit, tol=0.2) if implicit else None)
    ps = prompts()
    ids, mask = left_pad(ps)
    with torch.no_grad():
        model(ids, attention_mask=mask)
        batch = counts[:]
        for i, p in enumerate(ps):
            counts.clear()
            model(p[None])
            n = len(counts)
            assert counts[-1][0] == batch[-1][i], f"row {i}: the last solve (the stack's, if implicit)"
            assert [c[0] for c in counts[:-1]] == [c[i] for c in batch[:n - 1]], f"row {i}: the layers' solves"
    assert len({c for row in batch for c in row}) > 1, "every row took as many iterations: nothing to compare"


@pytest.mark.parametrize("family", ["llama", "mamba2", "deltaproduct_gated"])
def test_implicit_sequential_prefill_padded(family):
    """The implicit models' sequential prefill (token by token; Mamba2's one-token step) with pads. In float64: in
    float32 the tolerance stop of a token's solve flips at one step for Gated DeltaProduct's one-token row (batch and
    alone differ by 2e-4 before that step, as a row without pads does), which changes its next token."""
    model = make(family, IMPLICIT).double()
    assert_batch_equals_alone(model, prompts(lengths=(4, 1, 7)), "eager", n=5, prefill="sequential")


def test_fp_mamba_parallel_prefill_padded():
    model = make("fp_mamba", prefill="parallel")
    assert_batch_equals_alone(model, prompts(lengths=(4, 1, 9)), "eager", n=5)


def test_implicit_bounded_solve_padded():
    """tol None (the bounded phase): every row runs eval_max_iter iterations, padded or not."""
    model = make("mamba2", dict(max_iter=3, tol=None, eval_factor=2))
    assert_batch_equals_alone(model, prompts(lengths=(6, 2, 9)), "static", n=6)


def test_fused_mamba2_inner_padded(monkeypatch):
    """On CUDA Mamba2 runs the fused operator (lm_kernels.mamba2): the pads' rows are masked in its input, here run
    in the Triton interpreter."""
    for op in ("conv1d", "ssd", "rmsnorm"):
        monkeypatch.setenv(f"LM_{op.upper()}_BACKEND", "triton")
    model = make("mamba2")
    from lm.models import mamba2 as m2

    calls = []
    real = m2.mamba2_inner
    monkeypatch.setattr(m2, "mamba2_inner", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert_batch_equals_alone(model, prompts(lengths=(3, 18)), "eager", n=2)
    assert calls, "the fused operator did not run"


@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_static_decoders_padded_and_unpadded_and_kv_growth(family, monkeypatch):
    """A padded batch decodes on a decoder of its own (its pad buffers), beside the unpadded one of the same batch
    size; attention's buffers that grow past their capacity keep the pads masked."""
    monkeypatch.setattr(D, "HEADROOM", 3)
    model = make(family)
    ps = prompts(lengths=(6, 2, 4))
    ids, mask = left_pad(ps)
    same = torch.randint(1, V, (3, 6))
    for n in (9, 70):
        for batch, m in ((ids, mask), (same, torch.ones_like(same))):
            assert torch.equal(generate(model, batch, m, "static", n)[0], generate(model, batch, m, "eager", n)[0])
    assert {k[2] for k in D._DECODERS[model]} == {False, True}
    assert_batch_equals_alone(model, ps, "static", n=70)
    assert_batch_equals_alone(model, prompts(seed=2, lengths=(1, 7, 3)), "static", n=12)  # other pads, same decoder


@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_beam_search_padded(family):
    """Beams reorder the cache (its pad mask too): a padded batch's beam search gives each prompt's, eager and on
    the static decoder."""
    model = make(family)
    ps = prompts(lengths=(5, 2, 8))
    ids, mask = left_pad(ps)
    for decode in ("eager", "static"):
        tokens, _ = generate(model, ids, mask, decode, 6, num_beams=3, output_logits=False)
        for i, p in enumerate(ps):
            alone, _ = generate(model, p[None], torch.ones(1, len(p), dtype=torch.long), decode, 6, num_beams=3,
                                output_logits=False)
            assert torch.equal(tokens[i], alone[0]), (decode, i)


@pytest.mark.parametrize("family", ["llama", "deltaproduct"])
def test_chunked_prefill_with_a_cache(family):
    """A padded prompt prefilled in two chunks (the first with the pads, the second's mask given over the cached and
    new tokens, as generate passes it): at the real tokens the logits of one padded forward."""
    model = make(family)
    ps = prompts(lengths=(7, 2, 5))
    ids, mask = left_pad(ps)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = LMCache(model.config.num_hidden_layers)
        a = model(ids[:, :4], attention_mask=mask[:, :4], cache=cache, use_cache=True).logits
        b = model(ids[:, 4:], attention_mask=mask, cache=cache, use_cache=True).logits
    real = mask.bool()
    torch.testing.assert_close(torch.cat([a, b], 1)[real], full[real], **TOL)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family,implicit", [(f, None) for f in ("llama", "mamba2", "deltaproduct_gated", "lru", "hlru",
                                                                  "fp_mamba")] + [("mamba2", IMPLICIT)],
                         ids=["llama", "mamba2", "deltaproduct_gated", "lru", "hlru", "fp_mamba", "mamba2-implicit"])
def test_loss_and_gradients_with_padding(family, implicit, side):
    """A padded batch with the pads' labels ignored: its summed loss and its parameter gradients are those of the
    prompts one by one (the masked path's backward; the -inf fills at pads give no NaN)."""
    model = make(family, implicit)
    ps = prompts(lengths=(6, 2, 9))
    ids, mask = left_pad(ps)
    if side == "right":
        for i, p in enumerate(ps):
            ids[i] = torch.cat([p, ids.new_zeros(ids.shape[1] - len(p))])
            mask[i] = torch.cat([mask.new_ones(len(p)), mask.new_zeros(ids.shape[1] - len(p))])
    labels = ids.masked_fill(mask == 0, -100)
    first = mask.argmax(1)  # each row's first real token: a left pad before it would predict it
    labels[torch.arange(len(ps)), first] = -100
    n_targets = int((labels[:, 1:] != -100).sum())

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads(lambda: model(ids, attention_mask=mask, labels=labels).loss * n_targets)
    ref_loss, ref_grads = loss_and_grads(lambda: sum(model(p[None], labels=p[None]).loss * (len(p) - 1)
                                                     for p in ps))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert grads[n].isfinite().all(), n
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-5, msg=n)


def test_refused_padding():
    model = make("mamba2")
    ps = prompts(lengths=(4, 2))
    ids, mask = left_pad(ps)
    right = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with pytest.raises(ValueError, match="left padding"):
        model.generate(ids, attention_mask=right, max_new_tokens=2, do_sample=False, pad_token_id=0)
    middle = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 1]])
    with pytest.raises(ValueError, match="one run"), torch.no_grad():
        model(ids, attention_mask=middle)
    with pytest.raises(ValueError, match="cu_seqlens"), torch.no_grad():
        model(ids[:1], attention_mask=torch.tensor([[0, 1, 1, 1]]), cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="shape"), torch.no_grad():
        model(ids, attention_mask=mask[:, 1:])
    cache = LMCache(model.config.num_hidden_layers)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="left padding"):  # a pad after the cached real tokens
            model(ids[:, :1], attention_mask=torch.tensor([[1], [0]]), cache=cache, use_cache=True)
    with torch.no_grad():  # all ones and cu_seqlens: nothing to mask
        model(ids[:1], attention_mask=torch.ones(1, 4), cu_seqlens=torch.tensor([0, 2, 4]))


# --- lm-eval: generate_until at batch 16 against batch 1 --------------------------------------------------------------

@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory):
    pytest.importorskip("lm_eval")
    import shutil

    from lm.data.prepare import prepare_data
    from lm.data.sources import shakespeare_files
    from lm.eval.local_tasks import build_local_tasks

    root = tmp_path_factory.mktemp("corpus")
    src = root / "txt"
    src.mkdir()
    for f in shakespeare_files()[:6]:
        shutil.copy(f, src / (f.stem + ".txt"))
    prepare_data(str(src / "*.txt"), root / "data", val_fraction=0.34, workers=0, progress=False)
    return build_local_tasks(root / "data", tmp_path_factory.mktemp("tasks"), n_lastword=12, n_continuation=40)


def _generate_until(model, tok, tasks, batch_size, limit):
    """lm-eval's samples of lm_local_generate: (prompt, the model's raw generated text) per document."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from lm.eval.harness import task_manager

    hflm = HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size, max_length=256, device="cpu")
    with torch.no_grad():
        out = lm_eval.simple_evaluate(model=hflm, tasks=["lm_local_generate"], limit=limit,
                                      task_manager=task_manager(str(tasks)), log_samples=True, bootstrap_iters=0)
    return {s["doc_id"]: s["resps"][0][0] for s in out["samples"]["lm_local_generate"]}


@pytest.mark.parametrize("family", ["mamba2", "llama"])
def test_lm_eval_generate_until_batch_16_equals_batch_1(family, local_tasks):
    """HFLM pads the contexts of a generate_until batch on the left and passes their attention_mask; the texts
    generated at batch 16 are those generated one by one (20 documents: a full batch of 16 and one of 4)."""
    from lm.data.tokenizer import load_tokenizer

    tok = load_tokenizer()
    model = make(family, vocab_size=len(tok), num_hidden_layers=2)
    one = _generate_until(model, tok, local_tasks, 1, 20)
    batched = _generate_until(model, tok, local_tasks, 16, 20)
    assert len(one) == 20 and one.keys() == batched.keys()
    assert batched == one
