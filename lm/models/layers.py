"""Shared building blocks: RMSNorm (plain and gated), SwiGLU MLP, causal depthwise conv, rotary embedding.

Everything here works on packed sequences (`cu_seqlens`) and with a generation cache (conv state). The math
lives in functions; the modules only hold parameters. PyTorch, except the conv (a Triton kernel on CUDA), the
RMSNorms (Triton custom operators on CUDA, forward and one-pass backward; the plain norm's forward kernel alone
without autograd), and SwiGLU's silu(g) * u without autograd on CUDA (one Triton kernel, for the launch-bound decode
step).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# the depthwise causal conv of Mamba2 / FP-Mamba / DeltaProduct: the Triton kernel on CUDA, the PyTorch reference on
# CPU (LM_CONV1D_BACKEND=reference|triton overrides); the models import it from here
from lm_kernels.backend import resolve_backend
from lm_kernels.conv1d import causal_conv1d  # noqa: F401
from lm_kernels.rmsnorm import gated_rms_norm_triton, rms_norm_autograd_triton, rms_norm_triton
from lm_kernels.swiglu import silu_mul_triton
from lm_kernels.varlen import position_in_document  # noqa: F401  (the models import it from here)


def _rms_norm_math(x, z, weight, group: int, eps: float):
    """(y in x's dtype, rstd per group in float32 or wider): the (gated, grouped) RMSNorm's forward formula."""
    acc = torch.promote_types(x.dtype, torch.float32)
    with torch.autocast(x.device.type, enabled=False):
        u = x.to(acc)
        if z is not None:
            u = u * F.silu(z.to(acc))
        shape = u.shape
        ug = u.reshape(*shape[:-1], shape[-1] // group, group)
        rstd = torch.rsqrt(ug.pow(2).mean(-1, keepdim=True) + eps)
        y = (ug * rstd).reshape(shape)
        if weight is not None:
            y = y * weight.to(acc)
    return y.to(x.dtype), rstd


class _RMSNormFn(torch.autograd.Function):
    """(Gated, grouped) RMSNorm that saves only its inputs and the per-group rstd for backward.

    Forward: u = x * silu(z) (or x), per group of `group` channels u * rsqrt(mean(u^2) + eps), times
    weight; math in at least float32, output in x's dtype. Autograd through the plain formula would keep
    three float32 copies of the activation; this keeps x and z in their own dtype (bf16 in training).
    """

    @staticmethod
    def forward(ctx, x, z, weight, group: int, eps: float):
        y, rstd = _rms_norm_math(x, z, weight, group, eps)
        ctx.save_for_backward(x, z, weight, rstd)
        ctx.group = group
        return y

    @staticmethod
    def backward(ctx, dy):
        x, z, weight, rstd = ctx.saved_tensors
        group = ctx.group
        acc = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            xa = x.to(acc)
            if z is not None:
                za = z.to(acc)
                sig = torch.sigmoid(za)
                gate = za * sig
                u = xa * gate
            else:
                u = xa
            shape = u.shape
            xhat = (u.reshape(*shape[:-1], shape[-1] // group, group) * rstd).reshape(shape)
            g = dy.to(acc)
            dw = None
            if weight is not None:
                if ctx.needs_input_grad[2]:
                    dw = (g * xhat).reshape(-1, shape[-1]).sum(0).to(weight.dtype)
                g = g * weight.to(acc)
            gg = g.reshape(*shape[:-1], shape[-1] // group, group)
            xg = xhat.reshape_as(gg)
            du = (rstd * (gg - xg * (gg * xg).mean(-1, keepdim=True))).reshape(shape)
            dx = dz = None
            if z is not None:
                dx = du * gate
                if ctx.needs_input_grad[1]:
                    dz = (du * xa * sig * (1 + za * (1 - sig))).to(z.dtype)
            else:
                dx = du
        return dx.to(x.dtype), dz, dw, None, None


def _kernel_forward(op: str, *tensors) -> bool:
    """Whether `op` ("rmsnorm", "swiglu") runs its one-kernel Triton forward (lm_kernels.rmsnorm / .swiglu): when no
    input needs a gradient (generation, eval), not under torch.compile (which fuses the formula itself), no float64,
    and the op's backend is "triton" (automatic on CUDA; LM_<OP>_BACKEND=reference|triton overrides)."""
    ts = [t for t in tensors if t is not None]
    if torch.compiler.is_compiling() or ts[0].dtype == torch.float64:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return resolve_backend(op, None, ts[0].device) == "triton"


def _norm_ops(x: torch.Tensor, *tensors) -> bool:
    """Whether a plain norm runs the custom operators lm::rms_norm_fwd / _bwd (lm_kernels.rmsnorm): on the "rmsnorm"
    backend triton (automatic on CUDA), not float64, under torch.compile or where an input needs a gradient. Traced
    instead, inductor's backward of the formula cost several times the bytes it moves (Llama-350M: ~24 ms of a
    190 ms step on an H100 for its 48 norms, where the one-pass backward's bytes take ~4 ms)."""
    if x.dtype == torch.float64 or resolve_backend("rmsnorm", None, x.device) != "triton":
        return False
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, z: torch.Tensor | None = None,
             group_size: int | None = None, z_add: torch.Tensor | None = None, out_dtype=None) -> torch.Tensor:
    """y = u / rms(u) * weight with u = x * silu(z + z_add) (z_add optional, of z's shape and dtype; or u = x without
    z), per group of `group_size` channels (default: all); computed in at least float32 and returned in out_dtype
    (default x's dtype).

    Gated (z given) with the "rmsnorm" backend triton (automatic on CUDA; not float64): the custom operators
    lm::gated_rms_norm_fwd / _bwd, eager and under torch.compile, with or without autograd (one forward kernel,
    one-pass backward; z + z_add is formed inside the kernels). Plain on that backend: the custom operators
    lm::rms_norm_fwd / _bwd under torch.compile or with autograd (`_norm_ops`), the forward kernel alone otherwise
    (generation, eval). Elsewhere (CPU, float64) z_add is added to z here, then: under torch.compile the formula,
    traced; else the formula with its own backward (_RMSNormFn: saves only x, z and rstd)."""
    group = group_size or x.shape[-1]
    if z_add is not None and (z is None or z_add.shape != z.shape or z_add.dtype != z.dtype):
        raise ValueError(f"rms_norm: z_add must come with z and have its shape and dtype, got {tuple(z_add.shape)} "
                         f"{z_add.dtype}")
    if z is not None and x.dtype != torch.float64 and resolve_backend("rmsnorm", None, x.device) == "triton":
        y = gated_rms_norm_triton(x, z, weight, eps, group_size=group, z_add=z_add)
        return y if out_dtype is None else y.to(out_dtype)
    if z is None and group == x.shape[-1]:
        if _norm_ops(x, weight):
            return rms_norm_autograd_triton(x, weight, eps, out_dtype=out_dtype)
        if _kernel_forward("rmsnorm", x, weight):
            return rms_norm_triton(x, weight, eps, out_dtype=out_dtype)
    if z_add is not None:
        z = z + z_add
    if torch.compiler.is_compiling():
        # the formula itself: inductor fuses it and AOTAutograd derives its backward. The autograd Function traced
        # by dynamo lost its gradient on the GPU image (torch 2.11, CUDA: zero gradients for x, z and the weight
        # of a compiled norm, tests/test_models_compile_gpu.py)
        y = _rms_norm_math(x, z, weight, group, eps)[0]
    elif z is None and _kernel_forward("rmsnorm", x, weight):
        y = rms_norm_triton(x, weight, eps, group_size=group_size)
    else:
        y = _RMSNormFn.apply(x, z, weight, group, eps)
    return y if out_dtype is None else y.to(out_dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, out_dtype=None) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, out_dtype=out_dtype)

    def add_forward(self, x: torch.Tensor, h: torch.Tensor, h_scale: torch.Tensor | None = None, out_dtype=None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, self(x + h)): see `add_rms_norm`."""
        return add_rms_norm(x, h, self.weight, self.eps, h_scale=h_scale, out_dtype=out_dtype)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, h_scale: torch.Tensor | None = None,
                 out_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms_norm(s) in out_dtype (default s's dtype)) with s = x + h, or s = x + (h * h_scale).to(h.dtype) with a
    per-row scale h_scale (..., 1) (a block output whose rows' scale was left for here: Mamba2's folded norm): a
    residual add and the norm that reads its sum in one pass, rounded as the separate ops round them, where
    `rms_norm` runs Triton (the custom operators with autograd or under torch.compile, the forward kernel otherwise);
    else the ops one by one (inductor fuses them under torch.compile)."""
    if h.shape == x.shape and h.dtype != torch.float64:
        if _norm_ops(x, h, weight, h_scale):
            y, s = rms_norm_autograd_triton(x, weight, eps, residual=h, residual_scale=h_scale, out_dtype=out_dtype)
            return s, y
        if _kernel_forward("rmsnorm", x, h, weight):
            y, s = rms_norm_triton(x, weight, eps, residual=h, residual_scale=h_scale, out_dtype=out_dtype)
            return s, y
    x = x + (h if h_scale is None else (h * h_scale).to(h.dtype))
    return x, rms_norm(x, weight, eps, out_dtype=out_dtype)


