"""Composition of grouped dp-accounting events into one (ε, δ) curve.

The ledger groups identical events (composition is commutative) and composes each
group once with its total count: ``compose(event, count)``. For PLD this is essential:
dp-accounting builds a subsampled-Gaussian PLD in ~0.3 s and self-composes it in
milliseconds, whereas composing round by round costs a PLD construction and a
convolution per round. The result depends only on the groups, in first-charge order,
so replaying a saved ledger gives a bit-identical ε.

Design notes: ``docs/notes.md``, ``privacy.composition``.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import dp_accounting
import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import common, privacy_loss_distribution, privacy_loss_mechanism
from dp_accounting.rdp import rdp_privacy_accountant

from privacy.events import neighboring_name, neighboring_relation, new_accountant
from privacy.skellam import skellam_rdp

Groups = tuple[tuple[dp_accounting.DpEvent, int], ...]


# One curve per (event, relation, orders): len(RDP_ORDERS) = 184 float64, about 1.5 KB
# each, so 4096 curves take ~6 MB. 512 thrashed in a ledger with one new event per
# round (e.g. a noise multiplier changing every round) after 512 rounds.
@functools.lru_cache(maxsize=4096)
def event_rdp_curve(
    event: dp_accounting.DpEvent, neighboring: str, orders: tuple[float, ...]
) -> np.ndarray:
    """The RDP curve of one event at ``orders``, from dp-accounting (read-only).

    A ``SkellamDpEvent`` (its sensitivities already under the
    relation), alone or self-composed, gets ``skellam_rdp``.
    """
    count, inner = 1, event
    if isinstance(event, dp_event.SelfComposedDpEvent):
        count, inner = event.count, event.event
    # A Skellam event exists only once its module is imported: a run without the Skellam
    # mechanism never imports it (nor its dp-accounting subclasses) to ask.
    skellam = sys.modules.get("privacy.skellam_accounting")
    if skellam is not None and isinstance(inner, skellam.SkellamDpEvent):
        curve = count * skellam_rdp(
            orders, inner.l2_sensitivity, inner.l1_sensitivity, inner.variance
        )
        curve.setflags(write=False)
        return curve
    accountant = rdp_privacy_accountant.RdpAccountant(orders, neighboring_relation(neighboring))
    curve = accountant.compose(event).rdp
    curve.setflags(write=False)
    return curve


@dataclass(frozen=True, eq=False)
class RdpComposition:
    """A composed RDP curve with dp-accounting's (ε, δ) conversions."""

    orders: np.ndarray
    rdp: np.ndarray

    def get_epsilon(self, target_delta: float) -> float:
        """ε at δ (dp-accounting's ``compute_epsilon``, Canonne et al. 2020 conversion)."""
        epsilon, _ = rdp_privacy_accountant.compute_epsilon(self.orders, self.rdp, target_delta)
        return float(epsilon)

    def get_delta(self, target_epsilon: float) -> float:
        """δ at ε (dp-accounting's ``compute_delta``)."""
        delta, _ = rdp_privacy_accountant.compute_delta(self.orders, self.rdp, target_epsilon)
        return float(delta)

    def get_deltas(self, epsilons: np.ndarray) -> np.ndarray:
        """``get_delta`` at each ε, bit for bit, with the ε-free terms computed once."""
        # compute_delta's loop (dp-accounting 0.6.0, Canonne et al. 2020, Prop. 12) over
        # the orders, per ε: the same float operations in the same order, on arrays.
        if np.any(self.orders < 1) or not np.all(self.rdp >= 0):  # errors, warnings: theirs
            return np.array([self.get_delta(float(e)) for e in epsilons])
        kl = np.array([-math.inf if r <= 0 else 0.5 * math.log1p(-math.exp(-r)) for r in self.rdp])
        high = self.orders > 1.01
        a, r = self.orders[high], self.rdp[high]
        shift = np.array([math.log1p(-1 / x) for x in a])
        log_a = np.array([math.log(x) for x in a])
        eps = np.asarray(epsilons, dtype=np.float64)[:, None]
        bound = (a - 1) * (r - eps + shift) - log_a
        log_delta = np.minimum(kl[high], bound)
        best = np.minimum(np.min(log_delta, axis=1), np.min(kl[~high], initial=math.inf))
        return np.array([min(math.exp(v), 1.0) for v in best])


def compose_rdp(
    groups: Iterable[tuple[dp_accounting.DpEvent, int]],
    neighboring: str,
    orders: tuple[float, ...],
) -> RdpComposition:
    """Sum of ``count * curve`` over the groups, in order (as ``RdpAccountant`` does)."""
    order_array = np.array(orders)
    total = np.zeros_like(order_array, dtype=np.float64)
    for event, count in groups:
        total += count * event_rdp_curve(event, neighboring, orders)
    return RdpComposition(order_array, total)


_Relation = dp_accounting.NeighboringRelation
_LAPLACE_RELATIONS = (_Relation.ADD_OR_REMOVE_ONE, _Relation.REPLACE_SPECIAL)
# The relations under which from_gaussian_mechanism builds a (remove, add) pair of PMFs.
_SUBSAMPLED_RELATIONS = (_Relation.ADD_OR_REMOVE_ONE, _Relation.REPLACE_SPECIAL)


