"""Llama: causal self-attention (RoPE, SDPA, grouped KV heads, optionally a sliding window) + SwiGLU, explicit or
implicit.

In the implicit model the injection is added to the fused Q, K, V projection (paper 003, sec. 3.2).

Sliding window (`sliding_window` = w, None for full attention): each token sees itself and the w - 1 tokens before
it (fla's `window_size` and Mistral's `sliding_window` mean the same). Training runs SDPA under a banded causal mask
made once per forward (`causal_mask`; SDPA's masked kernels, not its flash path), packed documents the same band per
document; generation keeps every key in the cache (dynamic or static) and masks the ones behind the window.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm_kernels.rope import rope_kv_step
from lm_kernels.varlen import document_and_position

from .config import LMConfig
from .context_parallel import attention_cp
from .layers import apply_rotary, rotary_cos_sin
from .modeling import LMForCausalLM, LMModel, Mixer


class LMLlamaConfig(LMConfig):
    model_type = "lm_llama"
    _fields = {
        "num_attention_heads": 4,
        "num_key_value_heads": None,  # None = num_attention_heads
        "head_dim": None,  # None = hidden_size // num_attention_heads
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "sliding_window": None,  # None = full causal attention; w = each token sees itself and the w - 1 before it
    }

    def __init__(self, **kwargs):
        kwargs.setdefault("intermediate_size", 688)
        super().__init__(**kwargs)

    def validate(self):
        super().validate()
        self._check(isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0,
                    "num_attention_heads", "must be a positive integer")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self._check(self.hidden_size % self.num_attention_heads == 0, "num_attention_heads",
                        f"must divide hidden_size={self.hidden_size} (or set head_dim)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        self._check(isinstance(self.num_key_value_heads, int) and self.num_key_value_heads > 0
                    and self.num_attention_heads % self.num_key_value_heads == 0,
                    "num_key_value_heads", "must be a positive divisor of num_attention_heads")
        self._check(isinstance(self.head_dim, int) and self.head_dim > 0 and self.head_dim % 2 == 0,
                    "head_dim", "must be a positive even integer")
        self._check(self.rope_theta > 0, "rope_theta", "must be > 0")
        self._check(self.sliding_window is None or (isinstance(self.sliding_window, int)
                                                    and not isinstance(self.sliding_window, bool)
                                                    and self.sliding_window > 0),
                    "sliding_window", "must be None (full attention) or a positive integer")


def causal_mask(t: int, s: int, window: int | None, device) -> torch.Tensor:
    """(t, s) bool: which of s keys each of t new tokens sees, the new tokens being the last t of the s: key j is
    seen by new token i (key index q = s - t + i) where j <= q and, with a sliding window w, j > q - w."""
    q = torch.arange(s - t, s, device=device).unsqueeze(1)
    j = torch.arange(s, device=device)
    seen = j <= q
    return seen if window is None else seen & (j > q - window)


class Attention(Mixer):
    reads_input_once = True  # x only through qkv_proj (Mixer.reads_input_once)
    capturable = True  # (Mixer.capturable)

    def __init__(self, config: LMLlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.window = config.sliding_window
        self.qkv_proj = nn.Linear(config.hidden_size, self.injection_dim(config), bias=config.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    @staticmethod
    def injection_dim(config) -> int:
        return (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim

    def flops_per_token(self, seq_len: int) -> float:
        # causal QK^T and AV: 2 matmuls of (t x d), 2 FLOPs per MAC, over the keys a token sees: t/2 on average,
        # with a window w < t: (w (w + 1) / 2 + (t - w) w) / t
        w = seq_len if self.window is None else min(self.window, seq_len)
        keys = (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len if self.window is not None else seq_len / 2
        return 2 * 2 * self.n_heads * self.head_dim * keys

    def shared_inputs(self, t: int, cu_seqlens, device, positions=None, max_seqlen=None, cu_seqlens_cpu=None,
                      key_mask=None) -> dict:
        """The rotary tables (cos, sin), float32 (t, head_dim), computed once per model forward; with packed documents
        also each token's document and position in it (`packed`), and the longest document's length (a host int:
        varlen_causal_attention then reads nothing from the device). The document lookup (a searchsorted on the
        offsets) stays out of the compiled blocks: inductor (torch 2.11) cannot lower it on a slice of the offsets.
        With pads (positions (b, t), key_mask (b, s)): each row's tables (b, t, head_dim) and `attn_mask` (b, 1, t, s)
        bool, causal (within the window) over the real keys; each query also sees itself, so that a pad's query
        (which no real token precedes in a left-padded row) has a key and its output stays finite. A sliding window
        without a cache or pads: its banded mask `attn_mask` (t, t), where t exceeds the window."""
        out = {}
        if key_mask is not None:
            s = key_mask.shape[1]
            itself = torch.arange(s - t, s, device=device).unsqueeze(1) == torch.arange(s, device=device)
            out["attn_mask"] = (causal_mask(t, s, self.window, device) & key_mask.unsqueeze(1) | itself).unsqueeze(1)
        elif self.window is not None and cu_seqlens is None and positions is None and t > self.window:
            out["attn_mask"] = causal_mask(t, t, self.window, device)
        if cu_seqlens is not None and positions is None:
            doc, positions = document_and_position(t, cu_seqlens, device)
            out["packed"] = (doc, positions)
        elif positions is None:
            positions = torch.arange(t, device=device)
        out["rope"] = rotary_cos_sin(positions, self.head_dim, self.rope_theta, torch.float32)
        if cu_seqlens is not None and max_seqlen is not None:
            out["max_seqlen"] = max_seqlen
        return out

    def forward(self, x, *, injection=None, cache=None, cu_seqlens=None, rope=None, max_seqlen=None, packed=None,
                attn_mask=None, attention_mask=None, context=None):
        """`attn_mask` (b, 1, t, s) bool: which keys each new token sees, where the batch has pads (shared_inputs;
        pads are masked as keys, so `attention_mask`, the new tokens' own mask, needs nothing more here).
        `context` (lm.models.context_parallel.ContextShard): x is this rank's slice of the sequences, `rope` at their
        global positions; the keys and values of the group's earlier slices are gathered (attention_cp)."""
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)
        if injection is not None:
            qkv = qkv + injection
        hd = self.head_dim
        if (cache is not None and cache.static and t == 1 and rope is not None and rope[0].dim() == 2
                and cu_seqlens is None):
            # the one-token decode step: rotate q and k and write k and v into the cache's buffers at the step's
            # slot (one Triton kernel on CUDA), attend to the whole buffers under the step's additive mask. (A batch
            # with pads rotates each row at its own position: the general path below, which writes the same slot.)
            k, v = cache.kv_buffers(self.layer_idx)
            q = rope_kv_step(qkv, rope[0], rope[1], k, v, cache.position, self.n_heads, self.n_kv)
            return self._attend(q, k, v, cache.attention_mask(t, q.dtype, x.device, self.window))
        q, k, v = qkv.split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        q = q.view(b, t, self.n_heads, hd).transpose(1, 2)
        k = k.view(b, t, self.n_kv, hd).transpose(1, 2)
        v = v.view(b, t, self.n_kv, hd).transpose(1, 2)

        if cache is not None and cu_seqlens is not None:
            raise ValueError("Attention: cu_seqlens (packed training) cannot be combined with a generation cache")
        doc = None
        if cu_seqlens is not None and context is None:
            doc, pos = packed if packed is not None else document_and_position(t, cu_seqlens, x.device)
        elif rope is None:
            pos = cache.positions(t, x.device) if cache is not None else torch.arange(t, device=x.device)
        if rope is None:
            cos, sin = rotary_cos_sin(pos, hd, self.rope_theta, q.dtype)
        else:  # the model's tables for this forward (float32; same values, rounded here as above)
            cos, sin = rope[0].to(q.dtype), rope[1].to(q.dtype)
        if cos.dim() == 3:  # each row's own positions (a batch with pads): (b, t, d) -> (b, 1, t, d) over the heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if context is not None:
            o = attention_cp(q, k, v, context, self.window)
            return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * hd))

        mask = None
        if cache is not None:  # all cached keys/values with the new ones appended (a static cache: under a mask)
            k, v, mask = cache.append_kv(self.layer_idx, k, v, self.window)
        if mask is None:
            mask = attn_mask

        s = k.shape[2]
        if cu_seqlens is None and mask is None and (s != t or (self.window is not None and s > self.window)):
            # new tokens attend to the cached ones and causally among themselves (within the window)
            mask = causal_mask(t, s, self.window, x.device)
        return self._attend(q, k, v, mask, cu_seqlens, pos if cu_seqlens is not None else None, max_seqlen, doc)

    def _attend(self, q, k, v, mask, cu_seqlens=None, pos=None, max_seqlen=None, doc=None):
        """o_proj(attention of q (b, h, t, d) to k, v (b, h_kv, s, d)): under `mask` (t, s) or (b, 1, t, s) if given,
        else causal (s == t) or per packed document (cu_seqlens, pos, max_seqlen, doc)."""
        b, _, t, hd = q.shape
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if cu_seqlens is not None:
            o = varlen_causal_attention(q, k, v, cu_seqlens, pos, max_seqlen, doc, self.window)
        elif mask is not None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.n_heads * hd))


