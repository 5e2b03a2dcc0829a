"""Noise calibration: the smallest Gaussian noise multiplier within an ε budget.

The noise multiplier here is the app's ``dp.noise-multiplier``: z = std of the noise on
the sum of client updates / clip norm C. One client moves that sum by C under
add/remove-one but by 2C under replace-one (fixed-size sampling without replacement),
so each release is accounted with z / ``l2_sensitivity_factor``,
exactly as the DP-FedAvg strategy charges its ledger.

``rounds`` identical releases are described by the ledger's own event construction
(``privacy.events.to_dp_event`` of one ``Release`` with ``count=rounds``) and
calibrated: under RDP with dp-accounting's ``mechanism_calibration.calibrate_dp_mechanism``
(Brent's method, returning a value whose ε is guaranteed not to exceed the target), under
PLD on coarse PLDs checked at the ledger's discretisation (``_calibrate_pld``; why and
how fast: docs/engine.md). ``epsilon_for`` charges the same release to a fresh
``PrivacyLedger``.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

from privacy.accounting import PrivacyLedger
from privacy.events import (
    PLD_DISCRETIZATION,
    RDP_ORDERS,
    REQUIRED_NEIGHBORING,
    AccountingError,
    Release,
    check_supported,
    l2_sensitivity_factor,
    new_accountant,
    to_dp_event,
    unit_event,
)

# Bracket search: z from 1 doubles up to 2**14 or halves down to 2**-6. Searching from
# z = 1 (rather than dp-accounting's default, up from 0) never evaluates a PLD at a
# tiny z, whose privacy-loss range (and memory) explodes.
_MAX_DOUBLINGS = 14
_MAX_HALVINGS = 6
_TOLERANCE = 1e-6  # absolute, in noise-multiplier units


def accounted_noise_multiplier(noise_multiplier: float, sampling: str) -> float:
    """z / sensitivity factor of the relation ``sampling`` is analysed under (z/2 or z)."""
    if sampling not in REQUIRED_NEIGHBORING:
        raise AccountingError(
            f"sampling must be one of {list(REQUIRED_NEIGHBORING)}, got {sampling!r}"
        )
    return noise_multiplier / l2_sensitivity_factor(REQUIRED_NEIGHBORING[sampling])


def _release(
    noise_multiplier: float, *, rounds: int, sample_size: int, population: int, sampling: str
) -> Release:
    return Release(
        server_round=0,
        kind="calibration",
        mechanism="gaussian",
        noise_multiplier=accounted_noise_multiplier(noise_multiplier, sampling),
        sampling=sampling,
        sample_size=sample_size,
        population=population,
        count=rounds,
    )


def _bracket(epsilon_at, target_epsilon: float) -> tuple[float, float]:
    """(low, high) with ε(low) > target >= ε(high), by doubling or halving from 1."""
    z = 1.0
    if epsilon_at(z) > target_epsilon:
        for _ in range(_MAX_DOUBLINGS):
            if epsilon_at(2 * z) <= target_epsilon:
                return z, 2 * z
            z *= 2
        raise AccountingError(
            f"target_epsilon={target_epsilon:g} is unreachable: even noise multiplier "
            f"{z:g} gives epsilon={epsilon_at(z):.6g} (RDP cannot go below about "
            "log(1/delta)/(largest order - 1)); raise the target, lower the rounds, or use "
            "accountant='pld'"
        )
    for _ in range(_MAX_HALVINGS):
        if epsilon_at(z / 2) > target_epsilon:
            return z / 2, z
        z /= 2
    raise AccountingError(
        f"target_epsilon={target_epsilon:g} is so loose that noise multiplier {z:g} already "
        "meets it; no meaningful calibration (lower the target)"
    )


def _check_targets(target_epsilon: float, target_delta: float) -> None:
    if isinstance(target_epsilon, bool) or not (
        math.isfinite(target_epsilon) and target_epsilon > 0
    ):
        raise AccountingError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}")
    if not 0 < target_delta < 1:
        raise AccountingError(f"target_delta must be in (0, 1), got {target_delta!r}")


def calibrate_parameter(
    releases_for: Callable[[float], list[Release]],
    *,
    target_epsilon: float,
    target_delta: float,
    accountant: str,
    neighboring: str,
    tolerance: float | None = None,
) -> float:
    """The smallest noise parameter p whose releases ``releases_for(p)`` (a whole run,
    more private as p grows: a noise multiplier, a Laplace scale) stay within
    ``target_epsilon`` at ``target_delta`` under ``accountant``.

    RDP: the releases become one composed dp-accounting event, calibrated by
    dp-accounting's ``mechanism_calibration.calibrate_dp_mechanism`` (its bisection
    returns a p whose ε does not exceed the target) inside a bracket found by doubling
    or halving from 1. PLD: ``_calibrate_pld`` (coarse PLDs, then the ledger's own).

    Raises
    ------
    AccountingError
        If the releases cannot be accounted or the target cannot be met.
    """
    _check_targets(target_epsilon, target_delta)
    if accountant == "pld":
        return _calibrate_pld(
            releases_for,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            neighboring=neighboring,
        )
    # Imported on use, as in privacy.events: it loads SciPy's optimize and signal.
    import dp_accounting
    from dp_accounting import mechanism_calibration

    def event(parameter: float):
        return dp_accounting.ComposedDpEvent(
            [to_dp_event(r, neighboring) for r in releases_for(parameter)]
        )

    def fresh():
        return new_accountant(
            accountant, neighboring, rdp_orders=RDP_ORDERS, pld_discretization=PLD_DISCRETIZATION
        )

    # dp-accounting's calibration evaluates the bracket's ends again, and its root once
    # more: each parameter's epsilon (composing its event, the whole cost) is computed
    # once and handed to it through _KnownEpsilons.
    epsilons: dict[float, float] = {}

    def epsilon_at(parameter: float) -> float:
        if parameter not in epsilons:
            epsilons[parameter] = fresh().compose(event(parameter)).get_epsilon(target_delta)
        return epsilons[parameter]

    low, high = _bracket(epsilon_at, target_epsilon)
    interval = mechanism_calibration.ExplicitBracketInterval(low, high)
    if tolerance is None:
        tolerance = max(_TOLERANCE, 1e-4 * low)
    return float(
        mechanism_calibration.calibrate_dp_mechanism(
            lambda: _KnownEpsilons(epsilon_at, target_delta),
            float,  # the "event" _KnownEpsilons composes: the parameter itself
            target_epsilon,
            target_delta,
            bracket_interval=interval,
            tol=tolerance,
        )
    )


class _KnownEpsilons:
    """The fresh accountant dp-accounting's calibration asks for (an empty ledger,
    ``compose``, ``get_epsilon``), answering with the memoised ``epsilon_at``."""

    def __init__(self, epsilon_at: Callable[[float], float], target_delta: float) -> None:
        import dp_accounting

        self.ledger = dp_accounting.NoOpDpEvent()
        self._epsilon_at, self._delta = epsilon_at, target_delta
        self._parameter: float | None = None

    def compose(self, parameter: float) -> _KnownEpsilons:
        if self._parameter is not None:
            raise AccountingError("calibration composes one event per fresh accountant")
        self._parameter = float(parameter)
        return self

    def get_epsilon(self, target_delta: float) -> float:
        if self._parameter is None:
            raise AccountingError("epsilon asked of calibration before a compose")
        if target_delta != self._delta:
            raise AccountingError(f"calibration at delta={self._delta}, asked at {target_delta}")
        return self._epsilon_at(self._parameter)


# PLD calibration (``_calibrate_pld``): the search runs on PLDs discretised this many
# times more coarsely than the ledger's, then the ledger's own discretisation checks it.
_COARSE, _FINER = 40, 20
_MARGIN = 1e-4  # relative: the search aims this far below the target
_MAX_STEPS = 60  # root-finding steps per search


def _groups(releases: list[Release], neighboring: str) -> tuple:
    """The releases as the ledger groups them: (one release's event, total count)."""
    from privacy.accounting import merged_groups

    return tuple(
        merged_groups({}, ((unit_event(r, neighboring), r.count) for r in releases)).items()
    )


@functools.lru_cache(maxsize=256)
def _pld_epsilon(groups: tuple, neighboring: str, discretization: float, delta: float) -> float:
    """ε at ``delta`` of ``groups`` composed as the ledger composes them under PLD
    (``privacy.composition.compose_groups``), memoised: the same workload calibrated
    again in this process (a sweep's next seed) costs no PLD."""
    from privacy.composition import compose_groups

    composition = compose_groups(
        groups,
        accountant="pld",
        neighboring=neighboring,
        rdp_orders=RDP_ORDERS,
        pld_discretization=discretization,
    )
    return float(composition.get_epsilon(delta))


def _calibrate_pld(
    releases_for: Callable[[float], list[Release]],
    *,
    target_epsilon: float,
    target_delta: float,
    neighboring: str,
) -> float:
    """PLD calibration in a few coarse evaluations and one at the ledger's grid.

    A PLD's cost grows with its number of points (1/discretisation) plus a fixed cost per
    self-composition, so the search runs on PLDs 40x and 20x coarser than the ledger's:
    the secant method on (log p, log ε_40) from p = 1 to 1 %, then Newton steps (with
    that slope) on the estimate ε_20 - (ε_40 - ε_20)/3 of the ledger's ε (a pessimistic
    grid's excess shrinks about as the square of its interval: docs/engine.md), aiming
    ``_MARGIN`` below the target; about 6 coarse PLDs. The result is then checked at the
    ledger's own discretisation with the ledger's composition, whose PLD the run's first
    charge reuses (cached in ``privacy.composition.event_pld``), and raised in growing
    steps until it holds: ε <= target always, whatever the estimate.
    """

    def epsilon_at(p: float, factor: int) -> float:
        groups = _groups(releases_for(p), neighboring)
        return _pld_epsilon(groups, neighboring, PLD_DISCRETIZATION * factor, target_delta)

    def coarse(p: float) -> float:
        return epsilon_at(p, _COARSE)

    def estimate(p: float) -> float:
        coarse_, finer = coarse(p), epsilon_at(p, _FINER)
        return max(finer - (coarse_ - finer) / 3, 1e-12)

    aim = target_epsilon * (1 - _MARGIN)
    first = coarse(1.0)
    found = _loglog_secant(coarse, target_epsilon, 1.0, first, first / target_epsilon, 1e-2)
    if found is None:  # not a smooth power law here: bracket and regula falsi
        low, high = _bracket(coarse, target_epsilon)
        low, high = _secant(coarse, target_epsilon, low, high, 2e-3)
        found = high, math.log(coarse(high) / coarse(low)) / math.log(high / low)
    # Newton steps on the estimate, with the coarse curve's slope d log ε / d log p
    # (the two differ by a nearly constant ratio near the root), from above the aim.
    p, slope = found
    slope = min(slope, -1e-3)
    for _ in range(6):
        reached = estimate(p)
        if reached <= aim and math.log(aim / reached) < 2e-4:
            break
        p *= math.exp((math.log(aim) - math.log(reached)) / slope) * (1 + 2e-5)
    step = _MARGIN
    for _ in range(20):  # up to p * (1 + 1e-4 * 2**20) ~ p * 100
        if epsilon_at(p, 1) <= target_epsilon:
            return p
        p, step = p * (1 + step), step * 2
    raise AccountingError(
        f"no noise parameter up to {p:.6g} meets target_epsilon={target_epsilon:g} at the "
        f"ledger's PLD discretisation (the search found {found[0]:.6g} on coarser ones)"
    )


def _loglog_secant(epsilon_at, target: float, p0: float, e0: float, p1: float, tolerance):
    """The p with ε(p) = target by the secant method on (log p, log ε), from p0 (whose ε
    is e0) and p1, to a relative step of ``tolerance``; None where it does not converge
    within the search range in 12 steps; else (p, the last secant's slope). Only a
    starting point: the caller confirms."""
    low, high = 2.0**-_MAX_HALVINGS, 2.0**_MAX_DOUBLINGS
    if not (math.isfinite(e0) and e0 > 0 and low <= p1 <= high):
        return None
    x0, g0 = math.log(p0), math.log(e0) - math.log(target)
    x1 = math.log(p1)
    for _ in range(12):
        e1 = epsilon_at(math.exp(x1))
        if not (math.isfinite(e1) and e1 > 0):
            return None
        g1 = math.log(e1) - math.log(target)
        if g1 == g0:
            return None
        if abs(x1 - x0) <= tolerance:
            return math.exp(x1), (g1 - g0) / (x1 - x0)
        x2 = x1 - g1 * (x1 - x0) / (g1 - g0)
        x2 = min(max(x2, x1 - 0.7), x1 + 0.7)  # at most a factor 2 per step
        if not math.log(low) <= x2 <= math.log(high):
            return None
        x0, g0, x1 = x1, g1, x2
    return None


def _secant(epsilon_at, target: float, low: float, high: float, tolerance: float):
    """(low, high) with ε(low) > target >= ε(high) and high/low - 1 <= ``tolerance``:
    regula falsi on (log p, log ε) with the Illinois modification (a stalled end's value
    halved), which keeps the bracket and converges superlinearly on this smooth,
    decreasing curve."""
    log_target = math.log(target)
    f_low = math.log(epsilon_at(low)) - log_target
    f_high = math.log(epsilon_at(high)) - log_target
    side = 0
    for _ in range(_MAX_STEPS):
        if high / low - 1 <= tolerance:
            break
        a, b = math.log(low), math.log(high)
        x = b - f_high * (b - a) / (f_high - f_low)
        # Safeguard: stay strictly inside, and no closer to an end than 1/8 of tolerance.
        margin = tolerance / 8
        x = min(max(x, a + margin), b - margin)
        p = math.exp(x)
        f = math.log(epsilon_at(p)) - log_target
        if f > 0:
            low, f_low = p, f
            if side == -1:
                f_high /= 2
            side = -1
        else:
            high, f_high = p, f
            if side == 1:
                f_low /= 2
            side = 1
    return low, high


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    rounds: int,
    sample_size: int,
    population: int,
    sampling: str,
    accountant: str,
) -> float:
    """Smallest z whose ε after ``rounds`` Gaussian releases is <= ``target_epsilon``.

    z is noise std on the sum / clip norm C (see the module docstring).

    Returns
    -------
    float
        z within 1e-6 of the optimum, with ε(z) <= target_epsilon.

    Raises
    ------
    AccountingError
        If the combination cannot be accounted or the target cannot be met.
    """
    _check_targets(target_epsilon, target_delta)
    neighboring = REQUIRED_NEIGHBORING.get(sampling, "")
    check_supported(accountant, neighboring, sampling, "gaussian")
    release_of = functools.partial(
        _release, rounds=rounds, sample_size=sample_size, population=population, sampling=sampling
    )
    release_of(1.0)  # validates rounds and sizes before searching
    return calibrate_parameter(
        lambda z: [release_of(z)],
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        accountant=accountant,
        neighboring=neighboring,
        tolerance=_TOLERANCE,
    )