@functools.lru_cache(maxsize=64)
def event_pld(
    event: dp_accounting.DpEvent, neighboring: str, discretization: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """The PLD ``PLDAccountant`` builds for one ``event`` before ``self_compose(count)``.

    ``event`` is a ``LaplaceDpEvent`` or a ``PoissonSampledDpEvent`` of a Gaussian or a
    Laplace with non-zero parameters (the events whose PLD does not depend on the count;
    see ``_group_plds``). dp-accounting's PLDs are immutable (``compose`` and
    ``self_compose`` return new ones), so the cached PLD is shared. A subsampled-Gaussian
    PLD at discretisation 1e-4 holds two float64 arrays of ~80 000 values (~1.3 MB):
    64 of them take ~80 MB at most.
    """
    relation = neighboring_relation(neighboring)
    if isinstance(event, dp_event.LaplaceDpEvent):
        return privacy_loss_distribution.from_laplace_mechanism(
            parameter=event.noise_multiplier, value_discretization_interval=discretization
        )
    inner = event.event
    if isinstance(inner, dp_event.GaussianDpEvent):
        if relation in _SUBSAMPLED_RELATIONS and 0 < event.sampling_probability < 1:
            # Bit for bit from_gaussian_mechanism's PLD, ~10x faster (privacy.fast_pld,
            # imported where used: a run with no Poisson-sampled PLD never needs it).
            from privacy.fast_pld import from_subsampled_gaussian

            return from_subsampled_gaussian(
                inner.noise_multiplier, event.sampling_probability, discretization
            )
        return privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=inner.noise_multiplier,
            value_discretization_interval=discretization,
            sampling_prob=event.sampling_probability,
            neighboring_relation=relation,
        )
    return privacy_loss_distribution.from_laplace_mechanism(
        parameter=inner.noise_multiplier,
        value_discretization_interval=discretization,
        sampling_prob=event.sampling_probability,
    )


class _NotMirrored(Exception):
    """An event ``_group_plds`` leaves to a real ``PLDAccountant``."""


def _group_plds(
    event: dp_accounting.DpEvent,
    count: int,
    relation: dp_accounting.NeighboringRelation,
    neighboring: str,
    discretization: float,
    out: list,
) -> bool:
    """Append to ``out`` the PLDs ``PLDAccountant.compose(event, count)`` composes, in order.

    Mirrors ``dp_accounting.pld.pld_privacy_accountant.PLDAccountant._maybe_compose``
    (dp-accounting 0.6.0) for NoOp, NonPrivate, SelfComposed, Composed, Gaussian,
    Laplace and PoissonSampled(Gaussian | Laplace) events, with the count-independent
    PLDs taken from ``event_pld``. Returns False when the event is not private
    (the accountant's ``_contains_non_dp_event``: ε = inf). Raises ``_NotMirrored``
    for any other event, or a relation the accountant refuses for it, so that the
    caller falls back to the accountant (which then composes it, or raises).
    ``tests/privacy/test_composition_cache.py`` pins this against ``PLDAccountant``.
    """
    if isinstance(event, dp_event.NoOpDpEvent):
        return True
    if isinstance(event, dp_event.NonPrivateDpEvent):
        return False
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return _group_plds(
            event.event, event.count * count, relation, neighboring, discretization, out
        )
    if isinstance(event, dp_event.ComposedDpEvent):
        private = True
        for sub_event in event.events:
            private &= _group_plds(sub_event, count, relation, neighboring, discretization, out)
        return private
    if isinstance(event, dp_event.GaussianDpEvent):
        if event.noise_multiplier == 0:
            return False
        # The accountant folds the count into the standard deviation (no self_compose),
        # so this PLD depends on the count and is built afresh, as dp-accounting does.
        out.append(
            privacy_loss_distribution.from_gaussian_mechanism(
                standard_deviation=event.noise_multiplier / math.sqrt(count),
                value_discretization_interval=discretization,
                neighboring_relation=relation,
            )
        )
        return True
    if isinstance(event, dp_event.LaplaceDpEvent):
        if relation not in _LAPLACE_RELATIONS:
            raise _NotMirrored
        if event.noise_multiplier == 0:
            return False
        out.append(event_pld(event, neighboring, discretization).self_compose(count))
        return True
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        inner = event.event
        if isinstance(inner, dp_event.LaplaceDpEvent) and relation not in _LAPLACE_RELATIONS:
            raise _NotMirrored
        if not isinstance(inner, (dp_event.GaussianDpEvent, dp_event.LaplaceDpEvent)):
            raise _NotMirrored
        if event.sampling_probability == 0:
            return True
        if inner.noise_multiplier == 0:
            return False
        out.append(event_pld(event, neighboring, discretization).self_compose(count))
        return True
    raise _NotMirrored


