"""FP-RNN channel mixers Q_t (paper 000, sec. 3.3 and App. C.3): input-dependent dense matrices applied
to a vector v, cheap enough to apply once per fixed-point iteration.

    Householder (H, rank r):  Q = H_{r-1} ... H_0,        H_i = I - s alpha_i u_i u_i^T
    DPLR (rank r):            Q = I - s sum_i alpha_i u_i u_i^T
    Kronecker (K):            Q = I - s (K1 (x) K2),       K_n = diag(d_n) Kbar_n,  Kbar_n symmetric PSD

u_i = normalize(act(W_u p)), alpha_i = sigmoid(w_alpha^T p + b), d_n = sigmoid(W_d p + b) and
Kbar_n = normalise(U_n U_n^T) (U_n upper triangular from W p) are linear in the mixer's parameter input
p (FP-Mamba: [x_t; y_{t-1}]). s = 2 allows negative eigenvalues (Grazzi et al.; the official code's
default), s = 1 keeps the H/DPLR factors in [0, 1]. Kbar_n is normalised by its largest eigenvalue
(power iteration, the paper) or row-wise to unit L2 norm (the official code's default).

The math is in pure functions (`householder_apply`, `dplr_apply`, `kronecker_apply`, `symmetric_psd`,
`spectral_normalize`); the modules only hold the projections. `dense_matrix(mixer, p, d)` materialises
Q for tests.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

MIXER_TYPES = ("householder", "dplr", "kronecker", "identity")
ACTIVATIONS = ("silu", "identity")
KRONECKER_NORMS = ("spectral", "row")


# --- pure functions ---------------------------------------------------------------------------------
def householder_apply(v: torch.Tensor, u: torch.Tensor, alpha: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    """Q v with Q = H_{r-1} ... H_0, H_i = I - scale alpha_i u_i u_i^T (u_i unit).
    v (..., d), u (..., r, d), alpha (..., r)."""
    for i in range(u.shape[-2]):
        ui = u[..., i, :]
        v = v - scale * alpha[..., i: i + 1] * ui * (ui * v).sum(-1, keepdim=True)
    return v


def dplr_apply(v: torch.Tensor, u: torch.Tensor, alpha: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    """Q v with Q = I - scale sum_i alpha_i u_i u_i^T. v (..., d), u (..., r, d), alpha (..., r)."""
    coef = (u * v.unsqueeze(-2)).sum(-1) * alpha  # (..., r)
    return v - scale * (coef.unsqueeze(-1) * u).sum(-2)


def kronecker_apply(v: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    """Q v with Q = I - scale (K1 (x) K2), row-major vec: (K1 (x) K2) vec(X) = vec(K1 X K2^T).
    v (..., m1*m2), k1 (..., m1, m1), k2 (..., m2, m2)."""
    m1, m2 = k1.shape[-1], k2.shape[-1]
    X = v.unflatten(-1, (m1, m2))
    return v - scale * (k1 @ X @ k2.transpose(-1, -2)).flatten(-2)


def symmetric_psd(params: torch.Tensor, m: int) -> torch.Tensor:
    """U U^T with U (m, m) upper triangular filled row by row from params (..., m(m+1)/2)."""
    iu = torch.triu_indices(m, m, device=params.device)
    U = params.new_zeros(*params.shape[:-1], m, m)
    U[..., iu[0], iu[1]] = params
    return U @ U.transpose(-1, -2)


def spectral_normalize(K: torch.Tensor, iters: int = 16, eps: float = 1e-6) -> torch.Tensor:
    """K / (lambda_max(K) + eps) for symmetric PSD K (..., m, m), lambda_max by power iteration."""
    m = K.shape[-1]
    v = K.new_full((*K.shape[:-1], 1), 1.0 / math.sqrt(m))
    for _ in range(iters):
        v = F.normalize(K @ v, dim=-2, eps=eps)
    lam = (v.transpose(-1, -2) @ K @ v).clamp_min(0.0)  # Rayleigh quotient (..., 1, 1)
    return K / (lam + eps)


def kronecker_factors(d: int) -> tuple[int, int]:
    """d = m1 * m2 with m1 the largest divisor <= sqrt(d) (m1 = m2 = sqrt(d) when d is a square)."""
    m1 = int(math.isqrt(d))
    while d % m1:
        m1 -= 1
    return m1, d // m1


def _activation(name: str):
    return F.silu if name == "silu" else (lambda t: t)


# --- modules ----------------------------------------------------------------------------------------
class ReflectionMixer(nn.Module):
    """Householder product (`product=True`) or DPLR (`product=False`) mixer of rank r on d channels."""

    def __init__(self, in_features: int, d: int, rank: int, *, product: bool = True, activation: str = "silu",
                 neg_eigval: bool = True, proj_rank: int = 0, eps: float = 1e-6):
        super().__init__()
        self.d, self.rank, self.product, self.eps = d, rank, product, eps
        self.scale = 2.0 if neg_eigval else 1.0
        self.act = _activation(activation)
        if proj_rank:
            self.u_proj = nn.Sequential(nn.Linear(in_features, proj_rank, bias=False),
                                        nn.Linear(proj_rank, rank * d, bias=False))
        else:
            self.u_proj = nn.Linear(in_features, rank * d, bias=False)
        self.alpha_proj = nn.Linear(in_features, rank, bias=True)

    def forward(self, param: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        u = F.normalize(self.act(self.u_proj(param)).unflatten(-1, (self.rank, self.d)), dim=-1, eps=self.eps)
        alpha = torch.sigmoid(self.alpha_proj(param))
        u, alpha = u.to(v.dtype), alpha.to(v.dtype)
        if self.product:
            return householder_apply(v, u, alpha, self.scale)
        return dplr_apply(v, u, alpha, self.scale)

    def flops_per_token(self) -> float:
        return 4.0 * self.rank * self.d + 4.0 * self.rank * self.d  # normalise u, then r rank-1 updates


class KroneckerMixer(nn.Module):
    """Q = I - s (D1 Kbar1) (x) (D2 Kbar2) on d = m1 * m2 channels."""

    def __init__(self, in_features: int, d: int, *, activation: str = "silu", neg_eigval: bool = True,
                 normalization: str = "spectral", power_iters: int = 16, proj_rank: int = 0, eps: float = 1e-6):
        super().__init__()
        self.d, self.eps, self.normalization, self.power_iters = d, eps, normalization, power_iters
        self.m1, self.m2 = kronecker_factors(d)
        self.scale = 2.0 if neg_eigval else 1.0
        self.act = _activation(activation)
        self.n1 = self.m1 * (self.m1 + 1) // 2
        n_out = self.n1 + self.m2 * (self.m2 + 1) // 2
        if proj_rank:
            self.uv_proj = nn.Sequential(nn.Linear(in_features, proj_rank, bias=False),
                                         nn.Linear(proj_rank, n_out, bias=False))
        else:
            self.uv_proj = nn.Linear(in_features, n_out, bias=False)
        self.diag_proj = nn.Linear(in_features, self.m1 + self.m2, bias=True)

    def _factor(self, params, m, diag):
        K = symmetric_psd(params, m)
        if self.normalization == "spectral":
            K = spectral_normalize(K, self.power_iters, self.eps)
        else:
            K = F.normalize(K, dim=-1, eps=self.eps)
        return diag.unsqueeze(-1) * K

    def forward(self, param: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dt = torch.float64 if v.dtype == torch.float64 else torch.float32  # build the factors in >= fp32
        params = self.act(self.uv_proj(param)).to(dt)
        diag = torch.sigmoid(self.diag_proj(param)).to(dt)
        k1 = self._factor(params[..., : self.n1], self.m1, diag[..., : self.m1])
        k2 = self._factor(params[..., self.n1:], self.m2, diag[..., self.m1:])
        return kronecker_apply(v.to(dt), k1, k2, self.scale).to(v.dtype)

    def flops_per_token(self) -> float:
        """Rough: U U^T for both factors, the power iteration's mat-vecs, and K1 X K2^T."""
        m1, m2 = self.m1, self.m2
        build = 2 * (m1 ** 3 + m2 ** 3)
        if self.normalization == "spectral":
            build += 2 * self.power_iters * (m1 ** 2 + m2 ** 2)
        return float(build + 2 * (m1 * m1 * m2 + m1 * m2 * m2))