def epsilon_for(
    *,
    noise_multiplier: float,
    target_delta: float,
    rounds: int,
    sample_size: int,
    population: int,
    sampling: str,
    accountant: str,
) -> float:
    """ε after ``rounds`` releases with noise std z·C on the sum, from a fresh ledger."""
    ledger = PrivacyLedger(accountant=accountant, target_delta=target_delta, sampling=sampling)
    release = _release(
        noise_multiplier,
        rounds=rounds,
        sample_size=sample_size,
        population=population,
        sampling=sampling,
    )
    ledger.charge(release)
    return ledger.epsilon()


def sampled_gaussian_epsilon(
    history: list[tuple[float, float, int]], *, target_delta: float
) -> float:
    """ε at ``target_delta`` of DP-SGD steps ``[(noise_multiplier, sample_rate, steps)]``.

    Each step is dp-accounting's ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` under
    add-or-remove-one (one example), composed by its RDP accountant over the ledger's
    orders: the analysis Opacus' RDP accountant implements (Mironov, Talwar & Zhang
    2019). The server uses it to re-derive a client's sample-level ε from the steps it
    knows the client took, whatever the client's own accountant says.
    """
    _check_targets(1.0, target_delta)
    import dp_accounting  # on use, as in privacy.events

    from privacy.composition import compose_rdp

    groups = []
    for z, q, steps in history:
        if steps > 0:
            event = dp_accounting.GaussianDpEvent(z)
            if q < 1:
                event = dp_accounting.PoissonSampledDpEvent(q, event)
            groups.append((event, int(steps)))
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orders near 1 that do not converge are dropped, noisily
    try:
        # The accountant's sum of count x curve, with each step's curve memoised
        # (``event_rdp_curve``): the server re-derives every client's ε each round from
        # the same few (z, q), ~0.2 s of RDP at fractional orders each time otherwise.
        return float(
            compose_rdp(groups, "add-or-remove-one", RDP_ORDERS).get_epsilon(target_delta)
        )
    finally:
        absl.setLevel(level)
