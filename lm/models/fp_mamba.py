"""FP-Mamba (paper 000, the Mamba2/SSD variant): a fixed point inside every layer.

One layer iterates its own output y (b, t, d_inner) from y^0 = 0 (paper eq. 12-13, App. C.2):

    y_{t-1}   = shift(y^{l-1})                                       (zero at sequence/document starts)
    x~_t      = Q_t (x_t - y^{l-1}_t) + y^{l-1}_t,   Q_t = Q([x_t; y_{t-1}])   (channel mixing)
    B_t, C_t  = l2norm(W_B x_t + W_B^y y_{t-1}),  l2norm(W_C x_t + W_C^y y_{t-1})
    y^l       = GatedRMSNorm(SSD(x~, dt, A, B, C, D), z)              (the per-iteration normalisation)

until the relative inf-norm residual ||y^l - y^{l-1}||_inf / ||y^l||_inf of a quantile of the batch's
samples (0.75 in training, 1.0 in evaluation) is below the tolerance, with damping that decays after
`patience` non-improving iterations. dt, A and the gate z depend on x only (App. C.2, as the
official code). The iteration runs without autograd through `lm.fixed_point.solve`; then `phantom_steps`
steps with autograd from the detached fixed point (`phantom`) give the gradient at the fixed point
(paper sec. 3.5, k = 0 truncation). The layer's solver settings are the config's `layer_solver`, an
ImplicitSettings with the names and meanings of the implicit models' `implicit` (LAYER_SOLVER: FP-Mamba's
defaults, which a dict given for it is completed from); the fp_* fields of older configs are read into it
(LEGACY_FIELDS). The layer output is out_proj(y) (gate inside the loop, the paper's
"GLU in the loop"); `shifted_output_gate=True` moves the gate outside instead,
out_proj(silu(z + W_z^y y_{t-1}) * y), the official code's default.

Relation to Mamba2 (lm/models/mamba2.py, same parameter names in_proj, conv1d, dt_bias, A_log, D, norm,
out_proj): with Q = I (`mixer_type="identity"`), `bc_norm=False` and `shifted_output_gate=False`, one
iteration from y = 0 IS the Mamba2 layer (the y-dependent terms vanish at y = 0); with also
`bc_h_dep=False` the map does not depend on y at all and every iteration equals Mamba2. FP-Mamba
differs from Mamba2 by exactly: Q, the y-dependence of B/C (and Q), the L2 normalisation of B/C, and
the optional shifted output gate. `d_conv=0` drops the short conv (the official FP-Mamba2 default).

Modes: without a cache all tokens iterate together (parallel; training, evaluation). With a cache
(generation) tokens are processed one at a time (sequential, paper Fig. 10): each token iterates
against the committed SSM state and the previous token's output, then `phantom_steps` committing steps
write the state; a prompt is processed the same way, token by token, so cached generation equals the
sequential mode run from scratch on the whole sequence. `prefill="parallel"` instead solves a prompt in
parallel mode from the cached state (its logits equal the parallel forward; the decode that follows
then differs from the sequential reference by about the tolerance). The implicit variant (config `implicit={...}`)
adds the injection to in_proj's output, like Mamba2; the implicit stack then wraps layers that iterate
themselves.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm_kernels.context_parallel import causal_conv1d_cp, shift_halo, ssd_scan_cp
from lm_kernels.ssd import ssd_scan, ssd_step

from ..fixed_point import FixedPointStats, phantom, solve
from .channel_mixers import ACTIVATIONS, KRONECKER_NORMS, MIXER_TYPES, make_channel_mixer
from .config import ImplicitSettings, InvalidSetting, LMConfig
from .layers import GatedRMSNorm, causal_conv1d, dt_init, position_in_document
from .modeling import LMForCausalLM, LMModel, Mixer, init, mask_pads

MIXER_INPUTS = ("concat", "sum", "x")

# The fixed point inside each layer (paper 000): a training cap of 100 iterations, 1000 in evaluation and
# generation, tolerance 0.1 on the relative inf-norm residual, stopping once 75% of the batch's samples have
# converged in training (all of them in evaluation), damping 1 decaying by 0.9 after 15 iterations without a better
# residual, one step with autograd at the fixed point.
LAYER_SOLVER = ImplicitSettings(max_iter=100, eval_cap=1000, tol=0.1, stop_quantile=0.75, eval_stop_quantile=1.0,
                                damping=1.0, damping_decay=0.9, patience=15, norm="inf", phantom_steps=1)

# The layer solver's fields before they were one ImplicitSettings (config.json of older FP-Mamba checkpoints) and
# the setting each is read into, with the same meaning; their defaults were LAYER_SOLVER's.
LEGACY_FIELDS = {
    "fp_max_iter": "max_iter", "fp_eval_max_iter": "eval_cap", "fp_tol": "tol",
    "fp_train_quantile": "stop_quantile", "fp_eval_quantile": "eval_stop_quantile", "fp_damping": "damping",
    "fp_damping_decay": "damping_decay", "fp_patience": "patience", "fp_train_iter_gamma": "train_iter_gamma",
    "n_backwards": "phantom_steps",
}


class LMFPMambaConfig(LMConfig):
    model_type = "lm_fp_mamba"
    _fields = {
        # the Mamba2 layer being iterated (names and meaning as lm_mamba2)
        "d_state": 128,
        "d_conv": 4,  # 0 = no short conv (official FP-Mamba2 default)
        "expand": 2,
        "headdim": 64,
        "ngroups": 1,
        "chunk_size": 256,
        "dt_min": 0.001,
        "dt_max": 0.1,
        "dt_limit": [0.0, None],
        "A_init_range": [1.0, 16.0],
        "conv_bias": True,
        # channel mixer Q_t
        "mixer_type": "householder",  # householder | dplr | kronecker | identity (Q = I)
        "mixer_rank": 2,  # Householder reflections / DPLR rank (unused by kronecker)
        "mixer_activation": "silu",  # on u (H/DPLR) and on the Cholesky parameters (K)
        "mixer_input": "concat",  # Q's parameter input: [x; y_{t-1}] | x + y_{t-1} | x
        "mixer_neg_eigval": True,  # factor 2 on alpha / D: eigenvalues of Q in [-1, 1]
        "mixer_proj_rank": 0,  # 0 = full projection, k = low-rank (in -> k -> out) projection
        "kronecker_norm": "spectral",  # spectral (paper: power iteration) | row (official default)
        "mixer_gate_bias": -2.0,  # initial bias of Q's sigmoid gates (alpha for H/DPLR, d for K); see init_weights
        # iterate dependence and normalisation
        "bc_h_dep": True,  # B, C += W^y y_{t-1}
        "bc_norm": True,  # L2-normalise B and C over d_state
        "shifted_output_gate": False,  # out_proj(silu(z + W_z^y y_{t-1}) * y) instead of the gate in the loop
        # the fixed point inside each layer: ImplicitSettings (a dict given is completed from LAYER_SOLVER)
        "layer_solver": LAYER_SOLVER,
        "prefill": "sequential",  # with a cache, t > 1 tokens: per token (exact) | parallel (fast, ~tol)
    }
    _solver_fields = {**LMConfig._solver_fields, "layer_solver": LAYER_SOLVER}

    @classmethod
    def _read_legacy(cls, kwargs: dict) -> dict:
        """An older config's fp_* / n_backwards fields read into `layer_solver` (LEGACY_FIELDS)."""
        old = {k: kwargs[k] for k in LEGACY_FIELDS if k in kwargs}
        if not old:
            return kwargs
        if kwargs.get("layer_solver") is not None:
            raise ValueError(f"layer_solver: given together with the older field(s) {sorted(old)} that it replaces; "
                             "set the solver settings in layer_solver only")
        kwargs = {k: v for k, v in kwargs.items() if k not in LEGACY_FIELDS}
        settings = {LEGACY_FIELDS[k]: v for k, v in old.items()}
        try:
            kwargs["layer_solver"] = ImplicitSettings.from_value(settings, LAYER_SOLVER, "layer_solver")
        except InvalidSetting as err:
            name = next(k for k, v in LEGACY_FIELDS.items() if v == err.field)
            raise ValueError(f"{name} (read into layer_solver.{err.field}): {err.why} (got {err.value!r})") from None
        return kwargs

    def validate(self):
        super().validate()

        def pos_int(f, minimum=1):
            v = getattr(self, f)
            self._check(isinstance(v, int) and not isinstance(v, bool) and v >= minimum, f,
                        f"must be an integer >= {minimum}")

        for f in ("d_state", "expand", "headdim", "ngroups", "chunk_size", "mixer_rank"):
            pos_int(f)
        pos_int("d_conv", 0)
        pos_int("mixer_proj_rank", 0)
        self._check(self.d_inner % self.headdim == 0, "headdim",
                    f"must divide d_inner = expand * hidden_size = {self.d_inner}")
        self._check(self.nheads % self.ngroups == 0, "ngroups", f"must divide the number of heads {self.nheads}")
        self._check(0 < self.dt_min <= self.dt_max, "dt_min", "need 0 < dt_min <= dt_max")
        lim = self.dt_limit
        self._check(isinstance(lim, (list, tuple)) and len(lim) == 2 and lim[0] >= 0
                    and (lim[1] is None or lim[1] > lim[0]), "dt_limit", "need [low >= 0, high > low or None]")
        r = self.A_init_range
        self._check(isinstance(r, (list, tuple)) and len(r) == 2 and 0 < r[0] <= r[1], "A_init_range",
                    "need [low, high] with 0 < low <= high")
        self._check(self.mixer_type in MIXER_TYPES, "mixer_type", f"must be one of {MIXER_TYPES}")
        self._check(self.mixer_activation in ACTIVATIONS, "mixer_activation", f"must be one of {ACTIVATIONS}")
        self._check(self.mixer_input in MIXER_INPUTS, "mixer_input", f"must be one of {MIXER_INPUTS}")
        self._check(self.kronecker_norm in KRONECKER_NORMS, "kronecker_norm", f"must be one of {KRONECKER_NORMS}")
        self._check(isinstance(self.mixer_gate_bias, (int, float)) and not isinstance(self.mixer_gate_bias, bool)
                    and math.isfinite(self.mixer_gate_bias), "mixer_gate_bias", "must be a finite number")
        self._check(self.prefill in ("sequential", "parallel"), "prefill", "must be 'sequential' or 'parallel'")
        for f in ("conv_bias", "mixer_neg_eigval", "bc_h_dep", "bc_norm", "shifted_output_gate"):
            self._check(isinstance(getattr(self, f), bool), f, "must be true or false")
        s = self.layer_solver
        self._check(s is not None, "layer_solver", "must be the layer's solver settings (a dict, or omitted for "
                    "FP-Mamba's defaults), not null: every FP-Mamba layer iterates")
        if s.phantom_steps < 1:
            raise ValueError(f"layer_solver.phantom_steps: must be >= 1 (the layer's output is a step from its fixed "
                             f"point) (got {s.phantom_steps})")

    @property
    def d_inner(self) -> int:
        return self.expand * self.hidden_size

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim


