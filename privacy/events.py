"""Private releases and the dp-accounting events that describe them.

Design notes: ``docs/notes.md``, ``privacy.events``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from numbers import Integral, Real
from typing import TYPE_CHECKING

from privacy.rdp_orders import RDP_ORDERS

# dp-accounting is imported where an event or accountant is built, not with this module:
# it loads SciPy's signal and optimize packages (~0.4 s), and a run without DP (the
# ServerApp and every ClientApp import this module through the ledger's types) never
# builds one (bench/BENCHMARKS.md, start-up).
if TYPE_CHECKING:
    import dp_accounting

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "without-replacement", "none")
MECHANISMS = ("gaussian", "laplace", "skellam")
# The parameters each mechanism's release takes (all others must be None).
_PARAMETERS = {
    "gaussian": ("noise_multiplier",),
    "laplace": ("laplace_epsilon",),
    "skellam": ("l2_sensitivity", "l1_sensitivity", "variance"),
}
# Each neighbouring relation by name, with its member of dp-accounting's
# ``NeighboringRelation`` (``neighboring_relation``).
NEIGHBORING_RELATIONS = {
    "add-or-remove-one": "ADD_OR_REMOVE_ONE",
    "replace-one": "REPLACE_ONE",
    # One client's contribution replaced by zero while it still takes part (Kairouz et
    # al. 2021, "Practical and private (deep) learning without sampling or shuffling";
    # dp-accounting's REPLACE_SPECIAL): the relation of local noise, where a client that
    # took part always sends its noise, so only its data may be neighbouring.
    "zero-out": "REPLACE_SPECIAL",
}
# The relation each sampling scheme is analysed under by default (module docstring).
REQUIRED_NEIGHBORING = {
    "poisson": "add-or-remove-one",
    "none": "add-or-remove-one",
    "without-replacement": "replace-one",
}
# Every relation each sampling scheme may be analysed under. dp-accounting amplifies
# Poisson sampling under REPLACE_SPECIAL as under add-or-remove-one, which holds when a
# zeroed-out client is indistinguishable from an absent one (noise added once by the
# server); the app's zero-out mechanism (Laplace) adds noise per client, so zero-out is
# charged without sampling ("none"). Sampling without replacement: REPLACE_ONE only.
ALLOWED_NEIGHBORING = {
    "poisson": ("add-or-remove-one",),
    "none": ("add-or-remove-one", "zero-out"),
    "without-replacement": ("replace-one",),
}

# PLD: dp-accounting's default value discretisation interval with its pessimistic
# (upper-bounding) discretisation: the reported ε is an upper bound, typically within
# ~1e-3 of the exact value for the regimes of federated learning.
PLD_DISCRETIZATION = 1e-4


class AccountingError(ValueError):
    """A release or ledger configuration that cannot be accounted as asked."""


# Why a combination is refused, and what to use instead; the refusal itself comes from
# dp-accounting's ``accountant.supports(event)``.
_HINTS = {
    ("pld", "without-replacement"): (
        "dp-accounting's PLD accountant has no SampledWithoutReplacementDpEvent; use "
        "accountant='rdp' (fixed-size sampling, replace-one) or sampling='poisson' with "
        "accountant='pld' (add-or-remove-one)"
    ),
    ("rdp", "poisson", "laplace"): (
        "dp-accounting's RDP accountant amplifies Poisson sampling only for Gaussian "
        "releases; use accountant='pld' (it supports Poisson-sampled Laplace) or "
        "sampling='none' (no amplification claimed)"
    ),
    ("rdp", "without-replacement", "laplace"): (
        "dp-accounting's RDP accountant amplifies sampling without replacement only for "
        "Gaussian releases (and PLD has no such event); use mechanism='gaussian', "
        "sampling='none' (no amplification), or sampling='poisson' with accountant='pld'"
    ),
}


def neighboring_name(neighboring: str | dp_accounting.NeighboringRelation) -> str:
    """The relation's name (a key of ``NEIGHBORING_RELATIONS``), given its name or
    dp-accounting's ``NeighboringRelation``."""
    if isinstance(neighboring, str):
        if neighboring in NEIGHBORING_RELATIONS:
            return neighboring
    else:
        import dp_accounting  # loaded already: the caller holds one of its enum members

        for name, member in NEIGHBORING_RELATIONS.items():
            if neighboring is dp_accounting.NeighboringRelation[member]:
                return name
    raise AccountingError(
        f"neighboring must be one of {sorted(NEIGHBORING_RELATIONS)}, got {neighboring!r}"
    )


def neighboring_relation(
    neighboring: str | dp_accounting.NeighboringRelation,
) -> dp_accounting.NeighboringRelation:
    """dp-accounting's ``NeighboringRelation`` of ``neighboring``."""
    import dp_accounting

    return dp_accounting.NeighboringRelation[NEIGHBORING_RELATIONS[neighboring_name(neighboring)]]


