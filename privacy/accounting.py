"""One privacy ledger for the whole run, over dp-accounting.

``PrivacyLedger`` records every private release of a run (training updates,
adaptive-clipping counts, sketches, across mechanisms), composes them with
dp-accounting's RDP or PLD accountant into one client-level (ε, δ), refuses a charge
that would exceed ``max_epsilon`` before changing anything, and serialises to JSON
(its ε is rebuilt on load by replaying the releases, so it is bit-identical).

What has no formal guarantee (e.g. per-batch clipping without noise) is recorded with
``PrivacyLedger.record_unaccounted`` and never given an ε; client-reported local
guarantees (DP-SGD, sample-level) are kept apart from the client-level ε.

Bookkeeping lives here; the events are built in ``privacy.events`` and composed in
``privacy.composition``.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from privacy import ledger_state
from privacy.events import (
    ACCOUNTANTS,
    MECHANISMS,
    NEIGHBORING_RELATIONS,
    PLD_DISCRETIZATION,
    RDP_ORDERS,
    REQUIRED_NEIGHBORING,
    SAMPLINGS,
    AccountingError,
    Release,
    check_supported,
    l1_sensitivity_factor,
    l2_sensitivity_factor,
    neighboring_name,
    to_dp_event,
    unit_event,
)
from privacy.ledger_state import LedgerConfig, LocalGuarantee, UnaccountedRelease

# dp-accounting (and privacy.composition, which builds on it) is imported where a release
# is charged or composed, not with this module: a run without DP imports the ledger's
# types but never charges it (privacy.events).
if TYPE_CHECKING:
    import dp_accounting

__all__ = [
    "ACCOUNTANTS",
    "FINE_CHECKPOINTS",
    "MECHANISMS",
    "NEIGHBORING_RELATIONS",
    "PLD_DISCRETIZATION",
    "RDP_ORDERS",
    "SAMPLINGS",
    "SPARSE_CHECKPOINTS",
    "AccountingError",
    "BudgetExceededError",
    "Checkpoints",
    "LocalGuarantee",
    "PrivacyLedger",
    "Release",
    "UnaccountedRelease",
    "l1_sensitivity_factor",
    "l2_sensitivity_factor",
    "to_dp_event",
]

_CACHE_SIZE = 4


class BudgetExceededError(AccountingError):
    """Charging the releases would take ε above ``max_epsilon``; nothing was charged."""

    def __init__(
        self,
        *,
        current_epsilon: float,
        projected_epsilon: float,
        max_epsilon: float,
        delta: float,
        releases: list[Release],
    ) -> None:
        self.current_epsilon = current_epsilon
        self.projected_epsilon = projected_epsilon
        self.max_epsilon = max_epsilon
        kinds = ", ".join(sorted({f"{r.kind} (round {r.server_round})" for r in releases}))
        super().__init__(
            f"charging {sum(r.count for r in releases)} release(s) [{kinds}] would raise ε "
            f"from {current_epsilon:.6g} to {projected_epsilon:.6g} at δ={delta:g}, above "
            f"max_epsilon={max_epsilon:g}; nothing was charged"
        )


def _as_list(releases: Release | Iterable[Release]) -> list[Release]:
    batch = [releases] if isinstance(releases, Release) else list(releases)
    for release in batch:
        if not isinstance(release, Release):
            raise TypeError(f"expected Release objects, got {type(release).__name__}")
    return batch


def _check_delta(delta: float) -> float:
    if isinstance(delta, bool) or not (isinstance(delta, float | int) and 0 < delta < 1):
        raise AccountingError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


def merged_groups(groups: dict, events: Iterable[tuple[dp_accounting.DpEvent, int]]) -> dict:
    """``groups`` (event -> total count, first-charge order) plus ``events``."""
    out = dict(groups)
    for event, count in events:
        out[event] = out.get(event, 0) + count
    return out


def _make_config(
    *, accountant, sampling, neighboring, rdp_orders, pld_discretization, **rest
) -> LedgerConfig:
    """The config with defaults filled in: relation from sampling, orders or interval."""
    if sampling not in SAMPLINGS:
        raise AccountingError(f"sampling must be one of {list(SAMPLINGS)}, got {sampling!r}")
    if neighboring is None:
        neighboring = REQUIRED_NEIGHBORING[sampling]
    if accountant == "rdp" and rdp_orders is None:
        rdp_orders = RDP_ORDERS
    if accountant == "pld" and pld_discretization is None:
        pld_discretization = PLD_DISCRETIZATION
    return LedgerConfig(
        accountant=accountant,
        sampling=sampling,
        neighboring=neighboring_name(neighboring),
        rdp_orders=None if rdp_orders is None else tuple(rdp_orders),
        pld_discretization=pld_discretization,
        **rest,
    )


@dataclass(frozen=True)
class Checkpoints:
    """Where a PLD ledger composes: each count up to ``exact`` as it is, every larger
    count rounded up to ``bits`` significant bits (at most 2^(1-bits) more releases)."""

    exact: int
    bits: int

    def round_up(self, count: int) -> int:
        """``count`` rounded up to this schedule's next checkpoint."""
        if count <= self.exact:
            return count
        step = 1 << max(0, count.bit_length() - self.bits)
        return -(-count // step) * step


# FINE: exact up to 128, then 7 significant bits (at most 1/64 more releases).
# SPARSE (the app's run ledger): 2 significant bits from the first count (1, 2, 3, 4, 6,
# 8, 12, 16, 24, ...: at most 1/2 more releases), two compositions per doubling of the
# count; the run's planned count is a checkpoint too (``PrivacyLedger.plan``).
# Rationale and measurements: docs/privacy.md, "The ledger's cost per round".
FINE_CHECKPOINTS = Checkpoints(exact=128, bits=7)
SPARSE_CHECKPOINTS = Checkpoints(exact=0, bits=2)


def _basic_epsilon(groups: dict) -> float | None:
    """Σ count·ε of Laplace events (basic composition; a sampled release is at most as
    private as unsampled), or None when any other event is present."""
    import dp_accounting  # loaded already: ``groups`` holds its events

    total = []
    for event, count in groups.items():
        if isinstance(event, dp_accounting.PoissonSampledDpEvent):
            event = event.event
        if not isinstance(event, dp_accounting.LaplaceDpEvent):
            return None
        total.append(count / event.noise_multiplier)  # parameter = scale/sensitivity = 1/ε
    return math.fsum(total)


class PrivacyLedger:
    """The run's privacy ledger.

    Parameters
    ----------
    accountant : {"rdp", "pld"}
        dp-accounting accountant composing the releases.
    target_delta : float
        δ at which ε is reported and the budget is enforced.
    max_epsilon : float or None
        Budget; a charge that would exceed it is refused. None: no limit.
    sampling : {"poisson", "without-replacement", "none"}
        How the run samples clients; releases use it or "none".
    neighboring : {"add-or-remove-one", "replace-one"}, optional
        Must match ``sampling`` (replace-one for fixed-size sampling); derived if omitted.
    mechanisms : tuple of str
        Mechanisms the run will release with, checked at construction.
    rdp_orders, pld_discretization : optional
        RDP orders (``privacy.events.RDP_ORDERS``), PLD interval (1e-4).

    Raises
    ------
    AccountingError
        If dp-accounting cannot account this accountant × sampling × mechanism.
    """

    def __init__(
        self,
        *,
        accountant: str,
        target_delta: float,
        max_epsilon: float | None = None,
        sampling: str,
        neighboring: str | dp_accounting.NeighboringRelation | None = None,
        mechanisms: tuple[str, ...] = ("gaussian",),
        rdp_orders: tuple[float, ...] | None = None,
        pld_discretization: float | None = None,
    ) -> None:
        self._config = _make_config(
            accountant=accountant,
            sampling=sampling,
            neighboring=neighboring,
            target_delta=target_delta,
            max_epsilon=max_epsilon,
            mechanisms=tuple(mechanisms),
            rdp_orders=rdp_orders,
            pld_discretization=pld_discretization,
        )
        for mechanism in self._config.mechanisms:
            check_supported(accountant, self.neighboring, sampling, mechanism)
        self._releases: list[Release] = []
        self._groups: dict[dp_accounting.DpEvent, int] = {}
        self._unaccounted: list[UnaccountedRelease] = []
        self._local: list[LocalGuarantee] = []
        self._cache: dict[tuple, tuple[Any, dict[float, float]]] = {}
        self._release_dicts: list[dict] = []  # asdict of each release (state_dict)
        self._planned: dict = {}  # event -> planned count (``plan``)
        # What one "client" is for the task that ran (set by the app; shown in summary).
        self.privacy_unit: str | None = None
        # dp.reproducible-noise: the noise and the DP sample derive from the run seed, so
        # no ε holds against anyone who knows it (set by the app; shown in summary).
        self.noise_from_seed = False
        # What is done with released outputs that costs no privacy (e.g. a server
        # optimizer): stated in the summary (set by the app's wrappers).
        self.post_processing: list[str] = []
        # PLD only: report the ε of each event's count rounded up to a checkpoint of this
        # schedule, a sound upper bound composed once per checkpoint, not every round
        # (set by the app for the run's ledger: SPARSE_CHECKPOINTS; docs/privacy.md).
        self.checkpoints: Checkpoints | None = None

    # -- configuration ------------------------------------------------------------
    @property
    def config(self) -> LedgerConfig:
        """The validated configuration."""
        return self._config

    accountant = property(lambda self: self._config.accountant, doc="'rdp' or 'pld'.")
    sampling = property(lambda self: self._config.sampling, doc="The run's sampling.")
    neighboring = property(lambda self: self._config.neighboring, doc="Neighbouring relation.")
    target_delta = property(lambda self: self._config.target_delta, doc="δ of the report.")
    max_epsilon = property(lambda self: self._config.max_epsilon, doc="Budget or None.")

    @property
    def releases(self) -> tuple[Release, ...]:
        """Charged releases, in charge order."""
        return tuple(self._releases)

    @property
    def unaccounted(self) -> tuple[UnaccountedRelease, ...]:
        """Releases with no formal guarantee (not covered by ε)."""
        return tuple(self._unaccounted)

    @property
    def local_guarantees(self) -> tuple[LocalGuarantee, ...]:
        """Client-reported guarantees, kept apart from the client-level ε."""
        return tuple(self._local)

    # -- composition --------------------------------------------------------------
    def _events(self, batch: list[Release]) -> list[tuple[dp_accounting.DpEvent, int]]:
        out = []
        for release in batch:
            if release.sampling not in (self.sampling, "none"):
                raise AccountingError(
                    f"release {release.kind!r} (round {release.server_round}) uses "
                    f"sampling={release.sampling!r} but this ledger accounts "
                    f"sampling={self.sampling!r} (or 'none')"
                )
            check_supported(self.accountant, self.neighboring, release.sampling, release.mechanism)
            out.append((unit_event(release, self.neighboring), release.count))
        return out

    def _cached(self, groups: dict) -> tuple[Any, dict[float, float]]:
        """The composition of ``groups`` and its ε by δ computed so far (memoised)."""
        key = tuple(groups.items())
        if key not in self._cache:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            from privacy.composition import compose_groups  # on use (above)

            composition = compose_groups(
                key,
                accountant=self.accountant,
                neighboring=self.neighboring,
                rdp_orders=self._config.rdp_orders,
                pld_discretization=self._config.pld_discretization,
            )
            self._cache[key] = (composition, {})
        return self._cache[key]

    def _composition(self, groups: dict):
        return self._cached(groups)[0]

    def _memo_epsilon(self, groups: dict, delta: float) -> float:
        """The accountant's ε at ``delta`` of exactly ``groups`` (memoised per δ)."""
        # A round asks the same ε up to four times (would_exceed, charge, epsilon,
        # summary); PLD's get_epsilon costs 10-80 ms, so it is computed once.
        composition, epsilons = self._cached(groups)
        if delta not in epsilons:
            epsilons[delta] = float(composition.get_epsilon(delta))
        return epsilons[delta]

    def _accountant_epsilon(self, groups: dict, delta: float) -> float:
        """The accountant's ε of ``groups``; with ``checkpoints`` (PLD), that of
        each count rounded up to a checkpoint, unless that exceeds ``max_epsilon`` at the
        target δ (the budget is then decided, and ε reported, without rounding)."""
        if self.checkpoints is not None and self.accountant == "pld":
            rounded = {event: self._checkpoint(event, count) for event, count in groups.items()}
            if rounded != groups and (
                self.max_epsilon is None
                or self._memo_epsilon(rounded, self.target_delta) <= self.max_epsilon
            ):
                return self._memo_epsilon(rounded, delta)
        return self._memo_epsilon(groups, delta)

    def _checkpoint(self, event, count: int) -> int:
        """``count`` rounded up to a checkpoint, never past a planned count it does not
        exceed."""
        assert self.checkpoints is not None
        rounded = self.checkpoints.round_up(count)
        planned = self._planned.get(event)
        return min(rounded, planned) if planned is not None and count <= planned else rounded

    def plan(self, releases: Release | Iterable[Release]) -> None:
        """Declare the run's planned releases (e.g. those calibrated to a target ε): a
        checkpoint never rounds a count past its planned total, so the planned run's
        last round reports its exact ε."""
        self._planned = merged_groups({}, self._events(_as_list(releases)))

    def _epsilon_of(self, groups: dict, delta: float) -> float:
        """ε at ``delta`` of ``groups``: the accountant's, or basic composition's pure ε
        when that is smaller (Laplace only: a pure ε-DP release is (ε, δ)-DP for every
        δ, and the accountant's discretised bound can exceed Σ ε by a hair)."""
        if not groups:
            return 0.0
        epsilon = self._accountant_epsilon(groups, delta)
        basic = _basic_epsilon(groups)
        return epsilon if basic is None else min(epsilon, basic)

    def accountant_epsilon(self, delta: float | None = None) -> float:
        """The accountant's own ε at ``delta`` (default: target δ), before the minimum
        with basic composition that ``epsilon`` takes for Laplace releases."""
        if not self._groups:
            return 0.0
        delta = _check_delta(self.target_delta if delta is None else delta)
        return self._accountant_epsilon(self._groups, delta)

    def epsilon(self, delta: float | None = None) -> float:
        """Cumulative ε at ``delta`` (default: target δ); 0.0 when nothing is charged."""
        return self._epsilon_of(
            self._groups, _check_delta(self.target_delta if delta is None else delta)
        )

    def delta_for(self, epsilon: float) -> float:
        """Cumulative δ at ``epsilon``; 0.0 when nothing is charged."""
        if isinstance(epsilon, bool) or not (math.isfinite(epsilon) and epsilon >= 0):
            raise AccountingError(f"epsilon must be finite and >= 0, got {epsilon!r}")
        if not self._groups:
            return 0.0
        return float(self._composition(self._groups).get_delta(float(epsilon)))

    def delta_curve(self, epsilons: Iterable[float]) -> list[float]:
        """``delta_for`` at each of ``epsilons`` (ascending), in one pass: RDP's values
        bit for bit; PLD's an upper bound on each within ~1e-12 (``privacy.fast_pld``)."""
        grid = [float(e) for e in epsilons]
        for e in grid:
            if not (math.isfinite(e) and e >= 0):
                raise AccountingError(f"epsilon must be finite and >= 0, got {e!r}")
        if any(b < a for a, b in itertools.pairwise(grid)):
            raise AccountingError("epsilons must be in ascending order")
        if not self._groups:
            return [0.0] * len(grid)
        from privacy.composition import delta_curve_of  # on use (above)

        return [float(d) for d in delta_curve_of(self._composition(self._groups), grid)]

    def would_exceed(self, releases: Release | Iterable[Release]) -> bool:
        """Whether charging ``releases`` would take ε above ``max_epsilon`` (no change)."""
        groups = merged_groups(self._groups, self._events(_as_list(releases)))
        if self.max_epsilon is None:
            return False
        return self._epsilon_of(groups, self.target_delta) > self.max_epsilon

    def charge(self, releases: Release | Iterable[Release]) -> None:
        """Compose ``releases`` into the ledger.

        Raises
        ------
        BudgetExceededError
            Before changing anything, if the projected ε would exceed ``max_epsilon``.
        AccountingError
            If a release cannot be accounted by this ledger.
        """
        batch = _as_list(releases)
        groups = merged_groups(self._groups, self._events(batch))
        if self.max_epsilon is not None:
            projected = self._epsilon_of(groups, self.target_delta)
            if projected > self.max_epsilon:
                raise BudgetExceededError(
                    current_epsilon=self.epsilon(),
                    projected_epsilon=projected,
                    max_epsilon=self.max_epsilon,
                    delta=self.target_delta,
                    releases=batch,
                )
        self._releases.extend(batch)
        self._groups = groups

    def basic_composition_epsilon(self) -> float | None:
        """Σ count·ε of the Laplace releases (pure ε, basic composition, no amplification).

        None when a Gaussian or Skellam release is present (it has no pure ε).
        """
        return _basic_epsilon(self._groups) if self._releases else None

    # -- what ε does not cover ----------------------------------------------------
    def record_unaccounted(
        self, server_round: int, kind: str, reason: str, details: dict | None = None
    ) -> UnaccountedRelease:
        """Record a release with NO formal privacy guarantee; it never gets an ε."""
        entry = UnaccountedRelease(
            server_round=server_round, kind=kind, reason=reason, details=details or {}
        )
        self._unaccounted.append(entry)
        return entry

    def record_local_guarantee(
        self,
        server_round: int,
        *,
        client: str,
        epsilon: float,
        delta: float,
        unit: str = "sample-level",
    ) -> LocalGuarantee:
        """Record a client-reported guarantee (e.g. DP-SGD), kept apart from ε."""
        entry = LocalGuarantee(
            server_round=server_round, client=client, epsilon=epsilon, delta=delta, unit=unit
        )
        self._local.append(entry)
        return entry

    # -- serialisation ------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-serialisable state: config, releases, unaccounted, local guarantees."""
        # The releases never change once charged: each is turned into a dict once (asdict
        # of 1 000 releases costs ~10 ms, and the app saves the state every round).
        cache = self._release_dicts
        cache.extend(asdict(r) for r in self._releases[len(cache) :])
        state = ledger_state.dump(self._config, (), self._unaccounted, self._local)
        state["releases"] = [dict(d) for d in cache]
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> PrivacyLedger:
        """Rebuild a ledger from ``state_dict``, replaying its releases.

        Raises
        ------
        AccountingError
            If the state is malformed, of another schema version, or inconsistent.
        """
        config, releases, unaccounted, local = ledger_state.load(state)
        ledger = cls(**asdict(config))
        ledger._groups = merged_groups({}, ledger._events(releases))  # history: no budget check
        ledger._releases = list(releases)
        ledger._unaccounted, ledger._local = list(unaccounted), list(local)
        return ledger

    def load_state_dict(self, state: dict) -> None:
        """Restore a saved state into this ledger; its config must equal this one's."""
        other = PrivacyLedger.from_state_dict(state)
        ledger_state.check_same_config(saved=other.config, current=self._config)
        self._releases, self._groups = other._releases, other._groups
        self._unaccounted, self._local = other._unaccounted, other._local
        self._cache = {}
        self._release_dicts = []

    def summary(self) -> dict:
        """The human-readable record for ``ledger.json``.

        ``epsilon`` is ``None`` (JSON null) when the run released something without a
        client-level accounting (only unaccounted releases or client-reported
        sample-level guarantees): no client-level epsilon exists, and 0 would claim
        perfect privacy. With nothing released at all it is 0.
        """
        epsilon = self.epsilon()
        basic = self.basic_composition_epsilon()
        released_unaccounted = bool(self._unaccounted or self._local)
        shown = None if not self._releases and released_unaccounted else epsilon
        by_kind: Counter[str] = Counter()
        for release in self._releases:
            by_kind[release.kind] += release.count
        return {
            "accountant": self.accountant,
            "sampling": self.sampling,
            "neighboring-relation": self.neighboring,
            "target-delta": self.target_delta,
            "privacy-unit": self.privacy_unit,
            "noise-from-seed": self.noise_from_seed,
            "epsilon": shown,
            "max-epsilon": self.max_epsilon,
            "num-releases": sum(by_kind.values()),
            "releases-by-kind": dict(by_kind),
            "basic-composition-epsilon": basic if shown is not None else None,
            "unaccounted": [asdict(u) for u in self._unaccounted],
            "local-guarantees": [asdict(g) for g in self._local],
            "statements": ledger_state.statements(self, epsilon, basic),
        }
