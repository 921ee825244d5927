"""(Gated) DeltaProduct (paper 001): n_h Householder (delta-rule) steps per token, explicit or implicit.

Mixer, per layer (flash-linear-attention's `GatedDeltaProduct` with its q/k/v/b/a/g projections fused
into one Linear and its three short convs into one depthwise conv; per-step layout (n_h, H, d)):

    in_proj(x) [+ injection] -> q (H dk) | k (n_h H dk) | v (n_h H dv) | beta (n_h H) | a (H) | g (H dv)
    q, k, v:  depthwise causal conv (kernel conv_size, no bias) + SiLU   (one conv over [q|k|v])
    beta:     sigmoid, x2 if allow_neg_eigval (beta in [0, 2]: eigenvalues 1 - beta in [-1, 1])
    a:        forget gate, Mamba2-style per head in log space: log g = -exp(A_log) * softplus(a + dt_bias)
              (only with use_forget_gate: Gated DeltaProduct)
    state:    H_{i,0} = g_i H_{i-1};  H_{i,j} = (I - beta_ij k_ij k_ij^T) H_{i,j-1} + beta_ij k_ij v_ij^T
              with k, q L2-normalised and q scaled by dk^-1/2 (`lm_kernels.deltaproduct`, chunkwise);
    o_i = H_i^T q_i;  o = RMSNorm_head(o) [* SiLU(g) with use_output_gate];  y = o_proj(o)

Step j of token i has its own key/value/beta projection rows (the fused in_proj is laid out per token as
(n_h, H, d)) and its own conv filters. The block around the mixer is the shared pre-norm residual block
with a SwiGLU MLP (intermediate_size), i.e. the paper's LM macro-architecture.

Implicit DeltaProduct (paper 003 applied to paper 001): the injection is added to the whole fused
projection, so q, every step's k/v/beta and the gates depend on the iterate and on the token.
Generation cache per layer: `conv` (b, conv_dim, conv_size-1) and `state` (b, H, dk, dv) float32.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm_kernels.context_parallel import causal_conv1d_cp, chunk_deltaproduct_cp
from lm_kernels.deltaproduct import chunk_deltaproduct, deltaproduct_step
from lm_kernels.varlen import cpu_offsets

from .config import LMConfig
from .layers import RMSNorm, causal_conv1d, dt_init
from .modeling import LMForCausalLM, LMModel, Mixer, init, mask_pads


CHUNK_SIZES = (16, 32, 64)  # what lm_kernels.deltaproduct's Triton path accepts


class LMDeltaProductConfig(LMConfig):
    """Config of `lm_deltaproduct`. Paper LM defaults: head_dim 128, allow_neg_eigval, no output gate.

    num_heads:        H heads, each with a (head_dim x head_v_dim) state.
    head_dim:         key / query dim dk per head; None = hidden_size // num_heads.
    expand_v:         head_v_dim = head_dim * expand_v (must come out an integer).
    num_householder:  n_h Householder steps per token (1 = DeltaNet).
    allow_neg_eigval: beta in [0, 2] instead of [0, 1] (the paper's "[-1,1]" models).
    use_forget_gate:  Gated DeltaProduct (per-head decay, Mamba2 parameterisation: A_log, dt_bias).
    use_output_gate:  o = RMSNorm(o) * SiLU(W_g x).
    use_short_conv, conv_size: causal depthwise conv + SiLU on q, k, v.
    chunk_size:       chunk length of the chunkwise kernel (over the interleaved n_h * T rows): 16, 32 or 64.
    dt_min, dt_max, A_init_range: forget-gate initialisation (dt log-uniform, A uniform).
    rescale_o_proj:   o_proj init std divided by sqrt(2 * num_hidden_layers) (GPT-2 / FLA prenorm rule).
    """

    model_type = "lm_deltaproduct"
    _fields = {
        "num_heads": 4,
        "head_dim": None,
        "expand_v": 1.0,
        "num_householder": 2,
        "allow_neg_eigval": True,
        "use_forget_gate": False,
        "use_output_gate": False,
        "use_short_conv": True,
        "conv_size": 4,
        "chunk_size": 64,
        "dt_min": 0.001,
        "dt_max": 0.1,
        "A_init_range": [0.0, 16.0],
        "rescale_o_proj": True,
    }

    def __init__(self, **kwargs):
        kwargs.setdefault("intermediate_size", 688)
        kwargs.setdefault("rms_norm_eps", 1e-6)
        super().__init__(**kwargs)

    def validate(self):
        super().validate()
        for f in ("num_heads", "num_householder", "conv_size"):
            v = getattr(self, f)
            self._check(isinstance(v, int) and not isinstance(v, bool) and v > 0, f, "must be a positive integer")
        self._check(self.chunk_size in CHUNK_SIZES, "chunk_size",
                    f"must be one of {CHUNK_SIZES} (the sizes the Triton kernel supports)")
        if self.head_dim is None:
            self._check(self.hidden_size % self.num_heads == 0, "num_heads",
                        f"must divide hidden_size={self.hidden_size} (or set head_dim)")
            self.head_dim = self.hidden_size // self.num_heads
        self._check(isinstance(self.head_dim, int) and not isinstance(self.head_dim, bool) and self.head_dim > 0,
                    "head_dim", "must be a positive integer or None")
        self._check(isinstance(self.expand_v, (int, float)) and not isinstance(self.expand_v, bool)
                    and self.expand_v > 0 and float(self.head_dim * self.expand_v).is_integer(),
                    "expand_v", f"must be > 0 with head_dim * expand_v an integer (head_dim={self.head_dim})")
        for f in ("allow_neg_eigval", "use_forget_gate", "use_output_gate", "use_short_conv", "rescale_o_proj"):
            self._check(isinstance(getattr(self, f), bool), f, "must be true or false")
        self._check(0 < self.dt_min <= self.dt_max, "dt_min", f"need 0 < dt_min <= dt_max={self.dt_max}")
        r = self.A_init_range
        self._check(isinstance(r, (list, tuple)) and len(r) == 2 and 0 <= r[0] <= r[1] and r[1] > 0,
                    "A_init_range", "need [low, high] with 0 <= low <= high, high > 0")

    @property
    def head_v_dim(self) -> int:
        return int(self.head_dim * self.expand_v)


class DeltaProductMixer(Mixer):
    reads_input_once = True  # x only through in_proj (Mixer.reads_input_once)
    capturable = True  # (Mixer.capturable)

    def __init__(self, config: LMDeltaProductConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.H, self.dk, self.dv = config.num_heads, config.head_dim, config.head_v_dim
        self.nh = config.num_householder
        self.allow_neg_eigval = config.allow_neg_eigval
        self.use_forget_gate = config.use_forget_gate
        self.use_output_gate = config.use_output_gate
        self.chunk_size = config.chunk_size
        self.split = self.projection_split(config)
        self.conv_dim = sum(self.split[:3])
        self.in_proj = nn.Linear(config.hidden_size, sum(self.split), bias=False)
        self.conv1d = (nn.Conv1d(self.conv_dim, self.conv_dim, config.conv_size, groups=self.conv_dim,
                                 padding=config.conv_size - 1, bias=False) if config.use_short_conv else None)
        if self.use_forget_gate:
            self.A_log = nn.Parameter(torch.zeros(self.H))
            self.dt_bias = nn.Parameter(torch.zeros(self.H))
            self.A_log._no_weight_decay = True
            self.dt_bias._no_weight_decay = True
        self.o_norm = RMSNorm(self.dv, config.rms_norm_eps)  # per head, weight shared over heads (as FLA)
        self.o_proj = nn.Linear(self.H * self.dv, config.hidden_size, bias=False)
        self.init_weights(config)

    @staticmethod
    def projection_split(config) -> list[int]:
        """Widths of the fused projection: q, k (n_h steps), v (n_h steps), beta (n_h steps), a, g."""
        H, dk, dv, nh = config.num_heads, config.head_dim, config.head_v_dim, config.num_householder
        return [H * dk, nh * H * dk, nh * H * dv, nh * H,
                H if config.use_forget_gate else 0, H * dv if config.use_output_gate else 0]

    @staticmethod
    def injection_dim(config) -> int:
        return sum(DeltaProductMixer.projection_split(config))

    def init_weights(self, config) -> None:
        if self.use_forget_gate:
            lo, hi = config.A_init_range
            A = torch.empty(self.H).uniform_(lo, hi).clamp_(min=1e-4)
            init.copy_(self.A_log, torch.log(A))
            init.copy_(self.dt_bias, dt_init(self.H, config.dt_min, config.dt_max))
        if config.rescale_o_proj:
            init.normal_(self.o_proj.weight, std=config.initializer_range / math.sqrt(2 * config.num_hidden_layers))

    def flops_per_token(self, seq_len: int) -> float:
        # chunkwise delta rule over n_h rows per token, chunk C (rows): K K^T and Q K^T (C/2 each, dk),
        # the triangular solves for W and U (C/2, dk + dv), intra-chunk output (C/2, dv), and the
        # inter-chunk state products W S, Q S, K^T V (dk dv each); 2 FLOPs per MAC.
        c = min(self.chunk_size, self.nh * seq_len)
        dk, dv = self.dk, self.dv
        per_row = (c / 2) * (2 * dk + dk + dv + dv) + 3 * dk * dv
        return 2 * self.H * self.nh * per_row

    def shared_inputs(self, t: int, cu_seqlens, device, positions=None, max_seqlen=None,
                      cu_seqlens_cpu=None, key_mask=None) -> dict:
        """With packed documents, the offsets on the CPU (a CPU int tensor, a graph input of a compiled block like the
        offsets themselves): the chunk op builds its chunk tables from their values on the host (and checks them
        there), so that no layer copies the offsets back from the device. Where the forward has no CPU copy, they
        are copied back here, once per forward."""
        if cu_seqlens is None:
            return {}
        return {"cu_seqlens_cpu": cpu_offsets(cu_seqlens, cu_seqlens_cpu, "model")}

    def _short_convs(self, qkv, cu_seqlens):
        """q, k, v = SiLU(conv(.)) of the projection's q / k / v columns, one conv call each (training, no cache),
        so that each comes out in its own contiguous buffer: k and v then reshape to their (t * n_h) step rows as
        views and q, k and v are saved (by the L2 norm and the op) without copies, where one conv output split
        into views made the reshapes of k and v copy (both copies saved for the backward) and kept the whole
        conv output alive through the saved q."""
        w = self.conv1d.weight.squeeze(1)
        return [causal_conv1d(x, wi, None, cu_seqlens=cu_seqlens, activation="silu")[0]
                for x, wi in zip(qkv.split(self.split[:3], dim=-1), w.split(self.split[:3], dim=0))]

    def _short_convs_cp(self, qkv, cu_seqlens, context):
        """`_short_convs` on this rank's slice (context parallelism): each conv with its halo from the previous
        rank."""
        w = self.conv1d.weight.squeeze(1)
        return [causal_conv1d_cp(x, wi, None, context.slice, cu_seqlens=cu_seqlens, activation="silu")
                for x, wi in zip(qkv.split(self.split[:3], dim=-1), w.split(self.split[:3], dim=0))]

    def forward(self, x, *, injection=None, cache=None, cu_seqlens=None, cu_seqlens_cpu=None, attention_mask=None,
                context=None):
        """`context` (lm.models.context_parallel.ContextShard): x is this rank's slice of the sequences."""
        b, t, _ = x.shape
        if cache is not None and cu_seqlens is not None:
            raise ValueError("cu_seqlens (packed documents) cannot be combined with a generation cache")
        H, dk, dv, nh = self.H, self.dk, self.dv, self.nh
        proj = self.in_proj(x)
        if injection is not None:
            proj = proj + injection
        if attention_mask is not None:
            # pads as identity steps (Mixer): q, k, v 0 (the short convs' input: before a row's first real token a
            # fresh start's zero history), beta's and the forget gate's pre-activations -inf (beta = sigmoid = 0:
            # no Householder step; log g = -exp(A_log) softplus(-inf) = 0: no decay), the output gate 0
            s = self.split
            proj = mask_pads(proj, attention_mask, [(self.conv_dim, 0.0), (s[3], float("-inf")),
                                                    (s[4], float("-inf")), (s[5], 0.0)])
        qkv, beta, a, gate = proj.split([self.conv_dim, *self.split[3:]], dim=-1)
        state = cache.get(self.layer_idx) if cache is not None else {}
        conv_state = None
        if self.conv1d is not None and cache is None:
            q, k, v = (self._short_convs(qkv, cu_seqlens) if context is None
                       else self._short_convs_cp(qkv, cu_seqlens, context))
        else:
            if self.conv1d is not None:
                qkv, conv_state = causal_conv1d(qkv, self.conv1d.weight.squeeze(1), None, cu_seqlens=cu_seqlens,
                                                conv_state=state.get("conv"), activation="silu")
            else:
                qkv = F.silu(qkv)
            q, k, v = qkv.split(self.split[:3], dim=-1)
        q = q.reshape(b, t, H, dk)
        k = k.reshape(b, t * nh, H, dk)  # per token (n_h, H, dk): row i*nh + j is step j of token i
        v = v.reshape(b, t * nh, H, dv)
        cd = torch.float64 if proj.dtype == torch.float64 else torch.float32  # gates in at least float32
        beta = beta.to(cd).sigmoid().reshape(b, t * nh, H)
        if self.allow_neg_eigval:
            beta = 2 * beta
        g = None
        if self.use_forget_gate:
            g = -torch.exp(self.A_log.to(cd)) * F.softplus(a.to(cd) + self.dt_bias.to(cd))  # (b, t, H)
        if cache is not None and t == 1:
            h0 = state.get("state")
            if h0 is None:
                h0 = x.new_zeros(b, H, dk, dv, dtype=torch.float32)
            o, new_state = deltaproduct_step(
                h0, q[:, 0], k.reshape(b, nh, H, dk), v.reshape(b, nh, H, dv), beta.reshape(b, nh, H),
                g[:, 0] if g is not None else None, use_qk_l2norm=True)
            o = o.unsqueeze(1)
        elif context is not None:
            o, new_state = chunk_deltaproduct_cp(
                q, k, v, beta, g, context.slice, num_householder=nh, use_qk_l2norm=True, cu_seqlens=cu_seqlens,
                chunk_size=self.chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
        else:
            o, new_state = chunk_deltaproduct(
                q, k, v, beta, g, num_householder=nh, initial_state=state.get("state"),
                output_final_state=cache is not None, use_qk_l2norm=True, cu_seqlens=cu_seqlens,
                chunk_size=self.chunk_size, cu_seqlens_cpu=cu_seqlens_cpu)
        if cache is not None:
            upd = {"state": new_state}
            if conv_state is not None:
                upd["conv"] = conv_state
            cache.update(self.layer_idx, **upd)
        o = self.o_norm(o)  # (b, t, H, dv): normalised per head
        if self.use_output_gate:
            o = o * F.silu(gate.reshape(b, t, H, dv))
        return self.o_proj(o.reshape(b, t, H * dv))


class LMDeltaProductModel(LMModel):
    config_class = LMDeltaProductConfig
    mixer_class = DeltaProductMixer


class LMDeltaProductForCausalLM(LMForCausalLM):
    config_class = LMDeltaProductConfig
    mixer_class = DeltaProductMixer
    model_class = LMDeltaProductModel
