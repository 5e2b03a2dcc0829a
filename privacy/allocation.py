"""Optimal eigenvalue allocation for the metric ``P = U diag(λ) Uᵀ + τI`` (Subspace-DP-FL).

Subspace-DP-FL chooses
the metric by minimising the distortion ``D(P) = a·Tr(PG) + b·Tr(P⁻¹)``, G the second
moment of the updates: the first term is the clipping bias (a larger P-norm clips more
of the signal), the second the elliptical noise ``σ²Tr(P⁻¹)``.

**Model.** The eigenbasis of P is fixed: U (d×k, from PMU or public data) and its
complement, on which ``P = τ``. Only the k eigenvalues ``p_i = τ + λ_i`` along U are
free. With ``g_i = u_iᵀ G u_i`` (``subspace_energies``),

    D = Σ_i [a g_i p_i + b / p_i]  +  a τ Tr(G (I − UUᵀ)) + b (d − k)/τ,

Design notes: ``docs/notes.md``, ``privacy.allocation``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize

from privacy.subspace import uniform_allocation

_EPS = float(np.finfo(np.float64).eps)


# -- validation ------------------------------------------------------------------------
def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return float(value)


def _budget(value: float) -> float:
    if isinstance(value, bool) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"budget must be finite and >= 0, got {value!r}")
    return float(value)


def _energies(values: np.ndarray, name: str, ndim: int) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-d array, got shape {array.shape}")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{name} must be finite and >= 0 (no NaN, no negative values)")
    return array


# -- water-filling ---------------------------------------------------------------------
def _binding_allocation(weighted: np.ndarray, top: float, b: float, tau: float) -> np.ndarray:
    """λ(ν) written through ``x = λ_m``, the largest eigenvalue (m: the smallest a g_m).

    ``ν = b/(τ + x)² − a g_m``, so with ``δ_i = (a g_i − a g_m)(τ + x)²/b >= 0``,
    ``p_i = (τ + x)/√(1 + δ_i)`` and ``λ_i = [x − τ δ_i/(1 + √(1 + δ_i))]/√(1 + δ_i)``.
    Unlike ``√(b/(a g_i + ν)) − τ`` this has no cancellation of size τ: equal energies
    give λ_i = x exactly, and the rounding error of λ is relative to x <= B, not to τ.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        delta = (weighted - weighted.min()) * ((tau + top) ** 2 / b)
        root = np.sqrt(1.0 + delta)
        lam = (top - tau * delta / (1.0 + root)) / root
    return np.where(np.isfinite(delta), np.maximum(lam, 0.0), 0.0)


def water_filling(
    energies: np.ndarray, *, a: float, b: float, tau: float, budget: float
) -> np.ndarray:
    """λ minimising ``Σ_i [a g_i p_i + b/p_i]``, ``p = τ + λ``, s.t. ``λ ≥ 0``, ``Σλ ≤ B``.

    Parameters
    ----------
    energies : numpy.ndarray
        g, shape (k,): second moment of the updates along each direction (>= 0).
    a, b : float
        Weights (> 0) of the clipping term ``Tr(PG)`` and the noise term ``Tr(P⁻¹)``.
    tau : float
        τ > 0, the floor of P.
    budget : float
        B >= 0, the bound on ``Σλ = Tr(P − τI)``.

    Returns
    -------
    numpy.ndarray
        λ, shape (k,), with ``λ ≥ 0`` and ``Σλ ≤ B``.
    """
    g = _energies(energies, "energies", 1)
    a, b, tau = _positive("a", a), _positive("b", b), _positive("tau", tau)
    budget = _budget(budget)
    if g.size == 0 or budget == 0:
        return np.zeros(g.size)
    weighted = a * g
    if float(weighted.min()) > 0:  # ν = 0: p_i = √(b/(a g_i)) floored at τ
        free = np.maximum(np.sqrt(b / weighted) - tau, 0.0)
        if float(free.sum()) <= budget:  # the budget does not bind
            return free

    def excess(top: float) -> float:
        return float(np.sum(_binding_allocation(weighted, top, b, tau))) - budget

    # The budget binds: Σλ_i(ν) = B. On the active set the equation
    # Σ √(b/(a g_i + ν)) = B + |A|τ has no closed-form root once the energies differ, so
    # solve it for x = λ_m = max λ instead (a monotone reparametrisation of ν): excess(x)
    # is continuous and strictly increasing, −B at x = 0 (every λ_i = 0) and >= 0 at
    # x = B, and Brent's method on [0, B] finds its root to machine precision.
    if excess(budget) <= 0:
        top = budget
    else:
        top = optimize.brentq(excess, 0.0, budget, xtol=4 * _EPS * budget, rtol=4 * _EPS)
    lam = _binding_allocation(weighted, top, b, tau)
    total = float(lam.sum())
    if total > budget:  # the root is exact to rounding: scale back into the budget
        lam = lam * (budget / total)
        lam = lam * (1 - 4 * _EPS) if float(lam.sum()) > budget else lam
    return lam


