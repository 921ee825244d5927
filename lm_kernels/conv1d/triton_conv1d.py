"""Triton depthwise causal conv1d: launches (forward 1 kernel; backward 1 kernel, dx with the dweight/dbias
partials and the conv state's gradient, plus the sums of the partials) and the custom operators
lm::causal_conv1d_fwd / lm::causal_conv1d_bwd with their autograd formula (one node each in a torch.compile graph).

The backward is one pass (triton_kernels.py): each program walks its rows one at a time, so g = dy * act'(z) and
the row shifts of dx stay in registers instead of going to DRAM in float32 between two kernels (whose round trip
made the two-pass backward ~3.4x the bytes that must move on an H100: 0.51 vs ~0.15 ms at B16 T2048 C2304 W4 bf16).
An optional second input x_add makes the conv run on x + x_add (added on load, in x's dtype as PyTorch adds)
without the sum being materialised: the implicit models add an injection to the conv input at every
fixed-point iteration. Its gradient is x's.

When no gradient is needed (torch.is_grad_enabled() False or no input requires grad) the forward runs
outside autograd and saves nothing (the fixed-point iterations call it many times). With grad, only the
inputs are saved: the backward recomputes the pre-activation. Accumulation is float32 (float64 for
float64 inputs); y, dx and the new conv state come out in x's dtype, dweight / dbias / dconv_state in
the dtype of their input. Tile sizes are autotuned on the GPU (key: channels, width, flags, dtypes)
among configs that compile without spills on sm_90 for W = 4 (cuobjdump, forward: 72-150 registers);
under TRITON_INTERPRET=1 one small config (8 x 16 tiles; 32 channels and 16-row chunks in the backward) so that
CPU tests at tiny shapes cross tile, channel-block and chunk borders. LM_CONV1D_AUTOTUNE=0: the first config only;
both settings are read per call.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..autotune import autotune, launch, tuning
from ..backend import CUSTOM_OP_TAGS, absent, cdiv, interpreted, next_pow2, num_sms
from . import triton_kernels as K
from .reference import check_x_add

MAX_WIDTH = 8

_KEY = ["C", "W", "HAS_STATE", "HAS_BIAS", "HAS_ADD", "VARLEN", "SILU"]
# (BT, BC, warps) of the forward, the first: the one launched without autotuning
_FWD_TRIPLES = [(16, 128, 4), (32, 128, 4), (64, 128, 8), (16, 256, 4), (32, 64, 2)]
# the backward walks its rows one at a time with the channels across the threads, BC channels per program (4 per
# thread: 8-byte bf16 loads; 134 registers on sm_90). The tuner took (128, 1 warp) at Mamba2-350M's shape, fixed and
# packed (H100, docs/performance.md); (256, 2 warps) is the other candidate
_BWD_PAIRS = [(128, 1), (256, 2)]


@functools.lru_cache(maxsize=None)
def _build(interpret: bool, tune: bool, cache: bool):
    """(forward, backward) autotuners for these settings (lm_kernels.autotune.tuning): their lists when `tune`, else
    the first config; in the interpreter one small config each (see the module docstring)."""
    fwd = [(8, 16, 1)] if interpret else _FWD_TRIPLES if tune else _FWD_TRIPLES[:1]
    bwd = [(32, 1)] if interpret else _BWD_PAIRS if tune else _BWD_PAIRS[:1]
    return (autotune(configs=[triton.Config(dict(BT=bt, BC=bc), num_warps=w, num_stages=2) for bt, bc, w in fwd],
                     key=_KEY, cache=cache)(K.conv_fwd_kernel),
            autotune(configs=[triton.Config(dict(BC=bc), num_warps=w, num_stages=1) for bc, w in bwd],
                     key=_KEY + ["CHUNK", "STATE_GRAD"], cache=cache)(K.conv_bwd_kernel))


def _tuners():
    """The (forward, backward) autotuners for the settings read now: TRITON_INTERPRET, LM_CONV1D_AUTOTUNE,
    LM_TRITON_AUTOTUNE_CACHE."""
    return _build(*tuning("conv1d"))


_ACC = {torch.float64: tl.float64}


def _log_n(cu_seqlens):
    """(number of documents, binary-search steps) for cu_seqlens (or (1, 0) without)."""
    if cu_seqlens is None:
        return 1, 0
    n = cu_seqlens.numel() - 1
    return n, max(0, math.ceil(math.log2(n))) if n > 0 else 0


def _bwd_chunk(t: int, b: int, c: int, device) -> int:
    """Rows per backward program: ~8 programs per SM or more with 256-channel blocks (16 or more with the tuned
    128-channel ones), few enough that the dweight partials (one (C, W+1) row per program) stay small."""
    if interpreted():
        return 16
    sms = num_sms(device)
    per_chunk = b * cdiv(c, 256)
    want = max(1, cdiv(8 * sms, per_chunk))
    return min(1024, max(64, next_pow2(cdiv(t, want))))


def _vectors(bias, cu_seqlens):
    """bias (c,) and cu_seqlens as the kernels index them, contiguous (a copy only of a strided view)."""
    return tuple(v.contiguous() if v is not None else None for v in (bias, cu_seqlens))


def _state_strides(conv_state):
    return (0, 0, 0) if conv_state is None else conv_state.stride()


def _add_strides(x_add):
    return (0, 0) if x_add is None else (x_add.stride(0), x_add.stride(1))


def conv1d_fwd(x, weight, bias, conv_state, cu_seqlens, silu: bool, x_add=None):
    """y (b, t, c) contiguous in x's dtype and the new conv state (b, c, w-1) in x's dtype, of the input
    x (+ x_add). x, x_add, the weight, the conv state and y are indexed through their strides (channels
    contiguous for x, x_add and y)."""
    b, t, c = x.shape
    w = weight.shape[-1]
    bias, cu_seqlens = _vectors(bias, cu_seqlens)
    y = torch.empty(b, t, c, device=x.device, dtype=x.dtype)
    new_state = torch.empty(b, c, w - 1, device=x.device, dtype=x.dtype)
    n_seq, log_n = _log_n(cu_seqlens)
    dummy = x
    grid = lambda meta: (cdiv(t, meta["BT"]), cdiv(c, meta["BC"]), b)  # noqa: E731
    flags = dict(W=w, BS=next_pow2(max(w - 1, 1)), HAS_STATE=conv_state is not None, HAS_BIAS=bias is not None,
                 HAS_ADD=x_add is not None, VARLEN=cu_seqlens is not None, SILU=silu, WRITE_STATE=w > 1,
                 ACC=_ACC.get(x.dtype, tl.float32))
    launch(_tuners()[0], ("fwd", c, x.dtype, weight.dtype, *flags.values()), grid, (
        x, x_add if x_add is not None else dummy, conv_state if conv_state is not None else dummy, weight,
        bias if bias is not None else dummy, cu_seqlens if cu_seqlens is not None else dummy, y, new_state,
        t, c, n_seq, log_n,
        x.stride(0), x.stride(1), *_add_strides(x_add), *_state_strides(conv_state), *weight.stride(),
        y.stride(0), y.stride(1), *new_state.stride()), flags)
    return y, new_state


def conv1d_bwd(dy, x, weight, bias, conv_state, cu_seqlens, silu: bool, state_grad: bool, x_add=None, dx_out=None):
    """(dx (b, t, c) in x's dtype, dweight (c, w), dbias (c,) or None, dconv_state (b, c, w-1) or None); dx is
    also the gradient of x_add (the input is x + x_add). dx_out: dx is written there (x's shape and dtype, channels
    contiguous, any batch / time strides: a column block of a larger gradient), else into a new tensor."""
    b, t, c = x.shape
    w = weight.shape[-1]
    bias, cu_seqlens = _vectors(bias, cu_seqlens)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    dx = torch.empty(b, t, c, device=x.device, dtype=x.dtype) if dx_out is None else dx_out
    dstate = torch.empty(b, c, w - 1, device=x.device, dtype=conv_state.dtype) if state_grad else None
    chunk = _bwd_chunk(t, b, c, x.device)
    n_chunks = cdiv(t, chunk)
    acc = _ACC.get(x.dtype, tl.float32)
    fdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    part = torch.empty(b * n_chunks, c, w + (bias is not None), device=x.device, dtype=fdt)
    n_seq, log_n = _log_n(cu_seqlens)
    dummy = x
    grid = lambda meta: (n_chunks, cdiv(c, meta["BC"]), b)  # noqa: E731
    flags = dict(W=w, HAS_STATE=conv_state is not None, HAS_BIAS=bias is not None, HAS_ADD=x_add is not None,
                 VARLEN=cu_seqlens is not None, SILU=silu, STATE_GRAD=state_grad, ACC=acc)
    launch(_tuners()[1], ("bwd", c, chunk, x.dtype, dy.dtype, weight.dtype, *flags.values()), grid, (
        x, x_add if x_add is not None else dummy, conv_state if conv_state is not None else dummy, weight,
        bias if bias is not None else dummy, cu_seqlens if cu_seqlens is not None else dummy, dy, dx,
        dstate if dstate is not None else dummy, part,
        t, c, n_seq, log_n, chunk,
        x.stride(0), x.stride(1), *_add_strides(x_add), *_state_strides(conv_state), *weight.stride(),
        dy.stride(0), dy.stride(1), dx.stride(0), dx.stride(1),
        *(dstate.stride() if dstate is not None else (0, 0, 0)),
        part.stride(0), part.stride(1), part.stride(2)), flags)
    # part (rows, c, w [+ 1]): weight columns 0..w-1, then the bias; summed by one launch into two tensors of their
    # own (not strided views of one sum: an op's outputs may not alias), in the partials' dtype (the parameters'
    # dtype in training; others are rounded by torch, to nearest)
    dweight = torch.empty(c, w, device=x.device, dtype=fdt)
    dbias = torch.empty(c, device=x.device, dtype=fdt) if bias is not None else None
    ncol = c * part.shape[2]
    K.conv_wsum_kernel[(cdiv(ncol, 128),)](part, dweight, dbias if dbias is not None else dweight,
                                            part.shape[0], ncol, part.stride(0), dweight.stride(0),
                                            dweight.stride(1), W=w, HAS_BIAS=bias is not None, BR=16, BJ=128,
                                            num_warps=4)
    dweight = dweight.to(weight.dtype)
    dbias = dbias.to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias, dstate


def _add_new_state_grad(dns, dx, dstate, t, w):
    """new_state[:, :, k] is the input at position t-(w-1)+k: route its gradient to dx / dconv_state."""
    n_x = min(w - 1, t)
    if n_x > 0:
        dx[:, t - n_x:, :] += dns[:, :, w - 1 - n_x:].transpose(1, 2).to(dx.dtype)
    if dstate is not None and t < w - 1:
        dstate[:, :, t:] += dns[:, :, : w - 1 - t].to(dstate.dtype)


# --- the custom operators -------------------------------------------------------------------------------------------
# lm::causal_conv1d_fwd / lm::causal_conv1d_bwd are the one way the Triton conv is called, eager and under
# torch.compile (one node each in the graph, so a compiled block is not split at the conv). x (and x_add) is read
# through its strides (channels contiguous): the exact-stride tag makes inductor pass it with the strides it had when
# traced (a split view of a projection stays a view); a layout the kernels cannot read is copied inside (never, as
# called). x_add comes last, with a default, so that calls without it keep their argument positions.
def _channels_contiguous(v):
    return v if v is None or v.stride(-1) == 1 else v.contiguous()


@torch.library.custom_op("lm::causal_conv1d_fwd", mutates_args=(), tags=CUSTOM_OP_TAGS)
def causal_conv1d_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      conv_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                      silu: bool, x_add: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y (b, t, c) contiguous, new conv state (b, c, w-1)), both in x's dtype, of the input x (+ x_add)
    (conv1d_fwd)."""
    return conv1d_fwd(_channels_contiguous(x), weight, bias, conv_state, cu_seqlens, silu,
                      _channels_contiguous(x_add))


@causal_conv1d_fwd.register_fake
def _(x, weight, bias, conv_state, cu_seqlens, silu, x_add=None):
    b, t, c = x.shape
    return x.new_empty(b, t, c), x.new_empty(b, c, weight.shape[-1] - 1)


@torch.library.custom_op("lm::causal_conv1d_bwd", mutates_args=(), tags=CUSTOM_OP_TAGS)
def causal_conv1d_bwd(dy: Optional[torch.Tensor], dnew_state: Optional[torch.Tensor], x: torch.Tensor,
                      weight: torch.Tensor, bias: Optional[torch.Tensor], conv_state: Optional[torch.Tensor],
                      cu_seqlens: Optional[torch.Tensor], silu: bool, state_grad: bool,
                      x_add: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias (empty without bias), dconv_state (empty unless state_grad)); dy / dnew_state None: no
    gradient reaches y / the new state. With x_add the input was x + x_add (recomputed from both) and dx is the
    gradient of either."""
    x = _channels_contiguous(x)
    b, t, c = x.shape
    w = weight.shape[-1]
    if dy is None:
        dy = torch.zeros(b, t, c, device=x.device, dtype=x.dtype)
    dx, dweight, dbias, dstate = conv1d_bwd(dy, x, weight, bias, conv_state, cu_seqlens, silu, state_grad,
                                            _channels_contiguous(x_add))
    if dnew_state is not None and w > 1:
        _add_new_state_grad(dnew_state, dx, dstate, t, w)
    return dx, dweight, dbias if dbias is not None else absent(x), dstate if dstate is not None else absent(x)


@causal_conv1d_bwd.register_fake
def _(dy, dnew_state, x, weight, bias, conv_state, cu_seqlens, silu, state_grad, x_add=None):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else absent(x),
            conv_state.new_empty(conv_state.shape) if state_grad else absent(x))


def _conv_setup_context(ctx, inputs, output):
    x, weight, bias, conv_state, cu_seqlens, silu, x_add = inputs
    ctx.save_for_backward(x, weight, bias, conv_state, cu_seqlens, x_add)  # x and x_add, not their sum
    ctx.silu = silu
    ctx.set_materialize_grads(False)  # an unused new state gets no zero-filled gradient (and no add)


def _conv_backward(ctx, dy, dns):
    x, weight, bias, conv_state, cu_seqlens, x_add = ctx.saved_tensors
    state_grad = conv_state is not None and ctx.needs_input_grad[3]
    dx, dweight, dbias, dstate = torch.ops.lm.causal_conv1d_bwd(dy, dns, x, weight, bias, conv_state, cu_seqlens,
                                                                ctx.silu, state_grad, x_add)
    need = ctx.needs_input_grad
    # d(x + x_add) reaches x and x_add alike: one tensor returned for both (autograd never adds into it in place
    # while it is shared; tests/test_conv1d_triton.py checks the two gradients)
    return (dx if need[0] else None, dweight if need[1] else None, dbias if bias is not None and need[2] else None,
            dstate if state_grad else None, None, None, dx if x_add is not None and need[6] else None)


causal_conv1d_fwd.register_autograd(_conv_backward, setup_context=_conv_setup_context)


def check_conv_args(x, weight, bias, conv_state, cu_seqlens, activation, max_width=None, x_add=None):
    """Shapes, widths, x_add's shape and dtype and the activation; ValueError naming what is wrong."""
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must be (batch, seqlen, channels), got shape {tuple(x.shape)}")
    b, t, c = x.shape
    check_x_add(x, x_add)
    if weight.dim() != 2 or weight.shape[0] != c:
        raise ValueError(f"causal_conv1d: weight must be (channels={c}, width), got {tuple(weight.shape)}")
    w = weight.shape[1]
    if w < 1 or (max_width is not None and w > max_width):
        raise ValueError(f"causal_conv1d: the Triton kernel takes widths 1..{max_width}, got {w}; "
                         f"use backend='reference' (LM_CONV1D_BACKEND=reference)")
    if bias is not None and tuple(bias.shape) != (c,):
        raise ValueError(f"causal_conv1d: bias must be ({c},), got {tuple(bias.shape)}")
    if conv_state is not None and tuple(conv_state.shape) != (b, c, w - 1):
        raise ValueError(f"causal_conv1d: conv_state must be (batch, channels, width-1) = {(b, c, w - 1)}, "
                         f"got {tuple(conv_state.shape)}")
    if cu_seqlens is not None and (cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
                                   or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"causal_conv1d: cu_seqlens must be a 1-D int32/int64 tensor of offsets [0, ..., seqlen], "
                         f"got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    if activation not in ("silu", None):
        raise ValueError(f"causal_conv1d: activation must be 'silu' or None, got {activation!r}")


def causal_conv1d_triton(x, weight, bias=None, *, x_add=None, cu_seqlens=None, conv_state=None, activation="silu"):
    """Same contract as causal_conv1d_reference (y (b, t, c) contiguous, new state (b, c, w-1))."""
    check_conv_args(x, weight, bias, conv_state, cu_seqlens, activation, MAX_WIDTH, x_add=x_add)
    x = _channels_contiguous(x)  # the kernels vectorise along channels
    x_add = _channels_contiguous(x_add)
    silu = activation == "silu"
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(x.device)
    return torch.ops.lm.causal_conv1d_fwd(x, weight, bias, conv_state, cu_seqlens, silu, x_add)
