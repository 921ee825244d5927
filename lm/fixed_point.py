"""Fixed-point engine: no-grad solve, phantom gradient, convergence statistics.

Used by the implicit block stacks (paper 003: the whole stack is z <- F(z, inj(x))) and by FP-Mamba
(paper 000: a fixed point inside each layer). It takes a function, never a model; both callers pass the keyword
arguments of one settings type (lm.models.config.ImplicitSettings.solve_args: the stack's `implicit`, FP-Mamba's
`layer_solver`).

- `solve(f, z0, ...)`: damped iteration z <- lam f(z) + (1 - lam) z without autograd, with per-sample
  convergence tracking (sample = index along dim 0). A sample whose relative residual
  ||f(z) - z|| / ||f(z)|| falls below `tol` is frozen at that z, so its result does not depend on
  the rest of the batch. The loop stops when a `stop_quantile` fraction of the samples has converged,
  or after `max_iter` iterations. Optional per-sample damping decay after `patience` iterations
  without improvement (FP-Mamba's optimiser), optional Anderson acceleration.
- `phantom(f, z_star, steps, damping)`: k damped steps with autograd from the detached fixed point,
  the phantom gradient of paper 003 eq. 5 (Geng et al. 2021). Memory is that of k applications of f,
  independent of the number of solver iterations.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable

import torch

from .host_copy import queue_to_host, read_host


@dataclasses.dataclass
class FixedPointStats:
    iterations: int                 # solver iterations run (the loop's length)
    residual: torch.Tensor          # (B,) final relative residual per sample (float32, detached)
    sample_iterations: torch.Tensor  # (B,) iterations until each sample converged (or the cap)
    converged: torch.Tensor         # (B,) bool: residual < tol (all False when tol is None)
    tol: float | None = None

    @property
    def converged_fraction(self) -> float:
        return float(self.converged.float().mean()) if self.converged.numel() else float("nan")

    def _values(self) -> torch.Tensor | None:
        if not self.residual.numel():
            return None
        return torch.stack([self.sample_iterations.double().mean(), self.residual.double().mean(),
                            self.residual.double().max(), self.converged.double().mean()])

    def _dict(self, vals: list[float] | None) -> dict:
        vals = vals or [float("nan")] * 4
        return {
            "iterations": float(self.iterations),
            "mean_sample_iterations": vals[0],
            "residual_mean": vals[1],
            "residual_max": vals[2],
            "converged": vals[3] if self.tol is not None else float("nan"),
        }

    def as_dict(self) -> dict:
        """Python floats for logging (one device-to-host copy for all of them)."""
        vals = self._values()
        return self._dict(None if vals is None else vals.tolist())

    def as_mapping(self) -> "LazyStats":
        """as_dict's values without waiting for the device now (see LazyStats)."""
        return LazyStats(self)

    @staticmethod
    def merge(stats: list["FixedPointStats"]) -> dict:
        """Average the logging dicts of several solves (e.g. the layers of FP-Mamba, tokens in generation)."""
        if not stats:
            return {}
        dicts = [s.as_dict() for s in stats]
        out = {k: sum(d[k] for d in dicts) / len(dicts) for k in dicts[0]}
        out["residual_max"] = max(d["residual_max"] for d in dicts)
        return out


class LazyStats(Mapping):
    """A solve's logging values (the keys of FixedPointStats.as_dict) that do not make the host wait for the device
    where they are made: on CUDA the values are copied to pinned host memory right behind the solve, with an event,
    and the first lookup waits for that event only. A training step hands these to the trainer, which reads them
    with the step's results, after the next step is queued; reading them in the forward (`.tolist()`) would stop
    the host there until the device had run the whole solve."""

    def __init__(self, stats: FixedPointStats):
        self._stats, self._read = stats, None
        vals = stats._values()
        self._pending = None if vals is None else queue_to_host(vals)

    def _get(self) -> dict:
        if self._read is None:
            self._read = self._stats._dict(None if self._pending is None else read_host(self._pending))
            self._stats = self._pending = None
        return self._read

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return f"LazyStats({self._get()!r})"


NORMS = ("l2", "inf", "inf_rows")


def _reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """t summed ("sum") or maxed ("max") over the ranks of `group` (context parallelism: each rank holds a slice of
    every sample); t itself without a group."""
    if group is None:
        return t
    import torch.distributed as dist

    t = t.contiguous()
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return t


