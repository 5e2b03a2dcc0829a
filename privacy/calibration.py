"""Noise calibration: the smallest Gaussian noise multiplier within an ε budget.

The noise multiplier here is the app's ``dp.noise-multiplier``: z = std of the noise on
the sum of client updates / clip norm C. One client moves that sum by C under
add/remove-one but by 2C under replace-one (fixed-size sampling without replacement),
so each release is accounted with z / ``l2_sensitivity_factor``,
exactly as the DP-FedAvg strategy charges its ledger.

``rounds`` identical releases are described by the ledger's own event construction
(``privacy.events.to_dp_event`` of one ``Release`` with
``count=rounds``) and calibrated with dp-accounting's
``mechanism_calibration.calibrate_dp_mechanism`` (Brent's method, returning a value
whose ε is guaranteed not to exceed the target). ``epsilon_for`` charges the same
release to a fresh ``PrivacyLedger``.
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

    The releases become one composed dp-accounting event, calibrated by dp-accounting's
    ``mechanism_calibration.calibrate_dp_mechanism`` (its bisection returns a p whose ε
    does not exceed the target) inside a bracket found by doubling or halving from 1.

    Raises
    ------
    AccountingError
        If the releases cannot be accounted or the target cannot be met.
    """
    _check_targets(target_epsilon, target_delta)
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

    low, high = _bracket(
        lambda p: fresh().compose(event(p)).get_epsilon(target_delta), target_epsilon
    )
    interval = mechanism_calibration.ExplicitBracketInterval(low, high)
    if tolerance is None:
        # Relative: the result is the bracket's private end, so its ε never exceeds the
        # target; a PLD evaluation of a whole run costs ~0.5 s, 1e-4 of p needs ~14.
        tolerance = max(_TOLERANCE, 1e-4 * low)
    return float(
        mechanism_calibration.calibrate_dp_mechanism(
            fresh, event, target_epsilon, target_delta, bracket_interval=interval, tol=tolerance
        )
    )


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

    accountant = new_accountant("rdp", "add-or-remove-one", rdp_orders=RDP_ORDERS)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orders near 1 that do not converge are dropped, noisily
    try:
        for z, q, steps in history:
            if steps > 0:
                event = dp_accounting.GaussianDpEvent(z)
                if q < 1:
                    event = dp_accounting.PoissonSampledDpEvent(q, event)
                accountant.compose(event, int(steps))
        return float(accountant.get_epsilon(target_delta))
    finally:
        absl.setLevel(level)