def make_channel_mixer(kind: str, in_features: int, d: int, *, rank: int = 1, activation: str = "silu",
                       neg_eigval: bool = True, kronecker_norm: str = "spectral", proj_rank: int = 0,
                       eps: float = 1e-6) -> nn.Module | None:
    """The mixer module for `kind` (one of MIXER_TYPES); None for "identity" (Q = I)."""
    if kind == "identity":
        return None
    if kind in ("householder", "dplr"):
        return ReflectionMixer(in_features, d, rank, product=kind == "householder", activation=activation,
                               neg_eigval=neg_eigval, proj_rank=proj_rank, eps=eps)
    if kind == "kronecker":
        return KroneckerMixer(in_features, d, activation=activation, neg_eigval=neg_eigval,
                              normalization=kronecker_norm, proj_rank=proj_rank, eps=eps)
    raise ValueError(f"mixer_type: must be one of {MIXER_TYPES} (got {kind!r})")


def dense_matrix(mixer: nn.Module, param: torch.Tensor, d: int) -> torch.Tensor:
    """Q as a dense (..., d, d) matrix for the parameter input `param` (...,  in_features) (tests)."""
    eye = torch.eye(d, dtype=param.dtype, device=param.device)
    p = param.unsqueeze(-2).expand(*param.shape[:-1], d, param.shape[-1])
    cols = mixer(p, eye.expand(*param.shape[:-1], d, d))  # row j = Q e_j
    return cols.transpose(-1, -2)
