"""Empirical privacy audit in the training run itself: canary clients, an ε estimate and a
statistically valid ε lower bound.

The accountant's ε is a bound for the mechanism *as analysed*; the audit tests the
pipeline *as it ran* (sampling, clipping, noise, aggregation, server optimizer) from
what it released, so that a bug or a broken assumption shows as an audit above the
accountant's ε.

Design notes: ``docs/notes.md``, ``privacy.audit``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

# scipy.optimize and scipy.stats (~2 CPU-s of imports) only where the server's audit
# uses them: the canary ClientApp imports this module for the canaries alone.
from scipy import special

from privacy import subspace
from privacy.mechanisms import make_generator

AUDIT_STREAM = 0xA0D1  # separates the canaries' randomness from every other stream
_INCLUSION, _DIRECTION, _ROUND = 1, 2, 3
CANARY_OVERSHOOT = 2.0  # a canary's norm / the clip bound: clipped in every round
GUESS_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
EPSILON_CAP = 50.0  # search range of every ε here


def inclusion(seed: int, canaries: int) -> np.ndarray:
    """``S``: for each canary, whether it is inserted (independent fair coins)."""
    return make_generator(seed, AUDIT_STREAM, _INCLUSION).random(canaries) < 0.5


def canary_direction(seed: int, index: int, dim: int) -> np.ndarray:
    """Canary ``index``'s direction: uniform on the unit sphere of R^dim (float64)."""
    v = make_generator(seed, AUDIT_STREAM, _DIRECTION, index).standard_normal(dim)
    return v / np.linalg.norm(v)


def inserts_in_round(seed: int, index: int, server_round: int, rate: float) -> bool:
    """Whether an inserted canary, when sampled in ``server_round``, uploads its direction
    (``audit.canary-rate``; 1: always, like a real client)."""
    if rate >= 1.0:
        return True
    return bool(make_generator(seed, AUDIT_STREAM, _ROUND, index, server_round).random() < rate)


def canary_norm(direction: np.ndarray, *, l2_bound: float | None, l1_bound: float | None) -> float:
    """The factor ``s`` of the canary upload ``s · direction``: ``CANARY_OVERSHOOT`` times
    the clip bound (L2 for DP-FedAvg and subspace-DP, L1 for Laplace), so clipping
    always brings it to exactly the bound."""
    if l1_bound is not None:
        return CANARY_OVERSHOOT * l1_bound / float(np.abs(direction).sum())
    if l2_bound is None:
        raise ValueError("a canary needs a clip bound (L2 or L1)")
    return CANARY_OVERSHOOT * l2_bound


def flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The floating-point arrays' values in order, as one float64 vector (the space the
    canaries live in; integer buffers such as BatchNorm's step count are left out)."""
    return subspace.flatten([a for a in arrays if _floating(a)])


