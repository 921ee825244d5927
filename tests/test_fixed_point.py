"""lm.fixed_point.solve: results and stats equal to the plain per-iteration loop; no host sync and one residual
in the bounded phase (tol None), at most one sync per iteration in the free phase."""
import pytest
import torch

import lm.fixed_point as fp
from lm.fixed_point import _anderson_step, _bcast, relative_residual, solve


def _reference_solve(f, z0, *, max_iter, tol=None, damping=1.0, stop_quantile=1.0, norm="l2", patience=None,
                     damping_decay=1.0, anderson=0):
    """The plain loop: residual, masks and the damped update of every sample in every iteration."""
    b = z0.shape[0]
    z = z0
    res = torch.full((b,), float("inf"), dtype=torch.promote_types(z0.dtype, torch.float32))
    done = torch.zeros(b, dtype=torch.bool)
    sample_iters = torch.zeros(b, dtype=torch.long)
    lam = torch.full((b,), float(damping), dtype=res.dtype)
    best = torch.full_like(res, float("inf"))
    stall = torch.zeros(b, dtype=torch.long)
    hz, hg = [], []
    it = 0
    for it in range(1, max_iter + 1):
        fz = f(z)
        r = relative_residual(fz, z, norm)
        active = ~done
        res = torch.where(active, r, res)
        sample_iters = sample_iters + active.long()
        if tol is not None:
            newly = active & (r < tol)
            done = done | newly
            active = active & ~newly
        lam_b = _bcast(lam, z).to(z.dtype)
        z_next = lam_b * fz + (1 - lam_b) * z
        if anderson > 0:
            z_next = _anderson_step(z, fz, z_next, hz, hg, anderson, lam_b)
        z = torch.where(_bcast(active, z), z_next, z)
        if patience is not None and damping_decay != 1.0:
            improved = r < best
            best = torch.where(improved, r, best)
            stall = torch.where(improved, torch.zeros_like(stall), stall + 1)
            decay = active & (stall >= patience)
            lam = torch.where(decay, lam * damping_decay, lam)
            stall = torch.where(decay, torch.zeros_like(stall), stall)
        if tol is not None and done.float().mean().item() >= stop_quantile:
            break
    converged = res < tol if tol is not None else torch.zeros(b, dtype=torch.bool)
    return z, it, res, sample_iters, converged