@dataclass(frozen=True, eq=False)
class PldComposition:
    """A composed PLD with ``PLDAccountant``'s ``get_epsilon``/``get_delta``."""

    pld: privacy_loss_distribution.PrivacyLossDistribution
    private: bool = True
    """False when a non-private event was composed (ε = inf, δ = 1)."""

    def get_epsilon(self, target_delta: float) -> float:
        """ε at δ (``PLDAccountant.get_epsilon``)."""
        return self.pld.get_epsilon_for_delta(target_delta) if self.private else math.inf

    def get_delta(self, target_epsilon: float) -> float:
        """δ at ε (``PLDAccountant.get_delta``)."""
        return self.pld.get_delta_for_epsilon(target_epsilon) if self.private else 1

    def get_deltas(self, epsilons: np.ndarray) -> np.ndarray:
        """δ at each ε (ascending): ``privacy.fast_pld.delta_curve``, an upper bound on
        the PLD's exact δ within ~1e-12 of ``get_delta``, in one pass."""
        if not self.private:
            return np.ones(len(epsilons))
        from privacy.fast_pld import delta_curve  # on use (event_pld)

        pld = self.pld
        deltas = delta_curve(pld._pmf_remove, epsilons)
        if not pld._symmetric:
            deltas = np.maximum(deltas, delta_curve(pld._pmf_add, epsilons))
        return deltas


def compose_pld(
    groups: Iterable[tuple[dp_accounting.DpEvent, int]], neighboring: str, discretization: float
) -> PldComposition | dp_accounting.PrivacyAccountant:
    """Each group composed once, as a dp-accounting ``PLDAccountant`` would.

    From ``identity()``, ``pld = pld.compose(p)`` for each PLD ``p`` of each group in
    order (``event_pld(event).self_compose(count)`` for the cached events), exactly the
    accountant's sequence of operations. Groups with an event ``_group_plds`` does
    not mirror are composed by a fresh ``PLDAccountant`` (which raises
    ``UnsupportedEventError`` for events PLD cannot account).
    """
    groups = tuple(groups)
    neighboring = neighboring_name(neighboring)
    relation = neighboring_relation(neighboring)
    plds: list = []
    private = True
    try:
        for event, count in groups:
            if not isinstance(event, dp_accounting.DpEvent):
                raise _NotMirrored
            private &= _group_plds(event, count, relation, neighboring, discretization, plds)
    except _NotMirrored:
        accountant = new_accountant("pld", neighboring, pld_discretization=discretization)
        for event, count in groups:
            accountant.compose(event, count)
        return accountant
    pld = privacy_loss_distribution.identity(value_discretization_interval=discretization)
    for part in plds:
        pld = pld.compose(part)
    return PldComposition(pld, private)


def compose_groups(
    groups: Groups,
    *,
    accountant: str,
    neighboring: str,
    rdp_orders: tuple[float, ...] | None,
    pld_discretization: float | None,
):
    """The composition of ``groups``: an object with ``get_epsilon``/``get_delta``."""
    # The ledger's config fills in the one its accountant uses (accounting._make_config).
    if accountant == "rdp":
        assert rdp_orders is not None
        return compose_rdp(groups, neighboring, rdp_orders)
    assert pld_discretization is not None
    return compose_pld(groups, neighboring, pld_discretization)


def delta_curve_of(composition, epsilons) -> np.ndarray:
    """``composition.get_delta`` at each of ``epsilons`` (ascending): in one pass where
    the composition has ``get_deltas``, else point by point (a dp-accounting accountant)."""
    if hasattr(composition, "get_deltas"):
        return composition.get_deltas(np.asarray(epsilons, dtype=np.float64))
    return np.array([float(composition.get_delta(float(e))) for e in epsilons])


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """The exact ε at ``delta`` of the Gaussian mechanism with multiplier z, unsampled.

    Several unsampled Gaussian releases compose into one Gaussian with multiplier
    ``(Σ z_i⁻²)^(-½)`` (their privacy losses are Gaussian), so this is also the exact ε
    of their composition. δ(ε) is dp-accounting's analytic ``GaussianPrivacyLoss``
    (Balle & Wang 2018, Thm. 8), inverted by its binary search, which returns an ε whose
    δ does not exceed ``delta``. A PLD built for a small z spans a privacy-loss range of
    order 1/z² at a 1e-4 grid (40 s for z = 0.16 composed 30 times); this takes
    milliseconds.
    """
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be positive, got {noise_multiplier!r}")
    mu = 1.0 / noise_multiplier
    loss = privacy_loss_mechanism.GaussianPrivacyLoss(noise_multiplier, sensitivity=1.0)
    # ε <= μ²/2 + μ √(2 ln(1.25/δ)) (the classical bound, valid for every ε): a bracket.
    upper = mu * mu / 2 + mu * math.sqrt(2 * math.log(1.25 / delta)) + 1.0
    found = common.inverse_monotone_function(
        loss.get_delta_for_epsilon,
        delta,
        common.BinarySearchParameters(0.0, upper, tolerance=1e-9),
        increasing=False,
    )
    if found is None:  # unreachable by the bracket above; never report less than it
        return upper
    return float(found)
