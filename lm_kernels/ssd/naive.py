"""Per-timestep SSD recurrence: the reference of the reference (slow; tests only) and the PyTorch decode step."""
from __future__ import annotations

import torch

from .common import apply_skip_and_gate, check_scan_args, check_step_args, compute_dtype, process_dt


def _recurrence(x, dt, A, B, C, state):
    """x (b,t,h,p), dt (b,t,h) processed, B/C (b,t,g,n), state (b,h,p,n) -> y (b,t,h,p), state."""
    h = x.shape[2]
    r = h // B.shape[2]
    B = B.repeat_interleave(r, dim=2)
    C = C.repeat_interleave(r, dim=2)
    ys = []
    for i in range(x.shape[1]):
        decay = torch.exp(dt[:, i] * A)  # (b,h)
        state = decay[..., None, None] * state + (dt[:, i, :, None] * x[:, i])[..., None] * B[:, i, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, i]))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape)
    return y, state


def ssd_scan_naive(x, dt, A, B, C, *, chunk_size=256, D=None, z=None, dt_bias=None, dt_softplus=True,
                   dt_limit=(0.0, float("inf")), initial_state=None, cu_seqlens=None,
                   return_final_state=False, backend=None, max_seqlen=None):
    """The recurrence one token at a time (same signature as ssd_scan; chunk_size/backend unused).

    With cu_seqlens every document is run on its own, which is what packing must reproduce (the offsets are read
    for that, with or without max_seqlen)."""
    b, t, h, p, g, n, num_seqs = check_scan_args(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens,
                                                 chunk_size, dt_limit, max_seqlen=max_seqlen)
    dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit, dtype)
    xc, Bc, Cc, Ac = x.to(dtype), B.to(dtype), C.to(dtype), A.to(dtype)
    if initial_state is None:
        s0 = torch.zeros(num_seqs, h, p, n, dtype=dtype, device=x.device)
    else:
        s0 = initial_state.to(dtype)
    if cu_seqlens is None:
        y, final = _recurrence(xc, dtp, Ac, Bc, Cc, s0)
    else:
        cu = [int(v) for v in cu_seqlens.tolist()]
        ys, finals = [], []
        for s in range(num_seqs):
            a, e = cu[s], cu[s + 1]
            yi, fi = _recurrence(xc[:, a:e], dtp[:, a:e], Ac, Bc[:, a:e], Cc[:, a:e], s0[s:s + 1])
            ys.append(yi)
            finals.append(fi)
        y, final = torch.cat(ys, dim=1), torch.cat(finals, dim=0)
    y = apply_skip_and_gate(y, x, D, z, dtype).to(x.dtype)
    if not return_final_state:
        return y, None
    return y, final.float() if dtype != torch.float64 else final


def ssd_step_reference(state, x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=True,
                       dt_limit=(0.0, float("inf")), out_state=None):
    """One token of the recurrence (generation), in PyTorch: the CPU path of `ssd_step` and the reference of its
    Triton kernel. state (b,h,p,n) float32, x (b,h,p), dt (b,h), B/C (b,g,n). Returns (y (b,h,p) in x's dtype,
    new_state float32 (float64 if state is)); `state` is not modified unless it is `out_state`, the tensor the new
    state is copied into and returned as new_state (may be `state`: an update in place)."""
    b, h, p, g, n = check_step_args(state, x, dt, A, B, C, D, z, dt_bias)
    dtype = compute_dtype(state, x, dt, A, B, C, D, z, dt_bias)
    y, new_state = _recurrence(x[:, None].to(dtype), process_dt(dt, dt_bias, dt_softplus, dt_limit, dtype)[:, None],
                               A.to(dtype), B[:, None].to(dtype), C[:, None].to(dtype), state.to(dtype))
    y = apply_skip_and_gate(y[:, 0], x, D, z, dtype).to(x.dtype)
    new_state = new_state.to(torch.float64 if dtype == torch.float64 else torch.float32)
    if out_state is not None:
        return y, out_state.copy_(new_state)
    return y, new_state
