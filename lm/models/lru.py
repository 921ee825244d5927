"""The LRU family (papers 004 and 002): `lm_lru` with variant lru | hlru | bdlru, explicit or implicit.

Block (the shared pre-norm residual block): x = x + LRUMixer(RMSNorm(x)); x = x + SwiGLU(RMSNorm(x)).
This is paper 004's "linear recurrence followed by a non-linear projection" (T = g o R o e): the mixer
is linear in its input sequence (for `lru`), the SwiGLU MLP (intermediate_size) is the position-wise
non-linearity g, and the residual stream plus pre-norm make it stackable. Paper 002's models are
"Embedding -> model -> MLP decoder", i.e. one such block. The minimal-LRU repository's GELU + GLU after
the LRU is replaced by the block's SwiGLU (one non-linear MLP per layer, as in every family here).

Mixers, all scanned by `lm_kernels.lru.block_scan` (h_t = A_t h_{t-1} + x_t, blocks of size m):

    lru   (paper 004, minimal-LRU parameterisation, non-selective). N complex states carried as real
          (Re, Im) pairs, i.e. 2x2 rotation-scaling blocks:
              lambda = exp(-exp(nu_log) + i exp(theta_log)),  gamma = exp(gamma_log)
              h_t = lambda * h_{t-1} + gamma * (B x_t)          B: in_proj (d -> 2N, pairs (Re, Im))
              y_t = Re(C h_t) + D * x_t                         C: out_proj (2N -> d), D per channel
          init: |lambda|^2 ~ U[r_min^2, r_max^2] (uniform on the ring), phase ~ U[0, max_phase],
          gamma = sqrt(1 - |lambda|^2), B ~ N(0, 1/(2d)), C ~ N(0, 1/N), D ~ N(0, 1).
    hlru  (paper 002 eq. 3, order m, N channels). in_proj gives v (N) and raw gates (N, m+1), plus a
          learned gate bias; gates are L1-normalised over the m+1 entries (softmax by default, index 0
          is the input gate a_0):  h_t = sum_{i=1..m} a_{i,t} h_{t-i} + a_{0,t} v_t, scanned in the
          companion form H_t = [h_t .. h_{t-m+1}] (first row a_1..a_m, ones below the diagonal; NOT the
          transposed form of the paper's appendix snippet, which computes a different recurrence).
          y = out_proj(all N*m state entries), as the paper's code.
    bdlru (paper 002, N dense blocks of size m). in_proj gives v (N, m) and raw gates (N, m, m+1); each
          row [a_{i,0}, a_{i,1..m}] is L1-normalised (softmax) including the input gate, so that
          ||h_t||_inf <= max_s ||v_s||_inf (Prop. 1):  h_t = A_t h_{t-1} + a_{0,t} * v_t;
          y = out_proj(h (N*m)).

Implicit models: the injection is added to in_proj's output (B x for lru; v and the raw gates for
hlru / bdlru), so the transitions of the selective variants depend on the iterate.
Generation cache per layer: `h` (b, N, m) float32.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm_kernels.context_parallel import block_scan_cp
from lm_kernels.lru import block_scan, block_scan_step, companion, lru_lambda_blocks

from .config import LMConfig
from .modeling import LMForCausalLM, LMModel, Mixer, init

VARIANTS = ("lru", "hlru", "bdlru")
MAX_BLOCK = 8  # largest block the scan op supports


class LMLRUConfig(LMConfig):
    """Config of `lm_lru`.

    variant:         "lru" (complex diagonal, non-selective), "hlru" (order-m companion), "bdlru" (blocks).
    num_states:      N: complex states (lru), channels (hlru) or blocks (bdlru). None = hidden_size for
                     lru and hlru, hidden_size // block_size for bdlru.
    block_size:      m: order (hlru) or block size (bdlru), 1..8; None = 4. lru: None or 2 (2x2 blocks).
    gate_activation: L1 normalisation f of the selective gates: "softmax" (f = exp) or "sigmoid".
    r_min, r_max, max_phase: LRU ring initialisation (paper 004's best: 0.9, 0.999; phase in [0, 2 pi]).
    chunk_size:      chunk length of the block scan.
    """

    model_type = "lm_lru"
    _fields = {
        "variant": "lru",
        "num_states": None,
        "block_size": None,
        "gate_activation": "softmax",
        "r_min": 0.9,
        "r_max": 0.999,
        "max_phase": 6.28,
        "chunk_size": 64,
    }

    def __init__(self, **kwargs):
        kwargs.setdefault("intermediate_size", 688)
        super().__init__(**kwargs)

    def validate(self):
        super().validate()
        self._check(self.variant in VARIANTS, "variant", f"must be one of {VARIANTS}")
        if self.variant == "lru":
            if self.block_size is None:
                self.block_size = 2
            self._check(self.block_size == 2, "block_size",
                        "variant 'lru' uses 2x2 real blocks (complex diagonal): leave block_size unset or 2")
        else:
            if self.block_size is None:
                self.block_size = 4
            self._check(isinstance(self.block_size, int) and not isinstance(self.block_size, bool)
                        and 1 <= self.block_size <= MAX_BLOCK, "block_size", f"must be an integer in [1, {MAX_BLOCK}]")
        if self.num_states is None:
            self.num_states = (max(1, self.hidden_size // self.block_size) if self.variant == "bdlru"
                               else self.hidden_size)
        self._check(isinstance(self.num_states, int) and not isinstance(self.num_states, bool)
                    and self.num_states > 0, "num_states", "must be a positive integer or None")
        self._check(self.gate_activation in ("softmax", "sigmoid"), "gate_activation",
                    "must be 'softmax' or 'sigmoid'")
        self._check(isinstance(self.r_max, (int, float)) and 0 < self.r_max < 1, "r_max", "must be in (0, 1)")
        self._check(isinstance(self.r_min, (int, float)) and 0 <= self.r_min <= self.r_max, "r_min",
                    f"must be in [0, r_max={self.r_max}]")
        self._check(isinstance(self.max_phase, (int, float)) and self.max_phase > 0, "max_phase", "must be > 0")
        self._check(isinstance(self.chunk_size, int) and not isinstance(self.chunk_size, bool)
                    and self.chunk_size > 0, "chunk_size", "must be a positive integer")


# --- pure pieces -------------------------------------------------------------------------------------
def l1_normalised_gates(raw: torch.Tensor, activation: str) -> torch.Tensor:
    """f(raw) / sum f(raw) over the last dim (paper 002 eq. 6); f = exp (softmax) or sigmoid."""
    if activation == "softmax":
        return torch.softmax(raw, dim=-1)
    s = torch.sigmoid(raw)
    return s / s.sum(-1, keepdim=True)


def lru_ring_init(n: int, r_min: float, r_max: float, max_phase: float) -> tuple[torch.Tensor, ...]:
    """(nu_log, theta_log, gamma_log) of n LRU eigenvalues: |lambda|^2 ~ U[r_min^2, r_max^2],
    phase ~ U[0, max_phase], gamma = sqrt(1 - |lambda|^2) (paper 004 / minimal-LRU)."""
    u1, u2 = torch.rand(n), torch.rand(n)
    r2 = (u1 * (r_max ** 2 - r_min ** 2) + r_min ** 2).clamp(min=1e-12)
    nu_log = torch.log(-0.5 * torch.log(r2))
    theta_log = torch.log((max_phase * u2).clamp(min=1e-6))
    mod = torch.exp(-torch.exp(nu_log))
    gamma_log = 0.5 * torch.log1p(-mod ** 2)
    return nu_log, theta_log, gamma_log


def hlru_transition(gates: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """H-LRU: normalised gates (..., N, m+1) [a_0, a_1..a_m] and v (..., N) -> (A (..., N, m, m), x (..., N, m))
    with A the companion matrices and x = [a_0 v, 0, ..., 0]."""
    m = gates.shape[-1] - 1
    A = companion(gates[..., 1:])
    x = F.pad((gates[..., 0] * v).unsqueeze(-1), (0, m - 1))
    return A, x


def bdlru_transition(gates: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BD-LRU: normalised gates (..., N, m, m+1) (row i: [a_i0, a_i1..a_im]) and v (..., N, m) ->
    (A (..., N, m, m), x = a_0 * v (..., N, m))."""
    return gates[..., 1:], gates[..., 0] * v


class LRUMixer(Mixer):
    capturable = True  # (Mixer.capturable)

    def __init__(self, config: LMLRUConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.variant = config.variant
        self.N, self.m = config.num_states, config.block_size
        self.chunk_size = config.chunk_size
        self.gate_activation = config.gate_activation
        N, m, d = self.N, self.m, config.hidden_size
        self.v_dim = self.v_width(config)
        self.in_proj = nn.Linear(d, self.injection_dim(config), bias=False)
        if self.variant == "lru":
            self.nu_log = nn.Parameter(torch.zeros(N))
            self.theta_log = nn.Parameter(torch.zeros(N))
            self.gamma_log = nn.Parameter(torch.zeros(N))
            self.D = nn.Parameter(torch.zeros(d))
            for p in (self.nu_log, self.theta_log, self.gamma_log):
                p._no_weight_decay = True
        else:
            shape = (N, m + 1) if self.variant == "hlru" else (N, m, m + 1)
            self.gate_bias = nn.Parameter(torch.zeros(shape))
            self.gate_bias._no_weight_decay = True
        self.out_proj = nn.Linear(N * m, d, bias=False)
        self.init_weights(config)

    @staticmethod
    def v_width(config) -> int:
        return {"lru": 2 * config.num_states, "hlru": config.num_states,
                "bdlru": config.num_states * config.block_size}[config.variant]

    @staticmethod
    def injection_dim(config) -> int:
        N, m = config.num_states, config.block_size
        gates = {"lru": 0, "hlru": N * (m + 1), "bdlru": N * m * (m + 1)}[config.variant]
        return LRUMixer.v_width(config) + gates

    def init_weights(self, config) -> None:
        if self.variant == "lru":
            nu_log, theta_log, gamma_log = lru_ring_init(self.N, config.r_min, config.r_max, config.max_phase)
            init.copy_(self.nu_log, nu_log)
            init.copy_(self.theta_log, theta_log)
            init.copy_(self.gamma_log, gamma_log)
            init.normal_(self.in_proj.weight, std=1 / math.sqrt(2 * config.hidden_size))  # B = B_re + i B_im
            init.normal_(self.out_proj.weight, std=1 / math.sqrt(self.N))  # C = C_re + i C_im
            init.normal_(self.D, std=1.0)
        else:
            init.zeros_(self.gate_bias)

    def flops_per_token(self, seq_len: int) -> float:
        scan = 2 * self.N * self.m * self.m + self.N * self.m  # block mat-vec + input
        if self.variant == "lru":
            return scan + 2 * self.N  # gamma scaling of B x
        gates = self.gate_bias.numel()
        return scan + 4 * gates  # normalisation (f, sum, divide) and a_0 * v

    def transitions(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj output (b, t, width) -> (A (b, t, N, m, m), x (b, t, N, m)) in float32
        (float64 for a float64 model)."""
        b, t, _ = proj.shape
        N, m = self.N, self.m
        cd = torch.float64 if proj.dtype == torch.float64 else torch.float32
        proj = proj.to(cd)
        if self.variant == "lru":
            x = proj.reshape(b, t, N, 2) * torch.exp(self.gamma_log.to(cd)).unsqueeze(-1)
            A = lru_lambda_blocks(self.nu_log.to(cd), self.theta_log.to(cd)).expand(b, t, N, 2, 2)
            return A, x
        v, raw = proj.split([self.v_dim, proj.shape[-1] - self.v_dim], dim=-1)
        raw = raw.reshape(b, t, *self.gate_bias.shape) + self.gate_bias.to(cd)
        gates = l1_normalised_gates(raw, self.gate_activation)
        if self.variant == "hlru":
            return hlru_transition(gates, v)
        return bdlru_transition(gates, v.reshape(b, t, N, m))

    def forward(self, x, *, injection=None, cache=None, cu_seqlens=None, attention_mask=None, context=None):
        """`context` (lm.models.context_parallel.ContextShard): x is this rank's slice of the sequences."""
        b, t, _ = x.shape
        if cache is not None and cu_seqlens is not None:
            raise ValueError("cu_seqlens (packed documents) cannot be combined with a generation cache")
        proj = self.in_proj(x)
        if injection is not None:
            proj = proj + injection
        A, xin = self.transitions(proj)
        if attention_mask is not None:  # pads as identity steps (Mixer): A = I, x = 0
            keep = attention_mask[:, :, None, None]
            xin = xin.masked_fill(~keep, 0.0)
            A = torch.where(keep.unsqueeze(-1), A, torch.eye(self.m, dtype=A.dtype, device=A.device))
        state = cache.get(self.layer_idx) if cache is not None else {}
        if cache is not None and t == 1:
            h0 = state.get("h")
            if h0 is None:
                h0 = xin.new_zeros(b, self.N, self.m)
            final = block_scan_step(h0, A[:, 0], xin[:, 0])
            h = final.unsqueeze(1)
        elif context is not None:
            h, final = block_scan_cp(A, xin, context.slice, cu_seqlens=cu_seqlens, chunk_size=self.chunk_size)
        else:
            h, final = block_scan(A, xin, initial_state=state.get("h"), cu_seqlens=cu_seqlens,
                                  chunk_size=self.chunk_size, return_final_state=cache is not None)
        if cache is not None:
            cache.update(self.layer_idx, h=final)
        y = self.out_proj(h.reshape(b, t, self.N * self.m).to(x.dtype))
        if self.variant == "lru":
            y = y + self.D.to(x.dtype) * x
        return y


class LMLRUModel(LMModel):
    config_class = LMLRUConfig
    mixer_class = LRUMixer


class LMLRUForCausalLM(LMForCausalLM):
    config_class = LMLRUConfig
    mixer_class = LRUMixer
    model_class = LMLRUModel