@dataclasses.dataclass
class _Inputs:
    """The iterate-independent parts of one layer call (from in_proj and the conv)."""

    z: torch.Tensor  # (b, t, d_inner) gate
    x: torch.Tensor  # (b, t, d_inner) SSM input
    B: torch.Tensor  # (b, t, g*n) x-part of B
    C: torch.Tensor  # (b, t, g*n)
    dt: torch.Tensor  # (b, t, nheads) raw (before dt_bias / softplus)

    def token(self, i: int) -> "_Inputs":
        return _Inputs(*(getattr(self, f.name)[:, i: i + 1] for f in dataclasses.fields(self)))


def shift_right(y: torch.Tensor, first: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """y_{t-1}: (b, t, d) shifted by one step along t, `first` (b, d) (or zeros) at t = 0; positions where
    `keep` (t,) is False (document starts of a packed row) are zeroed."""
    head = first.unsqueeze(1).to(y.dtype) if first is not None else y.new_zeros(y.shape[0], 1, y.shape[2])
    ys = torch.cat([head, y[:, :-1]], dim=1)
    if keep is not None:
        ys = ys * keep.view(1, -1, 1).to(ys.dtype)
    return ys


class FPMambaMixer(Mixer):
    def __init__(self, config: LMFPMambaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.fp_config = config
        self.d_inner, self.nheads, self.headdim = config.d_inner, config.nheads, config.headdim
        self.d_state, self.ngroups, self.chunk_size = config.d_state, config.ngroups, config.chunk_size
        self.eps = config.rms_norm_eps
        lo, hi = config.dt_limit
        self.dt_limit = (float(lo), float("inf") if hi is None else float(hi))
        gn = self.ngroups * self.d_state
        self.conv_dim = self.d_inner + 2 * gn
        self.in_proj = nn.Linear(config.hidden_size, self.injection_dim(config), bias=False)
        if config.d_conv > 0:
            self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, config.d_conv, groups=self.conv_dim,
                                    padding=config.d_conv - 1, bias=config.conv_bias)
        else:
            self.conv1d = None
        self.dt_bias = nn.Parameter(torch.zeros(self.nheads))
        self.A_log = nn.Parameter(torch.zeros(self.nheads))
        self.D = nn.Parameter(torch.ones(self.nheads))
        self.norm = GatedRMSNorm(self.d_inner, self.d_inner // self.ngroups, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.d_inner, config.hidden_size, bias=False)
        self.bc_y_proj = nn.Linear(self.d_inner, 2 * gn, bias=False) if config.bc_h_dep else None
        self.z_y_proj = nn.Linear(self.d_inner, self.d_inner, bias=False) if config.shifted_output_gate else None
        mixer_in = 2 * self.d_inner if config.mixer_input == "concat" else self.d_inner
        self.q_mixer = make_channel_mixer(
            config.mixer_type, mixer_in, self.d_inner, rank=config.mixer_rank, activation=config.mixer_activation,
            neg_eigval=config.mixer_neg_eigval, kronecker_norm=config.kronecker_norm,
            proj_rank=config.mixer_proj_rank, eps=self.eps,
        )
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
        self._stats: list[FixedPointStats] = []
        self.init_weights(config)

    @staticmethod
    def injection_dim(config) -> int:
        return 2 * config.d_inner + 2 * config.ngroups * config.d_state + config.nheads

    def init_weights(self, config) -> None:
        """Mamba2's dt/A/D init, plus an O(1) scale for x. Unlike Mamba2, the layer map is not invariant to
        the scale of x: x~ = Q(x - y) + y mixes x with the unit-RMS iterate y, and with x ~ 0.01 (the
        shared std-0.02 init of in_proj and conv1d) y dominates, the map is close to a normalised linear
        map of y and the iteration does not converge at init. So in_proj gets std 1/sqrt(hidden_size)
        (unit-RMS outputs on the normalised residual stream) and conv1d PyTorch's default uniform init
        (+-1/sqrt(d_conv)), as mamba_ssm leaves them; x then has RMS ~0.35 and the iteration converges
        at init (about 10 iterations at tol 0.1, see the tests).

        Q's sigmoid gates start at sigmoid(mixer_gate_bias) = 0.12 (bias -2), so Q starts near I and the
        layer near Mamba2. The official code starts them at ~0.5 (bias ~0): with the negative-eigenvalue
        factor 2 a Householder factor is then I - u u^T, singular, the fixed point is not unique at init,
        and sequential (per-token) and parallel solves land on different fixed points (measured: relative
        difference > 1 on 3 of 3 seeds, both with residual < 1e-6); with bias -2 they agree to ~tol."""
        init.normal_(self.in_proj.weight, mean=0.0, std=config.hidden_size ** -0.5)
        if self.conv1d is not None:
            bound = config.d_conv ** -0.5
            init.uniform_(self.conv1d.weight, -bound, bound)
            if self.conv1d.bias is not None:
                init.uniform_(self.conv1d.bias, -bound, bound)
        q = self.q_mixer
        if q is not None:
            gate = q.diag_proj if hasattr(q, "diag_proj") else q.alpha_proj
            init.constant_(gate.bias, float(config.mixer_gate_bias))
        lo, hi = config.A_init_range
        init.copy_(self.dt_bias, dt_init(self.nheads, config.dt_min, config.dt_max))
        init.copy_(self.A_log, torch.log(torch.empty(self.nheads).uniform_(lo, hi)))
        init.ones_(self.D)

    def pop_stats(self) -> list[FixedPointStats]:
        out, self._stats = self._stats, []
        return out

    def flops_per_token(self, seq_len: int) -> float:
        """One application of the layer map (scan + Q); a forward runs it (iterations + phantom_steps) times,
        and the per-iteration Linear layers (bc_y_proj, Q's projections) likewise."""
        c = min(self.chunk_size, seq_len)
        h, p, n = self.nheads, self.headdim, self.d_state
        scan = 2 * h * (c / 2) * (n + p) + 2 * 2 * h * p * n
        return scan + (self.q_mixer.flops_per_token() if self.q_mixer is not None else 0.0)

    def solver_flops_per_token(self, seq_len: int, iterations: float) -> float:
        """Training FLOPs per token of the layer's solve beyond the one application with autograd that
        flops_per_token and the Linear layers count: `iterations` no-grad applications of the layer map and
        phantom_steps - 1 more with autograd (forward + backward = 3x). One application = the scan, Q, and the
        per-iteration Linear layers (Q's projections, bc_y_proj)."""
        linear = [self.bc_y_proj, self.q_mixer]
        per_iter = self.flops_per_token(seq_len) + 2.0 * sum(
            m.weight.numel() for mod in linear if mod is not None for m in mod.modules() if isinstance(m, nn.Linear))
        return (iterations + 3.0 * (self.fp_config.layer_solver.phantom_steps - 1)) * per_iter

    # --- pieces -------------------------------------------------------------------------------------
    def _inputs(self, x, injection, conv_state, cu_seqlens, attention_mask=None, context=None):
        zxbcdt = self.in_proj(x)
        if injection is not None:
            zxbcdt = zxbcdt + injection
        if attention_mask is not None:
            # pads as identity steps (Mixer): xBC 0 (the conv's input), dt -inf (softplus 0: the SSM state passes
            # unchanged), z 0; the iterate at pads is held at 0 by layer_map
            if self.dt_limit[0] > 0:
                raise ValueError(f"attention_mask with pads needs dt_limit's low end 0 (a pad is a step with dt = 0), "
                                 f"got dt_limit={self.dt_limit}: run the prompts one by one or without padding")
            zxbcdt = mask_pads(zxbcdt, attention_mask, [(self.d_inner + self.conv_dim, 0.0),
                                                        (self.nheads, float("-inf"))])
        z, xbc, dt = zxbcdt.split([self.d_inner, self.conv_dim, self.nheads], dim=-1)
        new_conv = None
        if self.conv1d is not None and context is not None:
            xbc = causal_conv1d_cp(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, context.slice,
                                   cu_seqlens=cu_seqlens, activation="silu")
        elif self.conv1d is not None:
            xbc, new_conv = causal_conv1d(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, cu_seqlens=cu_seqlens,
                                          conv_state=conv_state, activation="silu")
        gn = self.ngroups * self.d_state
        xs, B, C = xbc.split([self.d_inner, gn, gn], dim=-1)
        return _Inputs(z, xs, B, C, dt), new_conv

    def _mixer_param(self, x, ys):
        kind = self.fp_config.mixer_input
        if kind == "concat":
            return torch.cat([x, ys], dim=-1)
        return x + ys if kind == "sum" else x

    def layer_map(self, inp: _Inputs, y, *, y_first=None, state=None, keep=None, cu_seqlens=None,
                  token=False, return_state=False, max_seqlen=None, attention_mask=None, context=None):
        """One application of the layer map y^{l-1} -> y^l (module docstring). Returns (y^l, SSM final state
        or None). `token=True`: a single token (t == 1) through ssd_step from `state` (zeros if None).
        `max_seqlen` (with cu_seqlens): the model has checked the offsets, the scan does not read them again.
        `attention_mask` (b, t) bool, False at pads (whose inputs `_inputs` has made identity steps): y^l is 0 at the
        pads, so their iterate stays at y^0 = 0, out of the solver's residual (a row stops as its real tokens alone
        would), and the first real token's y_{t-1} is a fresh start's 0. `context` (context parallelism): y_{t-1} of
        the slice's first token is the previous rank's last, and the scan passes its state across the slices."""
        b, t, _ = y.shape
        if context is not None:
            y_first = shift_halo(y[:, -1], context.slice)
        ys = shift_right(y, y_first, keep)
        xt = inp.x
        if self.q_mixer is not None:
            xt = self.q_mixer(self._mixer_param(inp.x, ys), inp.x - y) + y
        B, C = inp.B, inp.C
        if self.bc_y_proj is not None:
            By, Cy = self.bc_y_proj(ys).chunk(2, dim=-1)
            B, C = B + By, C + Cy
        B = B.reshape(b, t, self.ngroups, self.d_state)
        C = C.reshape(b, t, self.ngroups, self.d_state)
        if self.fp_config.bc_norm:
            B = F.normalize(B, dim=-1, eps=self.eps)
            C = F.normalize(C, dim=-1, eps=self.eps)
        xh = xt.reshape(b, t, self.nheads, self.headdim)
        A = -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))  # (float64 stays)
        if token:
            if state is None:
                sdt = torch.float64 if xh.dtype == torch.float64 else torch.float32
                state = xh.new_zeros(b, self.nheads, self.headdim, self.d_state, dtype=sdt)
            out, new_state = ssd_step(state, xh[:, 0], inp.dt[:, 0], A, B[:, 0], C[:, 0], D=self.D,
                                      dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit)
            out = out.unsqueeze(1)
        elif context is not None:
            out, new_state = ssd_scan_cp(xh, inp.dt, A, B, C, context.slice, chunk_size=self.chunk_size, D=self.D,
                                         dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit,
                                         cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        else:
            out, new_state = ssd_scan(xh, inp.dt, A, B, C, chunk_size=self.chunk_size, D=self.D,
                                      dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit,
                                      initial_state=state, cu_seqlens=cu_seqlens, return_final_state=return_state,
                                      max_seqlen=max_seqlen)
        gate = None if self.z_y_proj is not None else inp.z
        y_new = self.norm(out.reshape(b, t, self.d_inner), gate)
        if attention_mask is not None:
            y_new = y_new.masked_fill(~attention_mask.unsqueeze(-1), 0.0)
        return y_new, new_state

    def _output(self, y, inp, y_first=None, keep=None, context=None):
        if self.z_y_proj is not None:
            if context is not None:
                y_first = shift_halo(y[:, -1], context.slice)
            y = y * F.silu(inp.z + self.z_y_proj(shift_right(y, y_first, keep)))
        return self.out_proj(y)

    def _phantom(self, f, y_star):
        """The layer's steps with autograd from the detached fixed point (its gradient; with a cache, its commit)."""
        s = self.fp_config.layer_solver
        return phantom(f, y_star, steps=s.phantom_steps, damping=s.damping)

    def _record(self, st: FixedPointStats) -> None:
        self._stats.append(st)
        if len(self._stats) > 4096:  # nobody popped (mixer used outside LMModel): keep the newest
            del self._stats[0]

    # --- modes --------------------------------------------------------------------------------------
    def iterate(self, x, *, injection=None, cu_seqlens=None, max_seqlen=None, keep=None, attention_mask=None,
                context=None):
        """Parallel mode on the normalised layer input x (b, t, hidden). Returns (y after the phantom
        steps, the detached fixed point y*, stats, the layer's x-only inputs, the document mask or None);
        y and y* are (b, t, d_inner), before the output gate / out_proj. `keep` (t,): the document mask (False at
        document starts) where the model has formed it (shared_inputs), else formed here from cu_seqlens.
        `attention_mask` (b, t): False at pads (see layer_map). `context` (context parallelism): x is this rank's
        slice; the document mask is the tokens' global one and the solver's residual the whole rows' (every rank of
        the group iterates alike)."""
        inp, _ = self._inputs(x, injection, None, cu_seqlens, attention_mask, context)
        if context is not None:
            keep = context.positions(x.device) > 0
        elif cu_seqlens is not None and keep is None:
            keep = position_in_document(x.shape[1], cu_seqlens, x.device) > 0

        def f(y):
            return self.layer_map(inp, y, keep=keep, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                  attention_mask=attention_mask, context=context)[0]

        y0 = inp.x.new_zeros(inp.x.shape)
        y_star, st = solve(f, y0, **self.fp_config.layer_solver.solve_args(self.training),
                           **({"group": context.group} if context is not None else {}))
        y = self._phantom(f, y_star)
        return y, y_star, st, inp, keep

    def shared_inputs(self, t: int, cu_seqlens, device, positions=None, max_seqlen=None,
                      cu_seqlens_cpu=None, key_mask=None) -> dict:
        """With packed documents: the document mask `keep` (t,) (False at document starts), formed once per forward
        outside the compiled blocks (its document lookup, a searchsorted on a slice of the offsets, is one that
        torch 2.11's inductor cannot lower inside a block's graph), and the longest document's length (a host int),
        the sign that the model has checked the offsets, so that the scans of the layer's iterations do not read them
        back to check them again."""
        if cu_seqlens is None:
            return {}
        out = {"keep": position_in_document(t, cu_seqlens, device) > 0}
        if max_seqlen is not None:
            out["max_seqlen"] = max_seqlen
        return out

    def forward(self, x, *, injection=None, cache=None, cu_seqlens=None, max_seqlen=None, keep=None,
                attention_mask=None, context=None):
        if cache is not None:
            return self._sequential(x, injection, cache, cu_seqlens, attention_mask)
        y, _, st, inp, keep = self.iterate(x, injection=injection, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                           keep=keep, attention_mask=attention_mask, context=context)
        self._record(st)
        return self._output(y, inp, keep=keep, context=context)

    def _sequential(self, x, injection, cache, cu_seqlens, attention_mask=None):
        """Token by token against the committed state (generation); see the module docstring. `attention_mask`
        (b, t): False at the pads of left-padded prompts (see layer_map)."""
        if cu_seqlens is not None:
            raise ValueError("FP-Mamba: cu_seqlens (packed documents) is not supported with a generation cache")
        state = cache.get(self.layer_idx)
        inp, conv = self._inputs(x, injection, state.get("conv"), None, attention_mask)
        ssm, y_prev = state.get("ssm"), state.get("y")
        args = self.fp_config.layer_solver.solve_args(self.training)
        if x.shape[1] > 1 and (cache.prefill or self.fp_config.prefill) == "parallel":
            return self._parallel_prefill(inp, conv, ssm, y_prev, args, cache, attention_mask)
        outs = []
        for i in range(x.shape[1]):
            tok = inp.token(i)
            last = {}
            mask = attention_mask[:, i:i + 1] if attention_mask is not None else None

            def f(y, tok=tok, y_prev=y_prev, ssm=ssm, last=last, mask=mask):
                y_new, last["ssm"] = self.layer_map(tok, y, y_first=y_prev, state=ssm, token=True,
                                                    attention_mask=mask)
                return y_new

            y_star, st = solve(f, tok.x.new_zeros(tok.x.shape), **args)
            self._record(st)
            y = self._phantom(f, y_star)  # the committing step(s)
            outs.append(self._output(y, tok, y_first=y_prev))
            ssm, y_prev = last["ssm"], y[:, 0]
        cache.update(self.layer_idx, ssm=ssm, y=y_prev, **({"conv": conv} if conv is not None else {}))
        return torch.cat(outs, dim=1)


    def _parallel_prefill(self, inp, conv, ssm, y_prev, args, cache, attention_mask=None):
        """`prefill="parallel"`: all prompt tokens iterate together from the cached state (as the parallel
        mode), then the committing step(s) return the final state. Agrees with the per-token prefill to
        about the tolerance, not exactly (different iterates reach the fixed point)."""
        last = {}

        def f(y):
            y_new, last["ssm"] = self.layer_map(inp, y, y_first=y_prev, state=ssm, return_state=True,
                                                attention_mask=attention_mask)
            return y_new

        y_star, st = solve(f, inp.x.new_zeros(inp.x.shape), **args)
        self._record(st)
        y = self._phantom(f, y_star)
        cache.update(self.layer_idx, ssm=last["ssm"], y=y[:, -1], **({"conv": conv} if conv is not None else {}))
        return self._output(y, inp, y_first=y_prev)


class LMFPMambaModel(LMModel):
    config_class = LMFPMambaConfig
    mixer_class = FPMambaMixer


class LMFPMambaForCausalLM(LMForCausalLM):
    config_class = LMFPMambaConfig
    mixer_class = FPMambaMixer
    model_class = LMFPMambaModel
    # each layer's per-token solve stops at its tolerance (a host decision per iteration): no graph capture
    decode_mode = "eager"