def l2_sensitivity_factor(neighboring: str | dp_accounting.NeighboringRelation) -> float:
    """How much one client moves a sum of updates clipped to norm C, in units of C.

    1 under add/remove-one (the client's update appears or disappears) and zero-out
    (it becomes zero), 2 under replace-one (‖u − u'‖ <= 2C). A release's noise
    multiplier is the noise std over the sensitivity: with noise std z·C it is
    z / factor. The same holds for L1.
    """
    return 2.0 if neighboring_name(neighboring) == "replace-one" else 1.0


l1_sensitivity_factor = l2_sensitivity_factor


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise AccountingError(f"{name} must be one of {list(choices)}, got {value!r}")


def _positive_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise AccountingError(f"{name} must be a finite number, got {value!r}")
    if value <= 0:
        raise AccountingError(f"{name} must be > 0, got {value!r}")
    return float(value)


def _int_at_least(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
        raise AccountingError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _text(name: str, value: object, *, empty: bool) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise AccountingError(f"{name} must be a{'' if empty else ' non-empty'} string")
    return value


@dataclass(frozen=True, kw_only=True)
class Release:
    """One private release (or ``count`` identical ones) charged to the ledger."""

    server_round: int
    """Round of the (first) release."""
    kind: str
    """What was released, free text: "model-update", "adaptive-clip-count", ..."""
    mechanism: str
    """"gaussian", "laplace" or "skellam"."""
    noise_multiplier: float | None = None
    """Gaussian: noise std / L2 sensitivity (under the ledger's neighbouring relation)."""
    laplace_epsilon: float | None = None
    """Laplace: L1 sensitivity / scale, the pure ε of one release."""
    l2_sensitivity: float | None = None
    """Skellam: one client's L2 bound in integer units (``SecureSumEncoding.l2_bound``)."""
    l1_sensitivity: float | None = None
    """Skellam: one client's L1 bound in integer units (``skellam.l1_bound``)."""
    variance: float | None = None
    """Skellam: per-coordinate variance of the summed shares (integer units)."""
    sampling: str
    """"poisson", "without-replacement" or "none" (no amplification claimed)."""
    sample_size: int
    """Clients per release (expected number for Poisson)."""
    population: int
    """Clients the sample is drawn from."""
    count: int = 1
    """Number of identical releases."""
    note: str = ""
    """Free text for the ledger file."""

    def __post_init__(self) -> None:
        def put(name, value):
            object.__setattr__(self, name, value)

        put("server_round", _int_at_least("server_round", self.server_round, 0))
        put("kind", _text("kind", self.kind, empty=False))
        _check_choice("mechanism", self.mechanism, MECHANISMS)
        takes = _PARAMETERS[self.mechanism]
        for other in (p for ps in _PARAMETERS.values() for p in ps if p not in takes):
            if getattr(self, other) is not None:
                raise AccountingError(
                    f"a {self.mechanism} release takes {', '.join(takes)}, not {other}"
                )
        for parameter in takes:
            put(parameter, _positive_real(parameter, getattr(self, parameter)))
        _check_choice("sampling", self.sampling, SAMPLINGS)
        put("sample_size", _int_at_least("sample_size", self.sample_size, 1))
        put("population", _int_at_least("population", self.population, 1))
        if self.sample_size > self.population:
            raise AccountingError(
                f"sample_size {self.sample_size} exceeds population {self.population}"
            )
        put("count", _int_at_least("count", self.count, 1))
        put("note", _text("note", self.note, empty=True))


def _check_relation(sampling: str, neighboring: str) -> None:
    required = REQUIRED_NEIGHBORING[sampling]
    if sampling != "none" and neighboring not in ALLOWED_NEIGHBORING[sampling]:
        why = {
            "poisson": "dp-accounting amplifies Poisson sampling for add/remove-one",
            "without-replacement": "dp-accounting's RDP supports "
            "SampledWithoutReplacementDpEvent only for REPLACE_ONE",
        }[sampling]
        raise AccountingError(
            f"sampling={sampling!r} is accounted under neighboring={required!r} ({why}); "
            f"got neighboring={neighboring!r}"
        )


def _check_skellam(accountant: str | None, neighboring: str, sampling: str) -> None:
    """Raise AccountingError unless a Skellam release can be accounted this way."""
    if accountant == "pld":
        raise AccountingError(
            "the distributed Skellam mechanism is accounted by its RDP bound (Agarwal et "
            "al. 2021) only; dp-accounting's PLD accountant does not know it: use "
            "dp.accountant = 'rdp'"
        )
    if sampling != "none":
        raise AccountingError(
            f"a Skellam release needs sampling='none', got {sampling!r}: no amplification "
            "by sampling is claimed for the distributed Skellam mechanism: the server that "
            "samples knows the sample"
        )
    if neighboring == "add-or-remove-one":
        raise AccountingError(
            "the distributed Skellam mechanism cannot be accounted under add-or-remove-one: "
            "each client adds a share of the noise, so removing a client also removes its "
            "share and the bound (a shift with the noise unchanged) does not apply; use "
            "neighboring='zero-out' (the client takes part and sends its share, its data "
            "is zeroed) or 'replace-one'"
        )


def to_dp_event(
    release: Release, neighboring: str | dp_accounting.NeighboringRelation
) -> dp_accounting.DpEvent:
    """The dp-accounting event of ``release`` (see the module docstring)."""
    import dp_accounting

    neighboring = neighboring_name(neighboring)
    _check_relation(release.sampling, neighboring)
    if release.mechanism == "skellam":
        # Imported here: privacy.skellam_accounting imports this module.
        from privacy.skellam_accounting import SkellamDpEvent

        _check_skellam(None, neighboring, release.sampling)
        factor = l2_sensitivity_factor(neighboring)
        # Release.__post_init__ requires all three for Skellam.
        assert release.l2_sensitivity is not None and release.l1_sensitivity is not None
        assert release.variance is not None
        event = SkellamDpEvent(
            l2_sensitivity=release.l2_sensitivity * factor,
            l1_sensitivity=release.l1_sensitivity * factor,
            variance=release.variance,
        )
    elif release.mechanism == "gaussian":
        event = dp_accounting.GaussianDpEvent(release.noise_multiplier)
    else:
        assert release.laplace_epsilon is not None  # required by Release.__post_init__
        event = dp_accounting.LaplaceDpEvent(1.0 / release.laplace_epsilon)
    if release.sampling == "poisson":
        q = release.sample_size / release.population
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    elif release.sampling == "without-replacement":
        event = dp_accounting.SampledWithoutReplacementDpEvent(
            release.population, release.sample_size, event
        )
    if release.count > 1:
        event = dp_accounting.SelfComposedDpEvent(event, release.count)
    return event


def unit_event(release: Release, neighboring: str) -> dp_accounting.DpEvent:
    """The event of one of the release's ``count`` identical releases."""
    return to_dp_event(replace(release, count=1), neighboring)


def new_accountant(
    accountant: str,
    neighboring: str,
    *,
    rdp_orders: tuple[float, ...] = RDP_ORDERS,
    pld_discretization: float = PLD_DISCRETIZATION,
    skellam: bool = True,
) -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant ("rdp" or "pld") for ``neighboring``; the RDP
    one also composes Skellam events unless ``skellam`` is false (dp-accounting's own,
    identical on every other event)."""
    _check_choice("accountant", accountant, ACCOUNTANTS)
    relation = neighboring_relation(neighboring)
    if accountant == "rdp" and not skellam:
        from dp_accounting.rdp import rdp_privacy_accountant

        return rdp_privacy_accountant.RdpAccountant(rdp_orders, relation)
    if accountant == "rdp":
        # Imported here: privacy.skellam_accounting imports this module.
        from privacy.skellam_accounting import SkellamRdpAccountant

        return SkellamRdpAccountant(rdp_orders, relation)
    from dp_accounting.pld import pld_privacy_accountant

    return pld_privacy_accountant.PLDAccountant(relation, pld_discretization)


@functools.lru_cache(maxsize=64)
def check_supported(accountant: str, neighboring: str, sampling: str, mechanism: str) -> None:
    """Raise AccountingError unless dp-accounting can account this combination.

    The decision is dp-accounting's own ``accountant.supports(event)`` on a probe
    release; the message says why and what to use instead. dp-accounting's accountants
    do not know the Skellam event: it is accounted by its own RDP curve, unsampled,
    under zero-out or replace-one (module docstring).
    """
    _check_choice("accountant", accountant, ACCOUNTANTS)
    _check_choice("sampling", sampling, SAMPLINGS)
    _check_choice("mechanism", mechanism, MECHANISMS)
    neighboring = neighboring_name(neighboring)
    _check_relation(sampling, neighboring)
    if mechanism == "skellam":
        _check_skellam(accountant, neighboring, sampling)
        return
    probe = Release(  # Gaussian or Laplace here: each takes one parameter
        server_round=0,
        kind="probe",
        mechanism=mechanism,
        sampling=sampling,
        sample_size=1,
        population=2,
        noise_multiplier=1.0 if mechanism == "gaussian" else None,
        laplace_epsilon=1.0 if mechanism == "laplace" else None,
    )
    probing = new_accountant(accountant, neighboring, skellam=False)  # not a Skellam probe
    if probing.supports(to_dp_event(probe, neighboring)):
        return
    hint = _HINTS.get((accountant, sampling)) or _HINTS.get((accountant, sampling, mechanism))
    raise AccountingError(
        f"accountant={accountant!r} cannot account mechanism={mechanism!r} with "
        f"sampling={sampling!r} (neighboring={neighboring!r}): "
        + (hint or "dp-accounting does not support this event")
    )
