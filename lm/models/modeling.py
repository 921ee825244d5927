"""The model every family shares: blocks, the (implicit) backbone, and the Hugging Face causal-LM classes.

    Block:     x = x + mixer(norm(x), injection=inj); x = x + mlp(norm(x))   (no MLP if intermediate_size == 0)
    Backbone:  embedding -> blocks -> final norm;  tied LM head in the causal LM.
    Implicit:  one injection module inj = Linear(RMSNorm(emb)) shared by all layers, added to every
               mixer's input projection; F(z) = norm_f(blocks(z, inj)) is iterated from z = 0
               (paper 003). Simultaneous mode (all tokens at once) without a cache; sequential mode
               (token by token, each iterated to convergence against a frozen cache, then committed)
               with a cache, which is how `generate()` runs.

A family file (llama.py, mamba2.py, ...) defines its config, its mixer, and three thin subclasses of
the classes below that name them. A hybrid stack (hybrid.py) builds each layer from its own family
(LMModel.make_blocks), with one injection projection and one set of shared inputs per mixer kind.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from lm_kernels.varlen import packed_offsets

from ..fixed_point import FixedPointStats, phantom, solve
from .cache import LMCache, mask_positions
from .config import ImplicitSettings, LMConfig
from .context_parallel import ContextShard, check_context, group_loss
from .decode import decoder_for, resolve_decode
from .layers import RMSNorm, SwiGLU, add_rms_norm
from .loss import linear_cross_entropy, logits_cross_entropy
from .solve_graph import capturable, commit_map, solve_map

try:  # transformers >= 5: init functions that skip weights already loaded from a checkpoint
    from transformers import initialization as init
except ImportError:  # pragma: no cover
    from torch.nn import init


class Mixer(nn.Module):
    """Interface of every token mixer.

    forward(x, *, injection=None, cache=None, cu_seqlens=None) -> y, with x, y (b, t, hidden_size); or (y', scale)
    with y = (y' * scale).to(y'.dtype), scale (b, t, 1) float32 outside autograd, which the block applies in its
    residual add (Mamba2's folded norm under torch.compile).
    `injection` (b, t, injection_dim) is added to the mixer's input projection; `cache` is an LMCache
    (the mixer reads/writes its layer's state); `cu_seqlens` marks packed documents (b == 1).
    `attention_mask` (b, t) bool, False at pads, comes with the shared inputs (LMModel._shared) only where some of
    the t tokens are pads: a pad is an identity step of the mixer (a recurrent mixer's transition is the identity and
    its input, a short conv's included, zero; attention never attends to it), so that a real token sees what it sees
    without the pads. Pads sit before a row's real tokens (left padding) or, without a cache, after them
    (LMModel.forward checks): zero conv inputs before a row's first real token are then a fresh start's history.
    """

    layer_idx: int
    # True where forward reads x through one input projection and nothing else: the preceding block may then hand x
    # over in the autocast dtype also with autograd (the projection would cast it, and x's gradient is that one
    # product's input gradient, in that dtype either way: no sum of several gradients in a 16-bit dtype)
    reads_input_once: bool = False
    # True where forward, without a cache, packed documents or autograd, only queues device work (no host
    # synchronisation, no host-side state): an implicit model's solve may then replay the stack as one captured CUDA
    # graph (lm.models.solve_graph)
    capturable: bool = False
    # the config the mixer was built from where it is not the model's (a hybrid stack's layer: its family's config,
    # which init_weights reads)
    family_config = None

    @staticmethod
    def injection_dim(config) -> int:
        raise NotImplementedError

    def init_weights(self, config) -> None:
        """Initialise parameters that are not plain Linear/Embedding/norm weights (A_log, dt_bias, ...)."""

    def pop_stats(self) -> list[FixedPointStats]:
        """Fixed-point stats of mixers that iterate internally (FP-Mamba); [] otherwise."""
        return []

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token beyond the mixer's Linear layers (attention scores, scans)."""
        return 0.0

    def shared_inputs(self, t: int, cu_seqlens, device, positions=None, max_seqlen=None,
                      cu_seqlens_cpu=None, key_mask=None) -> dict:
        """Extra keyword inputs that every layer's forward receives, computed once per model forward
        (not per layer and not per fixed-point iteration); {} for most mixers. `positions` (t,): the tokens'
        positions when a cache is used (else they start at 0 in every document of cu_seqlens); (b, t), each row's
        own, where the batch has pads (also without a cache). `key_mask` (b, s) bool: which of the s = cached + t
        tokens are real, where some are pads (else None; a static cache masks its pad slots itself). With cu_seqlens
        (LMModel.forward): `max_seqlen`, the longest document's length as a host int, and `cu_seqlens_cpu`, the
        offsets on the CPU where the forward has them (else None): a mixer whose ops read the offsets' values
        (checks, host-built tables) takes them from here, so that no layer waits for the device.
        Attention returns its rotary tables here: computed inside a compiled block, inductor fuses the
        sin/cos into the rotation and evaluates them per element of q and k (~1 ms per layer call at
        16 x 2048 tokens on an H100)."""
        return {}


def mask_pads(proj: torch.Tensor, attention_mask: torch.Tensor, fills: list[tuple[int, float]]) -> torch.Tensor:
    """`proj` (b, t, w) with each pad's row (attention_mask (b, t) False) replaced by a fixed row of `fills`: (width,
    value) column spans left to right, e.g. 0 for a conv's input and -inf for a gate's pre-activation whose
    softplus or sigmoid is then 0 (the mixers' identity steps at pads, Mixer)."""
    row = torch.cat([proj.new_full((w,), v) for w, v in fills if w])
    if row.shape[0] != proj.shape[-1]:
        raise ValueError(f"mask_pads: the fills cover {row.shape[0]} columns of {proj.shape[-1]}")
    return torch.where(attention_mask.unsqueeze(-1), proj, row)


class Block(nn.Module):
    def __init__(self, config: LMConfig, layer_idx: int, mixer_cls: type[Mixer]):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mixer = mixer_cls(config, layer_idx)
        if config.intermediate_size:
            self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        else:
            self.mlp_norm = self.mlp = None

    def forward(self, x, *, u=None, next_norm=None, injection=None, cache=None, cu_seqlens=None, **shared):
        """x + mixer(norm(x)) (+ the MLP's residual step). `u`: norm(x) when the previous block has formed it;
        `next_norm` (weight, eps, for_block) of the norm that reads this block's output (the next block's, for_block
        True, or the final one): then (output, its norm), the residual add and that norm in one pass (one compiled
        graph per block would otherwise write the residual stream and read it back at the next block's start). A norm
        for a block is handed on in the autocast dtype (LMModel._stack passes next_norm with autograd only where every
        mixer reads its input once: Mixer.reads_input_once)."""
        h = self.mixer(self.norm(x) if u is None else u, injection=injection, cache=cache, cu_seqlens=cu_seqlens,
                       **shared)
        scale = None
        if isinstance(h, tuple):  # (output, its rows' scale): Mamba2's folded norm leaves the scale to the add below
            h, scale = h
        # a norm whose output the next layer reads only through one projection, which autocast would cast, is written
        # in the autocast dtype (half the bytes, no cast pass; with autograd its gradient comes back in that dtype and
        # the norm's backward reads it as it is): the MLP's (SwiGLU: gate and up as one product) and, for_block, the
        # next block's
        hand = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
        if self.mlp is not None:
            x, v = self.mlp_norm.add_forward(x, h, scale, out_dtype=hand)  # x + h and its norm in one pass
            h, scale = self.mlp(v), None
        if next_norm is None:
            return x + (h if scale is None else (h * scale).to(h.dtype))
        weight, eps, for_block = next_norm
        return add_rms_norm(x, h, weight, eps, h_scale=scale, out_dtype=hand if for_block else None)


class Injection(nn.Module):
    """The implicit models' input injection: Linear(RMSNorm(embedding)), shared by all layers, one (b, t,
    Mixer.injection_dim) tensor."""

    def __init__(self, config: LMConfig, width: int):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.injection_norm else None
        self.proj = nn.Linear(config.hidden_size, width, bias=False)

    def forward(self, emb):
        return self.proj(self.norm(emb) if self.norm is not None else emb)


# The name under which transformers passes the generation cache between `generate`, the model's forward and
# its output: `cache` from transformers 5.24, `past_key_values` before. The models accept both names as input
# and return the cache under transformers' own field, so `generate` finds it either way.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


PREFILL_MODES = ("parallel", "sequential")


def resolve_prefill(prefill: str | None, config) -> str:
    """How an implicit model processes t > 1 new tokens with a cache: the argument, else the config's
    `prefill` field where it has one (FP-Mamba), else "parallel"."""
    mode = prefill or getattr(config, "prefill", None) or "parallel"
    if mode not in PREFILL_MODES:
        raise ValueError(f"prefill={mode!r} is not one of {PREFILL_MODES}")
    return mode


@dataclasses.dataclass
class LMOutput(CausalLMOutputWithPast):
    """transformers' causal-LM output (loss, logits, the cache, hidden states) plus the fixed-point solver's
    statistics of implicit models."""

    fixed_point_stats: Optional[Mapping] = None  # the solver's statistics (lm.fixed_point.LazyStats or a dict)


class LMPreTrainedModel(PreTrainedModel):
    config_class = LMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _is_stateful = True
    _supports_cache_class = False
    mixer_class: type[Mixer] = Mixer

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:  # our own LMCache, made in prepare_inputs_for_generation
        return False

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Also write the `trust_remote_code` shim, so tools that cannot `import lm` first (the lm_eval
        CLI, vLLM-style loaders) load the folder with `trust_remote_code=True` (lm must be installed)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_remote_code(save_directory, type(self.config))

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Conv1d):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif hasattr(module, "weight") and "Norm" in type(module).__name__:
            init.ones_(module.weight)
        if isinstance(module, Mixer):
            # a hybrid stack's mixer keeps its own family's config (its block sets `family_config`)
            module.init_weights(module.family_config if module.family_config is not None else self.config)


REMOTE_CODE_MODULE = "lm_hf"
_REMOTE_CODE = '''"""Loads lm's model classes for `trust_remote_code=True`; needs the `lm` package installed."""
import lm  # noqa: F401  (registers the lm_* model types)
from lm.models import MODEL_TYPES

globals().update({cls.__name__: cls for classes in MODEL_TYPES.values() for cls in classes})
'''


def write_remote_code(save_directory, config_cls) -> None:
    """Write lm_hf.py and point config.json's auto_map at it."""
    import json
    from pathlib import Path

    from . import MODEL_TYPES

    d = Path(save_directory)
    (d / f"{REMOTE_CODE_MODULE}.py").write_text(_REMOTE_CODE)
    cfg_cls, model_cls, lm_cls = MODEL_TYPES[config_cls.model_type]
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    cfg["auto_map"] = {
        "AutoConfig": f"{REMOTE_CODE_MODULE}.{cfg_cls.__name__}",
        "AutoModel": f"{REMOTE_CODE_MODULE}.{model_cls.__name__}",
        "AutoModelForCausalLM": f"{REMOTE_CODE_MODULE}.{lm_cls.__name__}",
    }
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


class LMModel(LMPreTrainedModel):
    """Embedding -> blocks -> final norm, explicit or implicit."""

    def __init__(self, config: LMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_blocks(config))
        self.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.injection = Injection(config, self.injection_width(config)) if config.is_implicit else None
        self.gradient_checkpointing = False
        self.post_init()

    def make_blocks(self, config: LMConfig) -> list[Block]:
        """The stack's blocks: one mixer class for every layer (a hybrid stack builds each layer's own kind)."""
        return [Block(config, i, self.mixer_class) for i in range(config.num_hidden_layers)]

    def injection_width(self, config: LMConfig) -> int:
        """Width of the implicit model's injection (the input the blocks' mixers take it from)."""
        return self.mixer_class.injection_dim(config)

    def mixer_shared_inputs(self, t: int, cu_seqlens, device, **kw) -> dict:
        """Mixer.shared_inputs of this stack's mixers, once per forward: one mixer class, its first layer's."""
        return self.layers[0].mixer.shared_inputs(t, cu_seqlens, device, **kw)

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    # --- the stack ----------------------------------------------------------------------------------
    def _stack(self, h, inj=None, cache=None, cu_seqlens=None, shared=None):
        """norm_f(blocks(h)). Each block also forms the norm its successor reads (the next block's pre-norm, after
        the last block norm_f), fused with its residual add, and hands it on in the autocast dtype (`Block.forward`):
        without autograd always, with autograd where every mixer reads its input through one projection
        (Mixer.reads_input_once), so that the handed-on norm's gradient is one product's, already in that dtype.
        Otherwise (with autograd) each block norms its own input: a float32 norm handed on would cost a cast in the
        next graph and a cast of its gradient back at every block boundary, more than the fused add saves
        (docs/performance.md)."""
        shared = shared or {}
        grad = torch.is_grad_enabled()
        if grad and self.gradient_checkpointing and self.training and cache is None:
            run = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        else:
            def run(layer, h, **kw):
                return layer(h, **kw)
        kw = dict(injection=inj, cache=cache, cu_seqlens=cu_seqlens, **shared)
        if not len(self.layers) or (grad and not all(layer.mixer.reads_input_once for layer in self.layers)):
            for layer in self.layers:
                h = run(layer, h, **kw)
            return self.norm_f(h)
        u = None
        for i, layer in enumerate(self.layers):
            last = i + 1 == len(self.layers)
            nxt = self.norm_f if last else self.layers[i + 1].norm
            h, u = run(layer, h, u=u, next_norm=(nxt.weight, nxt.eps, not last), **kw)
        return u

    def _shared(self, h, cache, cu_seqlens, max_seqlen=None, cu_seqlens_cpu=None, real=None,
                context: ContextShard | None = None) -> dict:
        """The mixers' shared inputs for this forward (see Mixer.shared_inputs), at the cache's positions. `real`
        (b, t) bool: the new tokens' mask where some are pads (LMModel._real_tokens), handed to every mixer as
        `attention_mask`; with pads among them or among the cached tokens, each row's positions and the key mask.
        `context` (context parallelism): the tokens' global positions, and the shard itself to every mixer."""
        if not len(self.layers):
            return {}
        t = h.shape[1]
        if cache is not None:
            pos, keys = cache.positions(t, h.device), cache.key_mask(t)
        elif context is not None:
            pos, keys = context.positions(h.device), None
        else:
            pos, keys = (mask_positions(real), real) if real is not None else (None, None)
        out = self.mixer_shared_inputs(t, cu_seqlens, h.device, positions=pos, max_seqlen=max_seqlen,
                                       cu_seqlens_cpu=cu_seqlens_cpu, key_mask=keys)
        if real is not None:
            out["attention_mask"] = real
        if context is not None:
            out["context"] = context
        return out

    def fixed_point_map(self, inj, cache=None, cu_seqlens=None, shared=None):
        """F(z) = norm_f(blocks(z, inj)): the implicit model's map. With pads among the tokens (shared inputs'
        `attention_mask`) F is zero at the pads: their iterate stays at z0 = 0 and out of the solver's residual, so
        that a row's iterates and stopping decisions are those of its real tokens alone."""
        mask = (shared or {}).get("attention_mask")
        if mask is None:
            return lambda z: self._stack(z, inj, cache, cu_seqlens, shared)
        pad = ~mask.unsqueeze(-1)
        return lambda z: self._stack(z, inj, cache, cu_seqlens, shared).masked_fill(pad, 0.0)

    def _mixer_stats(self) -> list[FixedPointStats]:
        out = []
        for layer in self.layers:
            out.extend(layer.mixer.pop_stats())
        return out

    def forward(self, input_ids, *, cache: LMCache | None = None, cu_seqlens=None, max_seqlen: int | None = None,
                cu_seqlens_cpu: torch.Tensor | None = None, prefill: str | None = None,
                attention_mask: torch.Tensor | None = None, context: ContextShard | None = None):
        """Returns (hidden states after the final norm (b, t, d), stats dict or None).

        `cu_seqlens`: offsets of packed documents (batch 1), on any device. `max_seqlen`: the longest document's
        length (or more), known on the host, given by a caller that has checked the offsets there
        (lm.train.data.to_model_inputs): then offsets on a device are not read and the forward does not wait for
        the device. Without it they are checked and measured on the host here, once per forward (a wait for the
        device where they are on one and no `cu_seqlens_cpu` is given; free for a CPU tensor).
        `cu_seqlens_cpu`: the same offsets as a CPU tensor, where the caller has them (to_model_inputs: the reader's,
        before their copy): mixers whose ops need the offsets' values on the host (DeltaProduct) read them there.
        Without it a model of such mixers reads offsets on a device back once per forward (here, or in
        Mixer.shared_inputs where max_seqlen was given), not in every layer.
        `prefill` (implicit models, t > 1 new tokens with a cache): "parallel" solves them together in
        simultaneous mode and commits their states in one pass, "sequential" solves them token by token (the
        generation mode run on the prompt); None = the config's `prefill` field where it has one (FP-Mamba),
        else "parallel".
        `attention_mask` (b, t) or (b, cached + t), 1 at real tokens and 0 at pads (transformers' convention): pads
        are identity steps of every mixer (Mixer) and, in implicit models, held at zero in the solve, so a row's real
        tokens get what they get without the pads (up to rounding), at their own positions (a row's first real token
        at 0). Pads go before a row's real tokens (left padding, what generation needs) or, without a cache, also
        after them (right padding); see `_real_tokens`. A cache keeps the mask of the tokens it has seen (LMCache):
        later chunks' masks are read for their new tokens only. All ones costs one check (a wait for the device)
        and changes nothing.
        `context` (lm.models.context_parallel.ContextShard): input_ids are this rank's slice of the sequences, which
        the ranks of its group run together (context parallelism; packed documents are the shard's offsets)."""
        if context is not None:
            check_context(context, cache, cu_seqlens, attention_mask)
            cu_seqlens, max_seqlen, cu_seqlens_cpu = context.packed(input_ids.device)
        if cu_seqlens is not None and not torch.compiler.is_compiling():
            # once per forward, here: the compiled blocks' kernels take the offsets unread (no host sync inside a
            # graph), attention takes the longest document's length as this host int, and ops that need the
            # offsets' values on the host read their CPU copy (Mixer.shared_inputs)
            max_seqlen, cu_seqlens_cpu = packed_offsets(cu_seqlens, input_ids.shape[0], input_ids.shape[1], "model",
                                                        max_seqlen, cu_seqlens_cpu)
        emb = self.embed_tokens(input_ids)
        settings = self.solver
        if settings is not None and self.injection is None:
            raise ValueError("config.implicit is set on a model built explicit (it has no injection module): "
                             "build the model from a config with implicit={...} instead of setting it afterwards")
        real = self._real_tokens(attention_mask, input_ids, cache, cu_seqlens)
        if cache is not None:
            cache.prefill = resolve_prefill(prefill, self.config)
            cache.record_mask(real, input_ids.shape[1])
        solver = None  # the stack's solve: a mapping read lazily (no wait for the device in the forward)
        if settings is None:
            h = self._stack(emb, None, cache, cu_seqlens,
                            self._shared(emb, cache, cu_seqlens, max_seqlen, cu_seqlens_cpu, real, context))
        elif cache is None:
            h, st = self._simultaneous(emb, settings, cu_seqlens, max_seqlen, cu_seqlens_cpu, real, context)
            solver = st.as_mapping()
        elif input_ids.shape[1] > 1 and cache.prefill == "parallel":
            h, st = self._parallel_prefill(emb, settings, cache, real)
            solver = st.as_mapping()
        else:
            h, solver = self._sequential(emb, settings, cache, real)
            solver = solver or None  # (a dict)
        if cache is not None and settings is None:
            cache.seen_tokens += input_ids.shape[1]
        inner = self._mixer_stats()
        if not inner:
            return h, solver
        stats = dict(solver or {})
        stats.update({f"layer_{k}": v for k, v in FixedPointStats.merge(inner).items()})
        return h, stats

    @staticmethod
    def _real_tokens(attention_mask, input_ids, cache: LMCache | None, cu_seqlens) -> torch.Tensor | None:
        """The new tokens' mask (b, t) bool, True at real tokens, where some are pads; None where all are real (or
        no mask is given). Checks the padding: with a cache only left padding (pads before a row's real tokens, the
        cached ones included: a pad after a real token would enter the short convs' states); without one a row's
        real tokens must be one run (left and / or right padding). Two waits for the device where there are pads,
        one where there are none."""
        if attention_mask is None:
            return None
        b, t = input_ids.shape
        seen = cache.seen_tokens if cache is not None else 0
        if attention_mask.dim() != 2 or attention_mask.shape[0] != b or attention_mask.shape[1] not in (t, seen + t):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}: expected ({b}, {t}) for the "
                             f"new tokens" + (f" or ({b}, {seen + t}) for the cached and the new ones" if seen else ""))
        new = attention_mask[:, attention_mask.shape[1] - t:]
        if bool(new.all()):
            return None
        real = new.to(device=input_ids.device, dtype=torch.bool)
        if cu_seqlens is not None:
            raise ValueError("attention_mask with pads cannot be combined with cu_seqlens: packed documents have no "
                             "padding (pass the documents packed without pads, and no attention_mask)")
        if cache is None:
            rises = real[:, 1:] & ~real[:, :-1]  # a pad followed by a real token
            bad = (rises.sum(1) + real[:, 0] > 1).any()  # real tokens in more than one run
            what = ("a row's real tokens must be one run (pads before and / or after them), but some row has pads "
                    "between real tokens")
        else:
            falls = real[:, :-1] & ~real[:, 1:]  # a real token followed by a pad
            cached = cache.key_mask(0)
            cached_real = cached.any(1) if cached is not None else torch.full_like(real[:, 0], seen > 0)
            bad = falls.any() | (cached_real & ~real.all(1)).any()
            what = ("with a cache (generation) the pads must come before each row's real tokens (left padding; "
                    "tokenizer.padding_side = 'left'), but some row has a pad after a real token")
        if bool(bad):
            raise ValueError(f"attention_mask: {what}")
        return real

    _solver: ImplicitSettings | None = None  # set_solver's settings (the class's None: the config's)

    @property
    def solver(self) -> ImplicitSettings | None:
        """The fixed-point solver settings every forward runs with: those `set_solver` gave, else the config's
        `implicit` (the saved default); None: an explicit model."""
        return self._solver if self._solver is not None else self.config.implicit

    def set_solver(self, settings: ImplicitSettings) -> None:
        """Switch the fixed-point solver settings (a curriculum phase); every later forward reads them. The shared
        config is not changed: its `implicit` stays the saved default (`solver_config` gives the config with these
        settings, which a training checkpoint saves)."""
        if self.injection is None:
            raise ValueError("set_solver: this model was built explicit (it has no injection module); build it "
                             "from a config with implicit={...} to train or run it as an implicit model")
        if not isinstance(settings, ImplicitSettings):
            raise TypeError(f"set_solver: expected ImplicitSettings, got {type(settings).__name__}")
        self._solver = settings

    def solver_config(self) -> LMConfig:
        """The config whose `implicit` is the settings the model runs with (a copy where set_solver changed them):
        a model loaded from it runs as this one does."""
        if self.solver == self.config.implicit:
            return self.config
        config = copy.deepcopy(self.config)
        config.implicit = self.solver
        return config

    @torch.no_grad()
    def decode_step(self, input_ids, cache: LMCache) -> torch.Tensor:
        """One token (b, 1) on a static cache (lm.models.decode), hidden states (b, 1, d); no host
        synchronisation, so the step can be captured in a CUDA graph. Implicit models: the solve against
        the frozen cache with its fixed iteration count (eval_max_iter, no tolerance stop), then the
        committing pass. `cache.seen_tokens` is not advanced (the decoder owns the position)."""
        emb = self.embed_tokens(input_ids)
        settings = self.solver
        cache.begin_step(input_ids.shape[1])
        shared = self._shared(emb, cache, None)
        if settings is None:
            return self._stack(emb, None, cache, None, shared)
        f = self.fixed_point_map(self.injection(emb), cache, None, shared)
        with cache.freeze():
            z, _ = solve(f, torch.zeros_like(emb), **{**settings.solve_args(training=False), "tol": None})
        return f(z)

    def _simultaneous(self, emb, settings, cu_seqlens, max_seqlen=None, cu_seqlens_cpu=None, real=None, context=None):
        inj = self.injection(emb)
        shared = self._shared(emb, None, cu_seqlens, max_seqlen, cu_seqlens_cpu, real, context)
        f = self.fixed_point_map(inj, None, cu_seqlens, shared)
        z0 = torch.zeros_like(emb)
        # the solve's iterations replay one captured graph of the map where they can (lm.models.solve_graph)
        graphs = context is None and capturable(self, inj, cu_seqlens, None)
        f_solve = solve_map(self, f, inj, shared, z0) if graphs else f
        # packed sequences: one "sample" per document is not separable here; the batch row is the unit. Context
        # parallelism: a row's residual is the whole row's, reduced over the group (every rank iterates alike)
        z, st = solve(f_solve, z0, **settings.solve_args(self.training),
                      **({"group": context.group} if context is not None else {}))
        if torch.is_grad_enabled() and settings.phantom_steps > 0:
            z = phantom(f, z, steps=settings.phantom_steps, damping=settings.damping)
        return z, st

    def _parallel_prefill(self, emb, settings, cache: LMCache, real=None):
        """All new tokens solved together (simultaneous mode) against the frozen cache, then one committing
        pass f(z*) that writes their states into the cache (paper 003's duality: the cache is what the
        sequential mode would commit for the converged z*). On an empty cache the solve is exactly the
        simultaneous forward's."""
        inj = self.injection(emb)
        solver = settings.solve_args(training=False)
        z0 = torch.zeros_like(emb)
        if cache.seen_tokens == 0 and not len(cache):
            # the simultaneous forward's solve, through its captured graph where it can (lm.models.solve_graph),
            # and the committing pass captured too: issued from Python it would cost more than the replayed solve
            shared = self._shared(emb, None, None, real=real)
            f = self.fixed_point_map(inj, None, None, shared)
            graphs = capturable(self, inj, None, None)
            z, st = solve(solve_map(self, f, inj, shared, z0) if graphs else f, z0, **solver)
            commit = commit_map(self, inj, shared, z) if graphs else None
            if commit is not None:
                h, cache.layers = commit(z)
                cache.seen_tokens += emb.shape[1]
                return h, st
        else:
            shared = self._shared(emb, cache, None, real=real)
            with cache.freeze():
                z, st = solve(self.fixed_point_map(inj, cache, None, shared), z0, **solver)
        h = self.fixed_point_map(inj, cache, None, shared)(z)  # the committing pass
        cache.seen_tokens += emb.shape[1]
        return h, st

    def _sequential(self, emb, settings, cache: LMCache, real=None):
        """Token by token: iterate against the frozen cache until converged, then one committing pass."""
        inj = self.injection(emb)
        args = settings.solve_args(training=False)
        outs, all_stats = [], []
        for t in range(emb.shape[1]):
            shared = self._shared(emb[:, t:t + 1], cache, None, real=real[:, t:t + 1] if real is not None else None)
            f = self.fixed_point_map(inj[:, t:t + 1], cache, None, shared)
            with cache.freeze():
                z, st = solve(f, torch.zeros_like(emb[:, t: t + 1]), **args)
            outs.append(f(z))  # the committing pass writes this token's states into the cache
            cache.seen_tokens += 1
            all_stats.append(st)
        return torch.cat(outs, dim=1), FixedPointStats.merge(all_stats)


def sincos_positions(n: int, dim: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    pe = torch.zeros(n, dim)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return pe


class CompressionHead(nn.Module):
    """config.head="compression" (MAD compression): the last position's hidden state plus a sin/cos position
    code goes through a two-layer MLP and an unembedding to predict the token at every position."""

    def __init__(self, dim: int, vocab_size: int, eps: float = 1e-5):
        super().__init__()
        self.mlp = nn.Sequential(RMSNorm(dim, eps), nn.Linear(dim, dim), nn.GELU(),
                                 RMSNorm(dim, eps), nn.Linear(dim, dim), nn.GELU())
        self.unembed = nn.Sequential(RMSNorm(dim, eps), nn.Linear(dim, vocab_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> logits (B, T, V)
        x = h[:, -1:, :] + sincos_positions(h.shape[1], h.shape[2]).to(h.device, h.dtype)[None]
        return self.unembed(self.mlp(x))


class LMForCausalLM(LMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    model_class: type[LMModel] = LMModel

    def __init__(self, config: LMConfig):
        super().__init__(config)
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.compression_head = (CompressionHead(config.hidden_size, config.vocab_size, config.rms_norm_eps)
                                 if config.head == "compression" else None)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def set_solver(self, settings: ImplicitSettings) -> None:
        """Switch the implicit model's solver settings (see LMModel.set_solver)."""
        self.model.set_solver(settings)

    @property
    def solver(self) -> ImplicitSettings | None:
        """The solver settings the model runs with (LMModel.solver)."""
        return self.model.solver

    def solver_config(self) -> LMConfig:
        """The config with the settings the model runs with (LMModel.solver_config)."""
        return self.model.solver_config()

    def forward(
        self,
        input_ids: torch.LongTensor,
        labels: torch.LongTensor | None = None,
        targets: torch.LongTensor | None = None,
        cache: LMCache | None = None,
        use_cache: bool | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        fused_loss: bool = False,
        past_key_values: LMCache | None = None,
        prefill: str | None = None,
        decode: str | None = None,
        context: ContextShard | None = None,
        **kwargs,
    ) -> LMOutput:
        """`labels`: Hugging Face convention (shifted inside, -100 ignored). `targets`: already aligned with
        input_ids (targets[:, i] is the token after input_ids[:, i]), as the pretraining reader yields.
        `fused_loss`: with labels/targets, compute the loss chunk by chunk from the hidden states
        (lm.models.loss) and return no logits: the (tokens x vocab) logits are never held (training).
        `cu_seqlens` / `max_seqlen` / `cu_seqlens_cpu`: packed documents (batch 1) and, optionally, the longest one's
        length known on the host and the offsets' CPU copy, which spare waits for the device in every forward
        (LMModel.forward).
        `cache` (an LMCache; `past_key_values` is the same argument under transformers' older name) carries the
        recurrent / KV state between calls; the output returns it under CACHE_FIELD.
        `prefill`: how implicit models process several new tokens with a cache (LMModel.forward).
        `attention_mask`: 1 at real tokens, 0 at pads, over the new tokens or the cached and new ones (as
        `generate` passes it): left-padded rows get what each prompt gets alone (LMModel.forward).
        `decode`: the one-token path with a cache, "eager" | "static" | "graph" | "auto" (lm.models.decode);
        None = the cache's (set by `generate`), else eager.
        `context` (lm.models.context_parallel.ContextShard): input_ids and targets are this rank's slice of the
        sequences (context parallelism); the loss is this rank's part of the group's token mean (group_loss)."""
        if cache is None:
            cache = past_key_values
        if use_cache is False:
            cache = None
        if decode is not None and cache is not None:
            cache.decode = resolve_decode(decode, self.lm_head.weight.device)
        if (cache is not None and cache.decode is not None and input_ids.shape[1] == 1 and cache.seen_tokens > 0
                and labels is None and targets is None and not torch.is_grad_enabled()):
            # (a decode token is never a pad: the cache keeps its prompt's pads, LMCache.real)
            logits = decoder_for(self, input_ids.shape[0], cache.decode == "graph",
                                 cache.real is not None).step(cache, input_ids)
            return LMOutput(loss=None, logits=logits, **{CACHE_FIELD: cache})
        if use_cache and cache is None:
            cache = LMCache(self.config.num_hidden_layers)
        if context is not None and (labels is not None or self.compression_head is not None or logits_to_keep):
            raise ValueError("context parallelism: pass targets aligned with input_ids (labels shift across the "
                             "slices), with the LM head over every token")
        h, stats = self.model(input_ids, cache=cache, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                              cu_seqlens_cpu=cu_seqlens_cpu, prefill=prefill, attention_mask=attention_mask,
                              context=context)
        if self.compression_head is not None:  # decodes the whole sequence from its last state
            if labels is not None:
                raise ValueError("labels: the compression head predicts targets aligned with input_ids (no shift); "
                                 "pass them as targets=")
            logits = self.compression_head(h)
            loss = logits_cross_entropy(logits, targets) if targets is not None else None
            return LMOutput(loss=loss, logits=logits, fixed_point_stats=stats, **{CACHE_FIELD: cache})
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        if labels is not None and targets is None:
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)
            if logits_to_keep:
                targets = targets[:, -logits_to_keep:]
        if fused_loss and targets is not None and self.lm_head.bias is None:
            loss = linear_cross_entropy(h, self.lm_head.weight, targets)
            if context is not None:
                loss = group_loss(loss, targets, context)
            return LMOutput(loss=loss, logits=None, fixed_point_stats=stats, **{CACHE_FIELD: cache})
        logits = self.lm_head(h)
        loss = logits_cross_entropy(logits, targets) if targets is not None else None
        if loss is not None and context is not None:
            loss = group_loss(loss, targets, context)
        return LMOutput(loss=loss, logits=logits, fixed_point_stats=stats, **{CACHE_FIELD: cache})

    # the one-token decode path of `generate` when it is not given `decode=`: see lm.models.decode
    decode_mode = "auto"

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, use_cache=True,
                                      past_key_values=None, prefill=None, decode=None, **kwargs):
        """Feed only the tokens the cache has not seen; a fresh LMCache on the first call, set to decode with
        `decode` (else `self.decode_mode`): on CUDA by default a captured CUDA graph per token."""
        if cache is None:
            cache = past_key_values
        if cache is not None and cache.seen_tokens > 0:
            input_ids = input_ids[:, cache.seen_tokens:]
        elif use_cache:
            cache = LMCache(self.config.num_hidden_layers)
            cache.decode = resolve_decode(decode or self.decode_mode, self.lm_head.weight.device)
        out = {"input_ids": input_ids, "cache": cache, "use_cache": use_cache, "attention_mask": attention_mask,
               "prefill": prefill}
        if kwargs.get("logits_to_keep") is not None:  # generate asks for the last position's logits only
            out["logits_to_keep"] = kwargs["logits_to_keep"]
        return out

    def _reorder_cache(self, cache, beam_idx):
        cache.reorder_cache(beam_idx)
        return cache