def unflatten(vector: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``vector`` laid out as the floating-point arrays of ``like``, in their dtypes; the
    other arrays are copies of ``like``'s."""
    floating = iter(subspace.unflatten(vector, [a for a in like if _floating(a)]))
    return [
        next(floating).astype(np.asarray(a).dtype) if _floating(a) else np.array(a, copy=True)
        for a in like
    ]


def _floating(a: np.ndarray) -> bool:
    return np.issubdtype(np.asarray(a).dtype, np.floating)


def cosines(delta: np.ndarray, seed: int, canaries: int) -> np.ndarray:
    """``ρ_j = <c_j, Δ> / ‖Δ‖`` for every canary (0 when Δ = 0)."""
    norm = float(np.linalg.norm(delta))
    if norm == 0.0:
        return np.zeros(canaries)
    dim = delta.size
    return np.array([canary_direction(seed, j, dim) @ delta / norm for j in range(canaries)])


# -- the ε estimate (Andrew et al.) ----------------------------------------------------
def _mass(mu: float, sd: float, a: float, b: float, c: float) -> float:
    """P[a X² + b X + c > 0] for X ~ N(mu, sd²)."""

    def cdf(x: float) -> float:
        return float(special.ndtr((x - mu) / sd))

    if abs(a) < 1e-12 * max(abs(b), abs(c), 1.0):  # equal variances: a half-line
        if b == 0:
            return 1.0 if c > 0 else 0.0
        root = -c / b
        return 1.0 - cdf(root) if b > 0 else cdf(root)
    disc = b * b - 4 * a * c
    if disc <= 0:
        return 1.0 if a > 0 else 0.0
    r1, r2 = sorted(((-b - math.sqrt(disc)) / (2 * a), (-b + math.sqrt(disc)) / (2 * a)))
    inside = cdf(r2) - cdf(r1)
    return 1.0 - inside if a > 0 else inside


def _hockey_stick(p: tuple[float, float], q: tuple[float, float], eps: float) -> float:
    """δ(ε) = sup_A P(A) − e^ε Q(A) for Gaussians P = N(p), Q = N(q) (mean, sd)."""
    (m0, s0), (m1, s1) = p, q
    # log p(x) - log q(x) - eps > 0  <=>  a x^2 + b x + c > 0
    a = 1 / (2 * s1**2) - 1 / (2 * s0**2)
    b = m0 / s0**2 - m1 / s1**2
    c = m1**2 / (2 * s1**2) - m0**2 / (2 * s0**2) + math.log(s1 / s0) - eps
    return max(0.0, _mass(m0, s0, a, b, c) - math.exp(eps) * _mass(m1, s1, a, b, c))


def gaussian_pair_epsilon(
    null: tuple[float, float], alternative: tuple[float, float], delta: float
) -> float:
    """The smallest ε with δ(ε) ≤ ``delta`` in both directions between N(null) and
    N(alternative) (each a (mean, sd)): the (ε, δ) of the mechanism whose output is
    one draw of either Gaussian. Capped at ``EPSILON_CAP``."""
    if min(null[1], alternative[1]) <= 0:
        raise ValueError("both Gaussians need a positive standard deviation")

    def excess(eps: float) -> float:
        return max(_hockey_stick(null, alternative, eps), _hockey_stick(alternative, null, eps))

    if excess(0.0) <= delta:
        return 0.0
    if excess(EPSILON_CAP) > delta:
        return EPSILON_CAP
    from scipy import optimize

    return float(optimize.brentq(lambda e: excess(e) - delta, 0.0, EPSILON_CAP, xtol=1e-6))


def _fit(x: np.ndarray) -> tuple[float, float]:
    return float(np.mean(x)), float(np.std(x, ddof=1))


def _gdp_mu(inserted: np.ndarray, held_out: np.ndarray) -> float:
    """μ̂ = |mean_in − mean_out| / pooled σ (inf when every score is equal)."""
    (m1, s1), (m0, s0) = _fit(inserted), _fit(held_out)
    n1, n0 = len(inserted), len(held_out)
    pooled = math.sqrt(((n1 - 1) * s1**2 + (n0 - 1) * s0**2) / (n1 + n0 - 2))
    return abs(m1 - m0) / pooled if pooled > 0 else math.inf


def _gdp_epsilon(mu: float, delta: float) -> float:
    if not math.isfinite(mu):
        return EPSILON_CAP
    return gaussian_pair_epsilon((0.0, 1.0), (mu, 1.0), delta)


def estimate_epsilon(inserted: np.ndarray, held_out: np.ndarray, delta: float) -> float | None:
    """The estimate (module docstring): the ε at ``delta`` of N(μ_out, σ²) against
    N(μ_in, σ²) with σ² the pooled variance of both groups, i.e. of μ-Gaussian DP with
    μ = |μ_in − μ_out| / σ. None with fewer than 2 of either group."""
    if len(inserted) < 2 or len(held_out) < 2:
        return None
    return _gdp_epsilon(_gdp_mu(inserted, held_out), delta)


def estimate_interval(
    inserted: np.ndarray, held_out: np.ndarray, delta: float, level: float = 0.95
) -> tuple[float, float] | None:
    """The estimate's stated error: ε at μ̂ ∓ z·sqrt(1/n_in + 1/n_out), the normal
    interval of a difference of means in units of σ (``level``, two-sided). It is the
    sampling error of the estimate from this many canaries, not a privacy bound."""
    if len(inserted) < 2 or len(held_out) < 2:
        return None
    mu = _gdp_mu(inserted, held_out)
    spread = math.sqrt(1 / len(inserted) + 1 / len(held_out))
    from scipy import stats

    half = float(stats.norm.ppf(0.5 + level / 2)) * spread
    return _gdp_epsilon(max(0.0, mu - half), delta), _gdp_epsilon(mu + half, delta)


def estimate_epsilon_two_variances(
    inserted: np.ndarray, held_out: np.ndarray, delta: float
) -> float | None:
    """The ε at ``delta`` of the Gaussians fitted to each group with its own variance.
    Unstable with few canaries (a chance variance ratio makes the privacy loss grow
    without bound in the tails); reported beside ``estimate_epsilon``."""
    if len(inserted) < 2 or len(held_out) < 2:
        return None
    null, alternative = _fit(held_out), _fit(inserted)
    if min(null[1], alternative[1]) == 0.0:
        return EPSILON_CAP
    return gaussian_pair_epsilon(null, alternative, delta)


# -- the one-run lower bound (Steinke et al.) -------------------------------------------
def one_run_p_value(m: int, guesses: int, correct: int, eps: float, delta: float) -> float:
    """An upper bound on P[≥ ``correct`` of ``guesses`` right] for an (ε, δ)-DP mechanism
    with ``m`` canaries, each inserted independently with probability 1/2 (Steinke et al.
    2023, Theorem 5.2)."""
    if not 0 <= correct <= guesses <= m:
        raise ValueError(f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= m ({m})")
    q = float(special.expit(eps))  # the accuracy of eps-DP randomized response
    # P[Binomial(r, q) >= v - i] for i = 0..v in one call: scipy's per-call overhead is
    # most of an audit's cost (a root search evaluates this ~20 times per guess count).
    from scipy import stats

    i = np.arange(0, correct + 1)
    sf = stats.binom.sf(correct - i - 1, guesses, q)
    tail = float(sf[0])  # P[Binomial(r, q) >= v]
    if delta == 0 or correct == 0:
        return tail
    alpha = float(np.max((sf[1:] - tail) / i[1:]))
    return min(1.0, tail + alpha * delta * 2 * m)


def _largest_rejected(m: int, guesses: int, correct: int, delta: float, level: float) -> float:
    """The largest ε whose (ε, δ) claim ``v`` of ``r`` correct guesses rejects at ``level``
    (0 when it rejects none). The p-value grows with ε."""

    def margin(eps: float) -> float:
        return level - one_run_p_value(m, guesses, correct, eps, delta)

    if margin(0.0) <= 0:
        return 0.0
    if margin(EPSILON_CAP) > 0:
        return EPSILON_CAP
    from scipy import optimize

    return float(optimize.brentq(margin, 0.0, EPSILON_CAP, xtol=1e-6))


@dataclass
class LowerBound:
    epsilon: float
    guesses: int  # r: the top-r scores guessed "inserted"
    correct: int  # v: how many of them were
    tests: int  # guess counts tried (Bonferroni)
    threshold: float | None = None  # the r-th highest score: guesses are the scores >= it


def one_run_lower_bound(
    scores: np.ndarray, inserted: np.ndarray, delta: float, confidence: float
) -> LowerBound:
    """Steinke et al.'s ε lower bound at ``confidence`` from the canaries' ``scores``
    (higher: more likely inserted) and the truth ``inserted``; the best over the guess
    counts in ``GUESS_COUNTS`` up to m, Bonferroni-corrected over them."""
    scores, inserted = np.asarray(scores, dtype=float), np.asarray(inserted, dtype=bool)
    m = len(scores)
    counts = [r for r in GUESS_COUNTS if r <= m] or [m]
    level = (1.0 - confidence) / len(counts)
    ranked = inserted[np.argsort(-scores, kind="stable")]
    best = LowerBound(0.0, 0, 0, len(counts))
    for r in counts:
        v = int(ranked[:r].sum())
        eps = _largest_rejected(m, r, v, delta, level)
        if eps > best.epsilon:
            best = LowerBound(eps, r, v, len(counts), float(np.sort(scores)[::-1][r - 1]))
    return best


def largest_lower_bound(canaries: int, delta: float, confidence: float) -> float:
    """The bound the canaries would give if every inserted one scored above every held-out
    one (half of them inserted): what this many canaries can show at most."""
    truth = np.arange(canaries) < canaries // 2
    return one_run_lower_bound(-np.arange(canaries), truth, delta, confidence).epsilon


# -- the audit --------------------------------------------------------------------------
@dataclass
class AuditResult:
    """What ``audit.json`` holds."""

    canaries: int
    inserted: int
    confidence: float
    delta: float
    dimension: int
    epsilon_estimate: float | None
    epsilon_estimate_interval: tuple[float, float] | None  # its 95 % sampling error
    epsilon_estimate_two_variances: float | None
    epsilon_lower_bound: float
    epsilon_lower_bound_max: float  # what these canaries could show at most
    guesses: int
    correct_guesses: int
    threshold: float | None
    cosines_inserted: list[float]
    cosines_held_out: list[float]
    accountant_epsilon: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def exceeds(self) -> bool:
        """The lower bound is above the accountant's ε: a bug or a broken assumption
        (with probability at least ``confidence``)."""
        return self.accountant_epsilon is not None and (
            self.epsilon_lower_bound > self.accountant_epsilon + 1e-9
        )

    @property
    def estimate_exceeds(self) -> bool:
        """The estimate's whole sampling interval is above the accountant's ε (a warning:
        an estimate is not a bound)."""
        return (
            self.accountant_epsilon is not None
            and self.epsilon_estimate_interval is not None
            and self.epsilon_estimate_interval[0] > self.accountant_epsilon + 1e-9
        )

    def to_json(self) -> dict:
        doc = asdict(self)
        doc["exceeds_accountant"] = self.exceeds
        doc["estimate_exceeds_accountant"] = self.estimate_exceeds
        return doc


def audit(
    delta_vector: np.ndarray,
    *,
    seed: int,
    canaries: int,
    delta: float,
    confidence: float,
    accountant_epsilon: float | None = None,
) -> AuditResult:
    """Audit the final model delta ``delta_vector`` (``flatten(final) − flatten(initial)``)
    against the ``canaries`` of run ``seed`` (module docstring)."""
    scores = cosines(delta_vector, seed, canaries)
    truth = inclusion(seed, canaries)
    bound = one_run_lower_bound(scores, truth, delta, confidence)
    notes = []
    if truth.sum() < 2 or (~truth).sum() < 2:
        notes.append("fewer than 2 inserted or held-out canaries: no estimate")
    return AuditResult(
        canaries=canaries,
        inserted=int(truth.sum()),
        confidence=confidence,
        delta=delta,
        dimension=int(delta_vector.size),
        epsilon_estimate=estimate_epsilon(scores[truth], scores[~truth], delta),
        epsilon_estimate_interval=estimate_interval(scores[truth], scores[~truth], delta),
        epsilon_estimate_two_variances=estimate_epsilon_two_variances(
            scores[truth], scores[~truth], delta
        ),
        epsilon_lower_bound=bound.epsilon,
        epsilon_lower_bound_max=largest_lower_bound(canaries, delta, confidence),
        guesses=bound.guesses,
        correct_guesses=bound.correct,
        threshold=bound.threshold,
        cosines_inserted=[float(x) for x in scores[truth]],
        cosines_held_out=[float(x) for x in scores[~truth]],
        accountant_epsilon=accountant_epsilon,
        notes=notes,
    )