def distortion(energies: np.ndarray, lam: np.ndarray, *, a: float, b: float, tau: float) -> float:
    """``Σ_i [a g_i p_i + b/p_i]`` with ``p = τ + λ`` (the complement's constant left out)."""
    g = _energies(energies, "energies", 1)
    a, b, tau = _positive("a", a), _positive("b", b), _positive("tau", tau)
    lam = np.asarray(lam, dtype=np.float64)
    if lam.shape != g.shape:
        raise ValueError(f"lam has shape {lam.shape}, energies {g.shape}: they must match")
    p = tau + lam
    if not np.all(np.isfinite(p)) or np.any(p <= 0):
        raise ValueError("lam must be finite with tau + lam_i > 0")
    return float(np.sum(a * g * p + b / p))


def subspace_energies(samples: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """``g_i = mean_x (u_iᵀx)² = u_iᵀ G u_i`` for the rows x of ``samples`` (n×d), U (d×k)."""
    x = np.asarray(samples, dtype=np.float64)
    u = np.asarray(basis, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 1:
        raise ValueError(f"samples must be an n x d array with n >= 1, got shape {x.shape}")
    if u.ndim != 2 or u.shape[0] != x.shape[1]:
        raise ValueError(f"basis must be d x k with d = {x.shape[1]}, got shape {u.shape}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(u))):
        raise ValueError("samples and basis must be finite")
    return np.mean((x @ u) ** 2, axis=0)


# -- group fairness --------------------------------------------------------------------
@dataclass(frozen=True)
class FairAllocation:
    """The minimax allocation over groups and its duality certificate."""

    lam: np.ndarray
    """λ, shape (k,): ``λ ≥ 0``, ``Σλ ≤ B``."""
    distortions: np.ndarray
    """D_g(λ) (+ offset_g), shape (G,)."""
    max_distortion: float
    """max_g D_g(λ): the primal value."""
    weights: np.ndarray
    """w, shape (G,), in the simplex: the dual solution (the groups that bind)."""
    lower_bound: float
    """L(w) = min_λ Σ_g w_g D_g(λ): no feasible λ has a smaller max_g D_g."""
    gap: float
    """max_distortion − lower_bound ≥ 0 (rounding below 0 is reported as 0)."""


class _Dual:
    """L(w) and its gradient D(λ(w)) for the fairness program (memoised per w)."""

    def __init__(self, energies: np.ndarray, offsets: np.ndarray, params: dict[str, float]):
        self.energies, self.offsets, self.params = energies, offsets, params
        self._cache: tuple[bytes, np.ndarray, np.ndarray] | None = None

    def solve(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(λ(w), D(λ(w)))`` for w >= 0 (L is positively homogeneous in w)."""
        w = np.maximum(np.asarray(w, dtype=np.float64), 0.0)
        key = w.tobytes()
        if self._cache is None or self._cache[0] != key:
            lam = water_filling(w @ self.energies, **self.params)
            self._cache = (key, lam, self.group_values(lam))
        return self._cache[1], self._cache[2]

    def value(self, w: np.ndarray) -> float:
        return float(np.maximum(w, 0.0) @ self.solve(w)[1])

    def group_values(self, lam: np.ndarray) -> np.ndarray:
        """D_g(λ) + offset_g for every group."""
        p = self.params["tau"] + lam
        return (
            self.params["a"] * self.energies @ p
            + self.params["b"] * np.sum(1.0 / p)
            + self.offsets
        )


def _two_group_weights(dual: _Dual) -> np.ndarray:
    """w = (t, 1 − t): L'(t) = D_1 − D_2 is non-increasing (L concave); find its root."""

    def slope(t: float) -> float:
        values = dual.solve(np.array([t, 1.0 - t]))[1]
        return float(values[0] - values[1])

    if slope(0.0) <= 0:
        t = 0.0
    elif slope(1.0) >= 0:
        t = 1.0
    else:
        t = optimize.brentq(slope, 0.0, 1.0, xtol=4 * _EPS, rtol=4 * _EPS, maxiter=500)
    return np.array([t, 1.0 - t])


def _simplex_weights(dual: _Dual) -> np.ndarray:
    """Maximise the concave L over the simplex with SLSQP (gradient D(λ(w)), Danskin)."""
    n = dual.energies.shape[0]
    start = np.full(n, 1.0 / n)
    scale = max(abs(dual.value(start)), 1e-300)
    result = optimize.minimize(
        lambda w: -dual.value(w) / scale,
        start,
        jac=lambda w: -dual.solve(w)[1] / scale,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * n,
        constraints=[
            {"type": "eq", "fun": lambda w: np.sum(w) - 1.0, "jac": lambda w: np.ones(n)}
        ],
        options={"ftol": 1e-15, "maxiter": 500},
    )
    w = np.maximum(result.x, 0.0)
    # Any point of the simplex gives a valid bound; keep the best of SLSQP and the vertices.
    candidates = [w / w.sum(), *np.eye(n)] if w.sum() > 0 else list(np.eye(n))
    return max(candidates, key=dual.value)


def _polish_primal(dual: _Dual, lam: np.ndarray) -> np.ndarray:
    """Epigraph solve ``min t, t >= D_g(λ)`` (SLSQP) warm-started at λ(w*).

    With G > 2, SLSQP on the dual stops once L(w) is flat to ``ftol``, which leaves w, and
    so the primal ``max_g D_g(λ(w))``, accurate only to about √ftol. The epigraph problem
    is first-order in its objective t, so a few SLSQP steps from λ(w*) close that gap.
    Returns the polished λ if it is feasible and better, else ``lam``.
    """
    k, budget = lam.size, dual.params["budget"]
    scale = float(np.max(np.abs(dual.group_values(lam)))) or 1.0
    tau, a, b = dual.params["tau"], dual.params["a"], dual.params["b"]
    unit_t, spend = np.append(np.zeros(k), 1.0), np.append(-np.ones(k), 0.0)
    result = optimize.minimize(
        lambda z: z[-1],
        np.append(lam, dual.group_values(lam).max() / scale),
        jac=lambda z: unit_t,
        method="SLSQP",
        bounds=[(0.0, None)] * k + [(None, None)],
        constraints=[
            {
                "type": "ineq",
                "fun": lambda z: z[-1] - dual.group_values(z[:-1]) / scale,
                "jac": lambda z: np.column_stack(
                    [
                        -(a * dual.energies - b / (tau + z[:-1]) ** 2) / scale,
                        np.ones(len(dual.energies)),
                    ]
                ),
            },
            {"type": "ineq", "fun": lambda z: budget - np.sum(z[:-1]), "jac": lambda z: spend},
        ],
        options={"ftol": 1e-15, "maxiter": 200},
    )
    polished = np.maximum(result.x[:-1], 0.0)
    total = float(polished.sum())
    if total > budget:
        polished = polished * (budget / total) * (1 - 4 * _EPS)
    better = dual.group_values(polished).max() < dual.group_values(lam).max()
    return polished if better else lam


def fair_allocation(
    group_energies: np.ndarray,
    *,
    a: float,
    b: float,
    tau: float,
    budget: float,
    offsets: np.ndarray | None = None,
) -> FairAllocation:
    """λ minimising ``max_g D_g(λ)`` s.t. ``λ ≥ 0``, ``Σλ ≤ B``, solved through the dual.

    Parameters
    ----------
    group_energies : numpy.ndarray
        Shape (G, k), G >= 1: row g holds group g's energies ``u_iᵀ G_g u_i`` (>= 0).
    a, b, tau, budget : float
        As in ``water_filling``.
    offsets : numpy.ndarray, optional
        Shape (G,): a constant added to each group's distortion, e.g. the complement's
        ``a τ Tr(G_g(I − UUᵀ))`` when the groups' energy outside U differs. Default 0.

    Returns
    -------
    FairAllocation
        λ, the group distortions, the dual weights and the certificate (gap).
    """
    energies = _energies(group_energies, "group_energies", 2)
    if energies.shape[0] < 1:
        raise ValueError(f"group_energies needs at least one group (row), got {energies.shape}")
    params = {
        "a": _positive("a", a),
        "b": _positive("b", b),
        "tau": _positive("tau", tau),
        "budget": _budget(budget),
    }
    n = energies.shape[0]
    shift = np.zeros(n) if offsets is None else np.asarray(offsets, dtype=np.float64)
    if shift.shape != (n,) or not np.all(np.isfinite(shift)):
        raise ValueError(f"offsets must be finite with shape ({n},), got {shift.shape}")
    dual = _Dual(energies, shift, params)
    if n == 1:
        weights = np.ones(1)
    elif n == 2:
        weights = _two_group_weights(dual)
    else:
        weights = _simplex_weights(dual)
    lam, values = dual.solve(weights)
    if n > 2 and lam.size and values.max() > weights @ values:
        lam = _polish_primal(dual, lam)
        values = dual.group_values(lam)
    lower = float(weights @ values)
    worst = float(values.max())
    return FairAllocation(
        lam=lam,
        distortions=values,
        max_distortion=worst,
        weights=weights,
        lower_bound=lower,
        gap=max(worst - lower, 0.0),
    )


# -- the app's use: allocations from public samples ------------------------------------
def distortion_weights(
    total_energy: float, energies: np.ndarray, *, dim: int, tau: float, lam: np.ndarray
) -> tuple[float, float]:
    """(a, b) = (Tr(P⁻¹), Tr(PG)) at the metric with eigenvalues ``τ + lam`` on U.

    Subspace-DP-FL leaves a and b open. With the clip norm set at the updates' RMS P-norm
    (C² = Tr(PG)) the noise energy of a release is ∝ Tr(PG)·Tr(P⁻¹); its gradient in P is
    ``Tr(P⁻¹)·G − Tr(PG)·P⁻²``, the gradient of D with these weights. Only b/a matters,
    and it is invariant to the scale of G.
    """
    p = tau + lam
    a = (dim - lam.size) / tau + float(np.sum(1.0 / p))
    b = tau * total_energy + float(np.sum(lam * energies))
    return a, b


def allocate(
    mode: str,
    basis: np.ndarray,
    pooled: np.ndarray,
    groups: dict[str, np.ndarray],
    *,
    tau: float,
    budget: float,
) -> tuple[np.ndarray, FairAllocation | None]:
    """λ on U = ``basis`` by ``mode`` ("water-filling" or "fairness") from public samples.

    ``pooled`` (n×d) are all samples, ``groups`` the samples of each group (fairness).
    The weights are ``distortion_weights`` at the uniform split B/k. Under fairness
    each group's distortion includes its energy off U (``offsets``), which differs
    between groups. Returns λ and, for fairness, the solution with its certificate.
    """
    rank = basis.shape[1]
    energies = subspace_energies(pooled, basis)
    a, b = distortion_weights(
        float(np.mean(np.sum(pooled**2, axis=1))),
        energies,
        dim=basis.shape[0],
        tau=tau,
        lam=uniform_allocation(rank, budget),
    )
    params = {"a": a, "b": b, "tau": tau, "budget": budget}
    if mode == "water-filling":
        return water_filling(energies, **params), None
    if mode != "fairness" or not groups:
        raise ValueError(f"mode must be 'water-filling' or 'fairness' (with groups), got {mode!r}")
    group_energies = np.stack([subspace_energies(x, basis) for x in groups.values()])
    totals = np.array([np.mean(np.sum(x**2, axis=1)) for x in groups.values()])
    offsets = a * tau * (totals - group_energies.sum(axis=1))
    fair = fair_allocation(group_energies, offsets=offsets, **params)
    return fair.lam, fair