def _contraction(b=6, n=10, dtype=torch.float64, seed=0):
    """f(z) = rho_i W z + c per sample i, with rates rho_i from fast to slow (0.95 needs damping decay to matter)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, n, generator=g, dtype=dtype)
    w = w / torch.linalg.matrix_norm(w, ord=2)
    rho = torch.linspace(0.1, 0.95, b, dtype=dtype).view(b, 1, 1)
    c = torch.randn(b, 3, n, generator=g, dtype=dtype)
    return lambda z: rho * (z @ w.T) + c, torch.zeros(b, 3, n, dtype=dtype)


CASES = [
    dict(max_iter=7),
    dict(max_iter=7, damping=0.6),
    dict(max_iter=7, damping=0.8, patience=1, damping_decay=0.5),
    dict(max_iter=7, anderson=2),
    dict(max_iter=0),
    dict(max_iter=40, tol=1e-4),
    dict(max_iter=40, tol=1e-4, stop_quantile=0.5),
    dict(max_iter=40, tol=1e-4, damping=0.7, norm="inf"),
    dict(max_iter=40, tol=1e-4, patience=2, damping_decay=0.5, damping=0.9),
    dict(max_iter=40, tol=1e-6, anderson=3, norm="inf_rows"),
    dict(max_iter=3, tol=1e-4),  # the cap before anything converges
]


@pytest.mark.parametrize("kw", CASES, ids=[str(i) for i in range(len(CASES))])
def test_solve_equals_reference_loop(kw):
    f, z0 = _contraction()
    z, st = solve(f, z0, **kw)
    rz, rit, rres, riters, rconv = _reference_solve(f, z0, **kw)
    torch.testing.assert_close(z, rz, rtol=1e-12, atol=1e-12)
    assert st.iterations == rit
    torch.testing.assert_close(st.residual, rres, rtol=1e-12, atol=0)
    assert torch.equal(st.sample_iterations, riters)
    assert torch.equal(st.converged, rconv)
    d = st.as_dict()
    assert d["iterations"] == float(rit)
    if kw["max_iter"]:
        assert d["residual_max"] == pytest.approx(float(rres.max()))
        assert d["mean_sample_iterations"] == pytest.approx(float(riters.double().mean()))


def _count_calls(monkeypatch, owner, *names):
    """Count the calls of owner.<name> for each of `names` (one counter for all: n[0])."""
    n = [0]
    for name in names:
        orig = getattr(owner, name)

        def counted(*a, _orig=orig, **k):
            n[0] += 1
            return _orig(*a, **k)

        monkeypatch.setattr(owner, name, counted)
    return n


def _count_syncs(monkeypatch):
    """Count Tensor -> Python conversions (each is a device-to-host sync on a GPU)."""
    return _count_calls(monkeypatch, torch.Tensor, "item", "tolist", "__bool__", "__float__", "__int__", "__index__")


def _plain_iteration(f, z0, n):
    """f applied n times to z0."""
    z = z0
    for _ in range(n):
        z = f(z)
    return z


@pytest.mark.parametrize("kw", [dict(), dict(damping=0.5), dict(anderson=2), dict(patience=1, damping_decay=0.5)])
def test_bounded_phase_has_no_host_sync_and_one_residual(kw, monkeypatch):
    f, z0 = _contraction()
    calls = _count_calls(monkeypatch, fp, "relative_residual")
    syncs = _count_syncs(monkeypatch)
    z, st = solve(f, z0, max_iter=6, **kw)
    assert syncs[0] == 0, f"{syncs[0]} host syncs in the bounded phase"
    assert calls[0] == (6 if "patience" in kw else 1)
    assert st.iterations == 6


def test_bounded_damping_one_is_plain_iteration(monkeypatch):
    """damping 1, tol None: z is f applied max_iter times, with no torch.where."""
    f, z0 = _contraction()
    wheres = _count_calls(monkeypatch, torch, "where")
    z, _ = solve(f, z0, max_iter=5)
    assert wheres[0] == 0
    assert torch.equal(z, _plain_iteration(f, z0, 5))


def test_free_phase_syncs_at_most_once_per_iteration(monkeypatch):
    f, z0 = _contraction()
    syncs = _count_syncs(monkeypatch)
    z, st = solve(f, z0, max_iter=200, tol=1e-5)
    n = syncs[0]
    assert st.iterations < 200 and st.converged.all()
    assert n == st.iterations, (n, st.iterations)  # the test that stopped the loop is the last sync
    syncs[0] = 0
    z, st = solve(f, z0, max_iter=5, tol=1e-12)  # the cap: no sync at the last iteration
    assert st.iterations == 5 and syncs[0] == 4


def test_converged_samples_stay_frozen():
    f, z0 = _contraction()
    z, st = solve(f, z0, max_iter=200, tol=1e-5)
    # fast samples stopped early; each returned z has a residual below tol with f itself
    assert st.sample_iterations[0] < st.sample_iterations[-1]
    assert (relative_residual(f(z), z) < 1e-5).all()


def test_free_phase_masks_nothing_before_a_sample_converges(monkeypatch):
    """tol set, nothing converged yet: the iterations before the last run no torch.where (plain z = f(z))."""
    f, z0 = _contraction()
    wheres = _count_calls(monkeypatch, torch, "where")
    z, st = solve(f, z0, max_iter=5, tol=1e-12)
    assert not st.converged.any() and st.iterations == 5
    assert wheres[0] == 1  # the last iteration's freeze, decided without a sync
    assert torch.equal(z, _plain_iteration(f, z0, 5))


@pytest.mark.parametrize("tol", [None, 0.05])
def test_lazy_stats_equal_as_dict(tol):
    """as_mapping() is as_dict() looked up later: the same keys and values, read once."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(8, 8, generator=gen) * 0.1
    x = torch.randn(5, 8, generator=gen)
    z, st = solve(lambda z: torch.tanh(z @ w + x), torch.zeros(5, 8), max_iter=7, tol=tol)
    lazy = st.as_mapping()
    assert isinstance(lazy, fp.LazyStats) and lazy._read is None  # nothing read yet
    assert str(dict(lazy)) == str(st.as_dict()) and lazy["iterations"] == st.as_dict()["iterations"]  # (NaNs)
    assert lazy.get("missing", 3) == 3 and set(lazy) == set(st.as_dict()) and len(lazy) == 5
    empty = fp.FixedPointStats(0, torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.bool), tol)
    assert str(dict(empty.as_mapping())) == str(empty.as_dict())  # (NaNs)
