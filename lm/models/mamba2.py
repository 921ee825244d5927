"""Mamba2: in_proj -> depthwise causal conv1d -> SSD -> gated RMSNorm -> out_proj, explicit or implicit.

Parameterisation and parameter names follow mamba_ssm's `Mamba2` (in_proj, conv1d, dt_bias, A_log, D,
norm, out_proj; d_state, headdim, ngroups, expand, chunk_size, softplus dt with limits). In the
implicit model the injection is added to in_proj's output, so x, B, C and dt all depend on the iterate
(paper 003, App. D.3). in_proj runs as one product; conv, SSD and gated norm as one Triton operator
(`lm_kernels.mamba2`) on CUDA, as the three ops `lm_kernels.conv1d`, `lm_kernels.ssd` and the gated RMSNorm
elsewhere (PyTorch on CPU).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm_kernels.mamba2 import fits as mamba2_inner_fits
from lm_kernels.mamba2 import mamba2_inner
from lm_kernels.context_parallel import causal_conv1d_cp, ssd_scan_xbc_cp
from lm_kernels.ssd import ssd_scan_xbc, ssd_step

from .config import LMConfig
from .layers import GatedRMSNorm, causal_conv1d, dt_init
from .modeling import LMForCausalLM, LMModel, Mixer, init, mask_pads


class LMMamba2Config(LMConfig):
    model_type = "lm_mamba2"
    _fields = {
        "d_state": 128,
        "d_conv": 4,
        "expand": 2,
        "headdim": 64,
        "ngroups": 1,
        # the SSD's chunk: the same function of the inputs at any size (rounding aside); 128 trains Mamba2-350M
        # 3-4% faster than mamba_ssm's 256 with our kernels (H200; docs/performance.md)
        "chunk_size": 128,
        "dt_min": 0.001,
        "dt_max": 0.1,
        "dt_limit": [0.0, None],  # None = +inf
        "A_init_range": [1.0, 16.0],
        "conv_bias": True,
    }

    def validate(self):
        super().validate()
        for f in ("d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size"):
            v = getattr(self, f)
            self._check(isinstance(v, int) and not isinstance(v, bool) and v > 0, f, "must be a positive integer")
        self._check(self.d_inner % self.headdim == 0, "headdim",
                    f"must divide d_inner = expand * hidden_size = {self.d_inner}")
        self._check(self.nheads % self.ngroups == 0, "ngroups", f"must divide the number of heads {self.nheads}")
        self._check(0 < self.dt_min <= self.dt_max, "dt_min", "need 0 < dt_min <= dt_max")
        lo, hi = self.dt_limit
        self._check(lo >= 0 and (hi is None or hi > lo), "dt_limit", "need 0 <= low < high (high None = inf)")
        self._check(0 < self.A_init_range[0] <= self.A_init_range[1], "A_init_range", "need 0 < low <= high")

    @property
    def d_inner(self) -> int:
        return self.expand * self.hidden_size

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim


class Mamba2Mixer(Mixer):
    reads_input_once = True  # x only through in_proj (Mixer.reads_input_once)
    capturable = True  # (Mixer.capturable)

    def __init__(self, config: LMMamba2Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.d_inner, self.nheads, self.headdim = config.d_inner, config.nheads, config.headdim
        self.d_state, self.ngroups, self.chunk_size = config.d_state, config.ngroups, config.chunk_size
        self.conv_dim = self.d_inner + 2 * self.ngroups * self.d_state
        # in_proj's output columns (and the injection's): z | xBC | dt
        self._cols = {"z": (0, self.d_inner), "xbc": (self.d_inner, self.d_inner + self.conv_dim),
                      "dt": (self.d_inner + self.conv_dim, self.d_inner + self.conv_dim + self.nheads)}
        lo, hi = config.dt_limit
        self.dt_limit = (float(lo), float("inf") if hi is None else float(hi))
        self.in_proj = nn.Linear(config.hidden_size, self.injection_dim(config), bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, config.d_conv, groups=self.conv_dim,
                                padding=config.d_conv - 1, bias=config.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(self.nheads))
        self.A_log = nn.Parameter(torch.zeros(self.nheads))
        self.D = nn.Parameter(torch.ones(self.nheads))
        self.norm = GatedRMSNorm(self.d_inner, self.d_inner // self.ngroups, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.d_inner, config.hidden_size, bias=False)
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
        self.init_weights(config)

    @staticmethod
    def injection_dim(config) -> int:
        return 2 * config.d_inner + 2 * config.ngroups * config.d_state + config.nheads

    def init_weights(self, config) -> None:
        lo, hi = config.A_init_range
        init.copy_(self.dt_bias, dt_init(self.nheads, config.dt_min, config.dt_max))
        init.copy_(self.A_log, torch.log(torch.empty(self.nheads).uniform_(lo, hi)))
        init.ones_(self.D)

    def flops_per_token(self, seq_len: int) -> float:
        # chunked SSD: intra-chunk C B^T and (.)x (length chunk/2 on average), state in/out products
        c = min(self.chunk_size, seq_len)
        h, p, n = self.nheads, self.headdim, self.d_state
        return 2 * h * (c / 2) * (n + p) + 2 * 2 * h * p * n

    def shared_inputs(self, t: int, cu_seqlens, device, positions=None, max_seqlen=None,
                      cu_seqlens_cpu=None, key_mask=None) -> dict:
        """With packed documents, the longest one's length (a host int), which tells the conv-SSD ops that the model
        has checked the offsets (LMModel.forward): no layer reads them back to check them again (nor, on the
        reference SSD, to measure the documents)."""
        if cu_seqlens is None or max_seqlen is None:
            return {}
        return {"max_seqlen": max_seqlen}

    def _mask_pads(self, zxbcdt, injection, attention_mask):
        """in_proj's output (with the injection added) with the pads' rows made identity steps of the conv and the
        scan (Mixer): xBC 0 (the conv's input: before a row's first real token the zero history of a fresh start) and
        dt -inf (softplus(-inf + dt_bias) = 0: exp(dt A) = 1, dt B x = 0); z 0 (a pad's output is not used). Applied
        to the operators' input, so the fused operator (CUDA) and the three ops (CPU) see the same."""
        if self.dt_limit[0] > 0:
            raise ValueError(f"attention_mask with pads needs dt_limit's low end 0 (a pad is a step with dt = 0), "
                             f"got dt_limit={self.dt_limit}: run the prompts one by one or without padding")
        if injection is not None:
            zxbcdt = zxbcdt + injection
        return mask_pads(zxbcdt, attention_mask, [(self.d_inner + self.conv_dim, 0.0), (self.nheads, float("-inf"))])

    def forward(self, x, *, injection=None, cache=None, cu_seqlens=None, max_seqlen=None, attention_mask=None,
                context=None):
        """`context` (lm.models.context_parallel.ContextShard): x is this rank's slice of the sequences; the conv and
        the scan pass what crosses the slice borders (the three ops, not the fused one)."""
        b, t, _ = x.shape
        state = cache.get(self.layer_idx) if cache is not None else {}
        if cache is not None and t == 1 and "ssm" in state:
            return self._step(x, injection, cache, state, attention_mask)
        # in_proj as one product: the inner path's backward writes the gradients of z, xBC and dt into one tensor
        # (lm_kernels.mamba2), so its input gradient and weight gradient are one GEMM each
        # the injection (in_proj's width) is not added to the projection: the conv adds its xBC columns on load, the
        # gated norm (folded: the scan's gate) its z columns, the scan its dt columns; its gradient is then the
        # projection's, whole
        zxbcdt = self.in_proj(x)
        if attention_mask is not None:
            zxbcdt, injection = self._mask_pads(zxbcdt, injection, attention_mask), None
        A = -torch.exp(self.A_log.to(torch.promote_types(self.A_log.dtype, torch.float32)))  # (float64 stays)
        conv_w = self.conv1d.weight.squeeze(1)  # a view, whose backward is a view (a select's is a kernel)
        if context is None and mamba2_inner_fits(zxbcdt, conv_w.shape[-1]):
            # compiled, one norm group: the norm folded into out_proj (lm_kernels.mamba2's fold_norm): the scan gates
            # its output and sums its squares, out_proj takes the norm weight into its own, and the row scale rstd
            # fuses into the residual add after the block (eager, it would be a pass of its own)
            fold = torch.compiler.is_compiling() and self.norm.group_size == self.d_inner
            out = mamba2_inner(
                zxbcdt, conv_w, self.conv1d.bias, A, d_inner=self.d_inner, headdim=self.headdim,
                ngroups=self.ngroups, dstate=self.d_state, chunk_size=self.chunk_size, D=self.D, dt_bias=self.dt_bias,
                dt_limit=self.dt_limit, norm_weight=None if fold else self.norm.weight,
                norm_group=self.norm.group_size, eps=self.norm.eps, add=injection, conv_state=state.get("conv"),
                initial_state=state.get("ssm"), cu_seqlens=cu_seqlens, return_final_state=cache is not None,
                max_seqlen=max_seqlen, fold_norm=fold)
            y, conv_state, ssm = out[:3]
            rstd = out[3] if fold else None
        else:  # the same three ops one by one (the reference backends, CPU)
            z, xbc, dt = (zxbcdt[..., lo:hi] for lo, hi in self._cols.values())
            z_add = x_add = dt_add = None
            if injection is not None:
                z_add, x_add, dt_add = (injection[..., lo:hi] for lo, hi in self._cols.values())
            if dt_add is not None:
                dt = dt + dt_add
            scan = dict(headdim=self.headdim, ngroups=self.ngroups, dstate=self.d_state, chunk_size=self.chunk_size,
                        D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit, cu_seqlens=cu_seqlens,
                        max_seqlen=max_seqlen)
            if context is not None:
                xbc = causal_conv1d_cp(xbc, conv_w, self.conv1d.bias, context.slice, cu_seqlens=cu_seqlens,
                                       x_add=x_add, activation="silu")
                y, ssm = ssd_scan_xbc_cp(xbc, dt, A, context.slice, **scan)
                conv_state = None
            else:
                xbc, conv_state = causal_conv1d(xbc, conv_w, self.conv1d.bias, cu_seqlens=cu_seqlens, x_add=x_add,
                                                conv_state=state.get("conv"), activation="silu")
                # x, B, C stay one tensor: the scan's backward writes their gradient as one
                y, ssm = ssd_scan_xbc(xbc, dt, A, initial_state=state.get("ssm"), return_final_state=cache is not None,
                                      **scan)
            y = self.norm(y.reshape(b, t, self.d_inner), z, z_add=z_add)
            rstd = None
        if cache is not None:
            cache.update(self.layer_idx, conv=conv_state, ssm=ssm)
        if rstd is not None:
            # folded: out_proj with the norm weight in its own; the rows' scale is handed to the block, whose residual
            # add applies it in the same pass ((pre * rstd).to(pre.dtype) + x: Block.forward, add_rms_norm)
            return F.linear(y, self.out_proj.weight * self.norm.weight), rstd
        return self.out_proj(y)

    def _step(self, x, injection, cache, state, attention_mask=None):
        """One decode token: in_proj as one product split into views (the step is launch bound). `attention_mask`: an
        implicit model's sequential prefill of a left-padded prompt, token by token."""
        b, t, _ = x.shape
        zxbcdt = self.in_proj(x) if injection is None else self.in_proj(x) + injection
        if attention_mask is not None:
            zxbcdt = self._mask_pads(zxbcdt, None, attention_mask)
        z, xbc, dt = (zxbcdt[..., lo:hi] for lo, hi in self._cols.values())
        xbc, conv_state = causal_conv1d(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                        conv_state=state.get("conv"), activation="silu")
        gn = self.ngroups * self.d_state
        xs, B, C = xbc.split([self.d_inner, gn, gn], dim=-1)
        xs = xs.reshape(b, t, self.nheads, self.headdim)
        B = B.reshape(b, t, self.ngroups, self.d_state)
        C = C.reshape(b, t, self.ngroups, self.d_state)
        # a static cache's SSM buffer is updated in place by the step (no copy after it)
        out = cache.buffer(self.layer_idx, "ssm")
        # A = -exp(A_log) inside the step (a_log): no kernels of its own per decode token
        y, ssm = ssd_step(state["ssm"], xs[:, 0], dt[:, 0], self.A_log, B[:, 0], C[:, 0], D=self.D,
                          dt_bias=self.dt_bias, dt_softplus=True, dt_limit=self.dt_limit, out_state=out, a_log=True)
        new = {"conv": conv_state}
        if out is None:
            new["ssm"] = ssm
        cache.update(self.layer_idx, **new)
        y = self.norm(y.unsqueeze(1).reshape(b, t, self.d_inner), z)
        return self.out_proj(y)


class LMMamba2Model(LMModel):
    config_class = LMMamba2Config
    mixer_class = Mamba2Mixer


class LMMamba2ForCausalLM(LMForCausalLM):
    config_class = LMMamba2Config
    mixer_class = Mamba2Mixer
    model_class = LMMamba2Model