class GatedRMSNorm(nn.Module):
    """Mamba2's gated norm: RMSNorm(y * silu(z)) per group of `group_size` channels (norm_before_gate=False)."""

    def __init__(self, dim: int, group_size: int | None = None, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.group_size = group_size or dim
        if dim % self.group_size:
            raise ValueError(f"GatedRMSNorm: dim {dim} is not a multiple of group_size {self.group_size}")
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor | None = None, z_add: torch.Tensor | None = None
                ) -> torch.Tensor:
        """The norm of y * silu(z + z_add); z_add (the implicit models' injection part of z) optional."""
        return rms_norm(y, self.weight, self.eps, z=z, group_size=self.group_size, z_add=z_add)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u: one Triton kernel (lm_kernels.swiglu) where `_kernel_forward` allows it and g, u share a dtype;
    else the PyTorch formula (two kernels)."""
    if g.dtype == u.dtype and _kernel_forward("swiglu", g, u):
        return silu_mul_triton(g, u)
    return F.silu(g) * u


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            # gate and up as one product: x's gradient is then one GEMM's, in the autocast dtype without a sum of two
            # (so the norm before the MLP hands x on in that dtype: Block.forward); under autocast the weights' concat
            # and cast are one pass (compiled), as their two casts were
            w = torch.cat((self.gate_proj.weight, self.up_proj.weight))
            g, u = F.linear(x, w).chunk(2, dim=-1)
        else:  # no weight copy per call (generation's launch-bound steps)
            g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(silu_mul(g, u))


def rotary_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (..., dim) for the given integer positions (half-rotation layout, as Llama)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, h, t, d); cos/sin broadcastable to (b, 1, t, d)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


def dt_init(nheads: int, dt_min: float, dt_max: float, floor: float = 1e-4) -> torch.Tensor:
    """dt_bias initial values: dt log-uniform in [dt_min, dt_max] (floored), stored as inverse softplus."""
    dt = torch.exp(torch.rand(nheads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return inverse_softplus(dt.clamp(min=floor))