def relative_residual(fz: torch.Tensor, z: torch.Tensor, norm: str = "l2", eps: float = 1e-8,
                      group=None) -> torch.Tensor:
    """||f(z) - z|| / (||f(z)|| + eps) per sample (dim 0), in float32 (float64 for float64 inputs).

    "l2" and "inf" take the norms over the whole sample; "inf_rows" takes the relative inf-norm of every
    row (last dim: each token's vector) and the max over rows, as the FP-RNN code does. `group`: a process group
    whose ranks each hold a slice of every sample (context parallelism): the norms are the whole samples'.
    """
    acc = torch.promote_types(fz.dtype, torch.float32)
    if norm == "inf_rows":
        d = (fz - z).to(acc).abs().amax(-1)
        r = fz.to(acc).abs().amax(-1)
        rows = d / (r + eps)
        return _reduce(rows.flatten(1).amax(1) if rows.dim() > 1 else rows, "max", group)
    d = (fz - z).to(acc).flatten(1)
    r = fz.to(acc).flatten(1)
    if group is None:  # every iteration of the solve: no stacking for a reduction that does not happen
        if norm == "inf":
            return d.abs().amax(1) / (r.abs().amax(1) + eps)
        return d.norm(dim=1) / (r.norm(dim=1) + eps)
    if norm == "inf":
        dr = _reduce(torch.stack([d.abs().amax(1), r.abs().amax(1)]), "max", group)
        return dr[0] / (dr[1] + eps)
    dr = _reduce(torch.stack([d.pow(2).sum(1), r.pow(2).sum(1)]), "sum", group).sqrt()
    return dr[0] / (dr[1] + eps)


