"""Cross-entropy of the LM head without the (tokens x vocab) logits in memory.

    loss = linear_cross_entropy(h, weight, targets)      # == F.cross_entropy((h @ weight.T).float(), targets)

The tokens go through the head in chunks: the forward keeps only each token's log-sum-exp (fp32), and
the backward recomputes one chunk's logits at a time to form softmax - onehot. For a 350M model with a
50k vocabulary at micro-batch 8 x 2048 the unfused path holds bf16 logits, their fp32 copy and the fp32
gradient (~8 GB); this holds one chunk of them (~0.4 GB at 8192 tokens) and recomputes the head's matmul
once more in the backward (+1/3 of the head's FLOPs). The logits are rounded to the head's dtype before
the softmax, as the unfused path's `lm_head(h).float()` does, so both give the same numbers.

On CUDA the gradient is formed in the forward instead ("grad_in_forward"): per chunk, one Triton kernel
(lm_kernels.cross_entropy) reads the bf16 logits twice, writes softmax - onehot over them in place, and
the chunk's dh and dW products follow at once; the backward only scales them by the incoming gradient.
No fp32 copy of the logits, no second head matmul in the backward. On an H100 the recompute path's
elementwise fp32 passes (to float, logsumexp, exp, scatter, scale, cast) took ~40 ms of a 242 ms
Llama-350M step at 16 x 2048 tokens. It holds dh (like h) and an fp32 dW from the forward to the backward.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _chunks(n: int, size: int):
    for s in range(0, n, size):
        yield s, min(n, s + size)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_tokens: int, ignore_index: int):
        acc = torch.promote_types(h.dtype, torch.float32)  # fp32 softmax math (fp64 for fp64 inputs)
        valid = targets != ignore_index
        n_valid = valid.sum()
        lse = torch.empty(h.shape[0], dtype=acc, device=h.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        safe_t = torch.where(valid, targets, 0)
        for s, e in _chunks(h.shape[0], chunk_tokens):
            logits = (h[s:e] @ weight.t()).to(acc)
            lse[s:e] = torch.logsumexp(logits, dim=-1)
            tgt = logits.gather(1, safe_t[s:e, None])[:, 0]
            total += torch.where(valid[s:e], lse[s:e] - tgt, 0.0).sum()
        ctx.save_for_backward(h, weight, safe_t, valid, lse, n_valid)
        ctx.chunk_tokens = chunk_tokens
        return total / n_valid.clamp_min(1)  # an all-ignored batch gives 0 (F.cross_entropy gives nan)

    @staticmethod
    def backward(ctx, grad):
        h, weight, safe_t, valid, lse, n_valid = ctx.saved_tensors
        acc = lse.dtype
        scale = grad.to(acc) / n_valid.clamp_min(1)
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        for s, e in _chunks(h.shape[0], ctx.chunk_tokens):
            logits = (h[s:e] @ weight.t()).to(acc)
            p = torch.exp(logits - lse[s:e, None])
            p.scatter_add_(1, safe_t[s:e, None], torch.full((e - s, 1), -1.0, dtype=acc, device=p.device))
            p = (p * torch.where(valid[s:e], scale, 0.0)[:, None]).to(h.dtype)
            if dh is not None:
                dh[s:e] = p @ weight
            if dw is not None:
                dw += (p.t() @ h[s:e]).to(acc)
        return dh, (dw.to(weight.dtype) if dw is not None else None), None, None, None


class _LinearCrossEntropyGradInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_tokens: int, ignore_index: int):
        from lm_kernels.cross_entropy import ce_rows_  # noqa: PLC0415

        valid = targets != ignore_index
        inv = 1.0 / valid.sum().clamp_min(1).to(torch.float32)  # an all-ignored batch gives 0
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s, e in _chunks(h.shape[0], chunk_tokens):
            logits = h[s:e] @ weight.t()
            _, loss = ce_rows_(logits, targets[s:e], inv, ignore_index, write_grad=True)  # logits := dloss/dlogits
            total += loss.sum()
            if dh is not None:
                torch.mm(logits, weight, out=dh[s:e])
            if dw is not None:
                dw += (logits.t() @ h[s:e]).float()
        ctx.save_for_backward(dh, dw)
        ctx.w_dtype = weight.dtype
        return total * inv

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        # the scale in float32: rounded to bf16 first, a 1/3 (three accumulation steps) would be off by 0.2%
        gh = (dh.float() * grad.float()).to(dh.dtype) if dh is not None else None
        gw = (dw * grad.float()).to(ctx.w_dtype) if dw is not None else None
        return gh, gw, None, None, None


def _forward_only_loss(h, weight, targets, chunk_tokens: int, ignore_index: int):
    """No gradient wanted on CUDA: the Triton row kernel without the gradient pass, no fp32 logits."""
    from lm_kernels.cross_entropy import ce_rows_  # noqa: PLC0415

    valid = targets != ignore_index
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for s, e in _chunks(h.shape[0], chunk_tokens):
        _, loss = ce_rows_(h[s:e] @ weight.t(), targets[s:e], 1.0, ignore_index, write_grad=False)
        total += loss.sum()
    return total / valid.sum().clamp_min(1).to(torch.float32)


_IMPLS = ("recompute", "grad_in_forward")


@functools.lru_cache(maxsize=None)
def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001
        return False
    return True


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_tokens: int = 8192, ignore_index: int = -100, impl: str | None = None) -> torch.Tensor:
    """Mean cross-entropy of `h @ weight.T` (h (..., d), weight (V, d)) against `targets` (...), ignoring
    `ignore_index`, computed chunk by chunk (see the module docstring). `impl`: "recompute" (PyTorch, the
    backward recomputes each chunk's logits), "grad_in_forward" (Triton row kernel, the gradient formed in
    the forward) or None: grad_in_forward for bf16/fp16/fp32 on CUDA, recompute otherwise."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if impl is not None and impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS} or None, got {impl!r}")
    d = h.shape[-1]
    if weight.shape[-1] != d:
        raise ValueError(f"weight has {weight.shape[-1]} input features, h has {d}")
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        # the head runs in the autocast dtype, as nn.Linear would; the function itself runs with autocast
        # off so that its backward recomputes the logits in the same dtype as its forward
        dt = torch.get_autocast_dtype(dev)
        h, weight = h.to(dt), weight.to(dt)
    elif h.dtype != weight.dtype:
        raise ValueError(f"h is {h.dtype} and weight {weight.dtype}: cast one, or run under torch.autocast")
    if impl is None:
        impl = "grad_in_forward" if (h.is_cuda and h.dtype != torch.float64 and _triton_ok()) else "recompute"
    return _chunked_loss(h.reshape(-1, d), weight, targets.reshape(-1), chunk_tokens, ignore_index, impl)


# An eager island under torch.compile (a whole compiled model): dynamo-traced autograd Functions lost their gradient
# on the GPU image (torch 2.11, CUDA; seen with the RMSNorm's, lm.models.layers.rms_norm), and the grad-in-forward
# Function launches Triton kernels with host-side chunking anyway.
@torch.compiler.disable
def _chunked_loss(h2, weight, t2, chunk_tokens: int, ignore_index: int, impl: str):
    with torch.autocast(h2.device.type, enabled=False):
        if impl == "recompute":
            return _LinearCrossEntropy.apply(h2, weight, t2, chunk_tokens, ignore_index)
        if torch.is_grad_enabled() and (h2.requires_grad or weight.requires_grad):
            return _LinearCrossEntropyGradInForward.apply(h2.contiguous(), weight, t2, chunk_tokens, ignore_index)
        return _forward_only_loss(h2, weight, t2, chunk_tokens, ignore_index)


def logits_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of logits (..., V) against targets (...): fp32 softmax math for bf16/fp16
    logits, fp64 stays fp64."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)


def reference_cross_entropy(h, weight, targets, ignore_index: int = -100):
    """The unfused path: what `linear_cross_entropy` must equal."""
    return logits_cross_entropy(F.linear(h, weight), targets, ignore_index)
