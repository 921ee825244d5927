"""Checks shared by the model-family tests (imported by the test files; pytest puts tests/ on sys.path)."""
import torch


def overfit_losses(model, ids, steps: int = 30, lr: float = 1e-2, batch: int | None = None) -> list[float]:
    """Losses of `steps` AdamW steps (labels = inputs) on the batch `ids`, or, with `batch`, on its rows `batch`
    at a time in turn."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x = ids if batch is None else ids[(step * batch) % len(ids):(step * batch) % len(ids) + batch]
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def markov_tokens(n_seq: int, length: int, seed: int, vocab: int = 64, p_rare: float = 0.2) -> torch.Tensor:
    """(n_seq, length) tokens of a Markov chain in which each token has a likely successor and, with probability
    `p_rare`, a rarer one: a corpus a tiny model learns in a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, vocab, (vocab, 2), generator=g)
    x = torch.empty(n_seq, length, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (n_seq,), generator=g)
    for t in range(1, length):
        x[:, t] = nxt[x[:, t - 1], (torch.rand(n_seq, generator=g) < p_rare).long()]
    return x


def loss_and_grads(model, ids, cu_seqlens=None):
    """Loss (labels = ids) and the parameter gradients of one backward, grads zeroed first."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, cu_seqlens=cu_seqlens).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step_after(model, ids, cu_seqlens, swap):
    """The loss and parameter gradients of `model` on `ids` equal those after `swap()` (which puts a reference
    path in place): to 1e-12 in float64, rtol 1e-5 / atol 1e-6 in float32."""
    loss, grads = loss_and_grads(model, ids, cu_seqlens)
    swap()
    ref_loss, ref_grads = loss_and_grads(model, ids, cu_seqlens)
    dtype = next(model.parameters()).dtype
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, **tol)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], **tol, msg=n)


def greedy_by_full_forward(model, ids, n: int, sequential: bool = False):
    """Greedy decoding by repeated full forwards (no cache reuse); implicit models in the sequential
    (token-by-token) mode from scratch, which is what cached generation must reproduce exactly."""
    from lm.models import LMCache

    for _ in range(n):
        with torch.no_grad():
            if sequential:
                logits = model(ids, cache=LMCache(model.config.num_hidden_layers), use_cache=True,
                               prefill="sequential").logits
            else:
                logits = model(ids).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


def assert_incremental_equals_full(model, vocab: int = 64, split: int = 9, length: int = 14):
    """Prefill `split` tokens with a cache, then single steps: the logits equal one full forward."""
    from lm.models import LMCache

    ids = torch.randint(0, vocab, (2, length))
    with torch.no_grad():
        full = model(ids).logits
        cache = LMCache(model.config.num_hidden_layers)
        parts = [model(ids[:, :split], cache=cache, use_cache=True).logits]
        for i in range(split, length):
            parts.append(model(ids[:, i: i + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)


def assert_generation_and_packing(model, implicit: bool, vocab: int = 256):
    """On the model's device: greedy `generate` equals greedy by full forwards (implicit: the sequential
    mode from scratch), and three packed documents (cu_seqlens) give the logits of the batched forward."""
    dev = next(model.parameters()).device
    prompt = torch.randint(1, vocab, (2, 7), device=dev)
    with torch.no_grad():
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                             pad_token_id=0, eos_token_id=None, prefill="sequential")
        assert torch.equal(gen, greedy_by_full_forward(model, prompt, 10, sequential=implicit))
        docs = torch.randint(0, vocab, (3, 70), device=dev)
        batch = model(docs).logits
        cu = torch.tensor([0, 70, 140, 210], device=dev, dtype=torch.int32)
        packed = model(docs.reshape(1, -1), cu_seqlens=cu).logits
        err = ((packed.reshape(3, 70, -1).float() - batch.float()).norm() / batch.float().norm().clamp_min(1e-30))
        assert err.item() < 1e-4