def _bcast(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.view(-1, *([1] * (like.dim() - 1)))


@torch.no_grad()
def solve(
    f: Callable[[torch.Tensor], torch.Tensor],
    z0: torch.Tensor,
    *,
    max_iter: int,
    tol: float | None = None,
    damping: float = 1.0,
    stop_quantile: float = 1.0,
    norm: str = "l2",
    patience: int | None = None,
    damping_decay: float = 1.0,
    anderson: int = 0,
    group=None,
) -> tuple[torch.Tensor, FixedPointStats]:
    """Iterate z <- lam f(z) + (1 - lam) z from z0 without autograd; see the module docstring.

    `group` (context parallelism): a process group whose ranks each hold a slice of every sample; the residuals
    (and Anderson's inner products) are the whole samples', so every rank of the group makes the same decisions and
    runs the same number of iterations.

    tol None (the bounded phase: exactly max_iter iterations) runs no host sync and, unless the damping can decay
    (patience), computes the residual only at the last iteration, for the stats; with damping 1 an iteration is
    just z = f(z). With tol (the free phase) every iteration computes the residual and synchronises once, for the
    stopping test; frozen samples are masked only once some have converged."""
    if max_iter < 0:
        raise ValueError(f"max_iter must be >= 0 (got {max_iter})")
    decay = patience is not None and damping_decay != 1.0
    if tol is None:
        return _solve_bounded(f, z0, max_iter, damping, norm, decay, patience, damping_decay, anderson, group)
    return _solve_free(f, z0, max_iter, tol, damping, stop_quantile, norm, decay, patience, damping_decay, anderson,
                       group)


class _Damping:
    """lam per sample: a Python float until it can differ between samples (decay after `patience` stalls)."""

    def __init__(self, z, damping, decay, patience, damping_decay, group=None):
        b, dev = z.shape[0], z.device
        self.decay, self.patience, self.factor, self.group = decay, patience, damping_decay, group
        acc = torch.promote_types(z.dtype, torch.float32)
        self.lam = torch.full((b,), float(damping), device=dev, dtype=acc) if decay else float(damping)
        if decay:
            self.best = torch.full((b,), float("inf"), device=dev, dtype=acc)
            self.stall = torch.zeros(b, dtype=torch.long, device=dev)

    def step(self, z, fz, anderson, hist_z, hist_g):
        """The damped (or Anderson) update of every sample."""
        lam = self.lam
        if anderson > 0 or not isinstance(lam, float):
            if isinstance(lam, float):
                lam = torch.full((z.shape[0],), lam, device=z.device, dtype=torch.promote_types(z.dtype, torch.float32))
            lam_b = _bcast(lam, z).to(z.dtype)
            z_next = lam_b * fz + (1 - lam_b) * z
            if anderson > 0:
                z_next = _anderson_step(z, fz, z_next, hist_z, hist_g, anderson, lam_b, self.group)
            return z_next
        return fz if lam == 1.0 else lam * fz + (1 - lam) * z

    def update(self, r, active):
        """Decay lam of the active samples whose residual has not improved for `patience` iterations."""
        improved = r < self.best
        self.best = torch.where(improved, r, self.best)
        self.stall = torch.where(improved, torch.zeros_like(self.stall), self.stall + 1)
        dec = self.stall >= self.patience
        if active is not None:
            dec = dec & active
        self.lam = torch.where(dec, self.lam * self.factor, self.lam)
        self.stall = torch.where(dec, torch.zeros_like(self.stall), self.stall)


def _solve_bounded(f, z, max_iter, damping, norm, decay, patience, damping_decay, anderson, group=None):
    """tol None: max_iter iterations for every sample; no sync, the residual only where needed."""
    b, dev = z.shape[0], z.device
    lam = _Damping(z, damping, decay, patience, damping_decay, group)
    res = torch.full((b,), float("inf"), device=dev, dtype=torch.promote_types(z.dtype, torch.float32))
    hist_z: list[torch.Tensor] = []
    hist_g: list[torch.Tensor] = []
    for it in range(1, max_iter + 1):
        fz = f(z)
        if decay or it == max_iter:
            r = relative_residual(fz, z, norm, group=group)
            if decay:
                lam.update(r, None)
            if it == max_iter:
                res = r
        z = lam.step(z, fz, anderson, hist_z, hist_g)
    iters = torch.full((b,), max_iter, dtype=torch.long, device=dev)
    return z, FixedPointStats(max_iter, res.detach(), iters, torch.zeros(b, dtype=torch.bool, device=dev), None)


def _solve_free(f, z, max_iter, tol, damping, stop_quantile, norm, decay, patience, damping_decay, anderson,
                group=None):
    """tol set: a sample whose residual falls below tol is frozen at that z; one sync per iteration (the count of
    converged samples), none at the last. While no sample has converged nothing is masked."""
    b, dev = z.shape[0], z.device
    lam = _Damping(z, damping, decay, patience, damping_decay, group)
    res = torch.full((b,), float("inf"), device=dev, dtype=torch.promote_types(z.dtype, torch.float32))
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    sample_iters = torch.zeros(b, dtype=torch.long, device=dev)
    hist_z: list[torch.Tensor] = []
    hist_g: list[torch.Tensor] = []
    n_done = 0  # converged samples as of the last sync
    it = 0
    for it in range(1, max_iter + 1):
        fz = f(z)
        r = relative_residual(fz, z, norm, group=group)
        if n_done:
            active = ~done
            res = torch.where(active, r, res)
            sample_iters = sample_iters + active.long()
        else:  # every sample still iterates
            active = None
            res = r
            sample_iters = sample_iters + 1
        newly = r < tol if active is None else active & (r < tol)
        done = done | newly
        still = ~done
        z_next = lam.step(z, fz, anderson, hist_z, hist_g)
        stop = False
        if it < max_iter:
            n_done = int(done.sum())  # the one sync per iteration
            stop = n_done == b or n_done / b >= stop_quantile
        # a sample converged at this z stays there; while none has, every sample takes the step
        z = z_next if (it < max_iter and n_done == 0) else torch.where(_bcast(still, z), z_next, z)
        if decay:
            lam.update(r, still)
        if stop:
            break
    return z, FixedPointStats(it, res.detach(), sample_iters, res < tol, tol)


def _anderson_step(z, fz, z_plain, hist_z, hist_g, m, lam_b, group=None):
    """Type-II Anderson mixing over the last m iterates, per sample; falls back to the damped step. `group`: the
    inner products are summed over its ranks (context parallelism: each holds a slice of every sample)."""
    acc = torch.promote_types(z.dtype, torch.float32)
    g = (fz - z).flatten(1).to(acc)
    hist_z.append(z.flatten(1).to(acc))
    hist_g.append(g)
    if len(hist_z) > m + 1:
        hist_z.pop(0)
        hist_g.pop(0)
    if len(hist_g) < 2:
        return z_plain
    G = torch.stack(hist_g, dim=2)  # (b, n, k)
    Z = torch.stack(hist_z, dim=2)
    dG = G[..., 1:] - G[..., :-1]
    dZ = Z[..., 1:] - Z[..., :-1]
    # least squares gamma = argmin ||g_k - dG gamma||, regularised
    A = dG.transpose(1, 2) @ dG
    rhs = dG.transpose(1, 2) @ G[..., -1:]
    if group is not None:
        k = A.shape[-1]
        Ar = _reduce(torch.cat([A, rhs], dim=-1), "sum", group)
        A, rhs = Ar[..., :k], Ar[..., k:]
    scale = A.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(torch.finfo(acc).tiny)[:, None, None]
    A = A + 1e-10 * scale * torch.eye(A.shape[-1], device=A.device, dtype=acc)
    gamma = torch.linalg.solve(A, rhs)  # (b, k-1, 1)
    z_bar = Z[..., -1:] - dZ @ gamma
    g_bar = G[..., -1:] - dG @ gamma
    lam = lam_b.flatten(1)[:, :1].to(acc)
    out = (z_bar + lam.unsqueeze(-1) * g_bar).squeeze(-1)
    out = torch.nan_to_num(out, nan=0.0)
    return out.view_as(z).to(z.dtype)


def phantom(
    f: Callable[[torch.Tensor], torch.Tensor], z_star: torch.Tensor, *, steps: int, damping: float = 1.0
) -> torch.Tensor:
    """k damped steps with autograd from the detached fixed point (phantom gradient, paper 003 eq. 5).

    With steps == 1 and damping == 1 the gradient equals autograd through one application of f at z*.
    """
    z = z_star.detach()
    for _ in range(steps):
        z = damping * f(z) + (1.0 - damping) * z if damping != 1.0 else f(z)
    return z