def varlen_causal_attention(q, k, v, cu_seqlens, pos, max_seqlen: int | None = None, doc=None,
                            window: int | None = None):
    """Causal attention within each packed document (within a sliding `window` if given): q, k, v (1, h, n, d),
    documents given by cu_seqlens,
    pos (n,) each token's position inside its document, doc (n,) its document's index (looked up here if None: the
    model hands both in from outside its compiled blocks). The documents are padded into a (num_docs, h, max_len, d)
    batch and run through SDPA's causal path (flash kernels on GPU); memory is num_docs * max_len, not n^2.
    (Padding sits at the end of each document, so real queries never see padded keys; a longer max_len changes nothing
    but the work.)

    `max_seqlen`: max_len as a host int, at least the longest document's length (LMModel.forward measures it once per
    forward, or the data loader before the offsets reach the device); None reads it from cu_seqlens, a wait for the
    device where they are on one (and a graph break inside a compiled block). It is used exactly, not rounded up: a
    compiled block sees it as an int input that changes from batch to batch, as the offsets' length does, so dynamo
    recompiles once with both sizes symbolic (automatic dynamic shapes) and no more; rounding it to a few buckets
    would not spare that one recompile and would pad more."""
    _, h, n, d = q.shape
    cu = cu_seqlens.to(q.device).long()
    num_docs = cu.shape[0] - 1
    if doc is None:
        doc = torch.searchsorted(cu[1:], torch.arange(n, device=q.device), right=True)
    max_len = int((cu[1:] - cu[:-1]).max()) if max_seqlen is None else max_seqlen

    def pad(t):
        out = t.new_zeros(num_docs, h, max_len, d)
        out[doc, :, pos] = t[0].transpose(0, 1)
        return out

    if window is not None and max_len > window:
        o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=causal_mask(max_len, max_len, window,
                                                                                          q.device))
    else:
        o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True)
    return o[doc, :, pos].transpose(0, 1).unsqueeze(0)


class LMLlamaModel(LMModel):
    config_class = LMLlamaConfig
    mixer_class = Attention


class LMLlamaForCausalLM(LMForCausalLM):
    config_class = LMLlamaConfig
    mixer_class = Attention
    model_class = LMLlamaModel
