"""The privacy ledger: golden numbers against dp-accounting, Flower's accountant and
closed forms; budget refusal; incompatible combinations; events."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant as FlowerRdp
from scipy import optimize, stats

from privacy.accounting import (
    RDP_ORDERS,
    AccountingError,
    BudgetExceededError,
    PrivacyLedger,
    Release,
    l2_sensitivity_factor,
    to_dp_event,
)

NR = dp_accounting.NeighboringRelation
G, L = dp_accounting.GaussianDpEvent, dp_accounting.LaplaceDpEvent


def _release(
    sampling="poisson",
    z=1.1,
    *,
    kind="model-update",
    n=10,
    population=1000,
    count=1,
    server_round=1,
    laplace=None,
):
    if laplace is not None:
        return Release(
            server_round=server_round,
            kind=kind,
            mechanism="laplace",
            laplace_epsilon=laplace,
            sampling=sampling,
            sample_size=n,
            population=population,
            count=count,
        )
    return Release(
        server_round=server_round,
        kind=kind,
        mechanism="gaussian",
        noise_multiplier=z,
        sampling=sampling,
        sample_size=n,
        population=population,
        count=count,
    )


def _ledger(accountant="rdp", sampling="poisson", **kw) -> PrivacyLedger:
    return PrivacyLedger(accountant=accountant, target_delta=1e-5, sampling=sampling, **kw)


def _rounds(ledger, rounds, **kw):
    for rnd in range(1, rounds + 1):
        ledger.charge([_release(server_round=rnd, **kw)])
    return ledger


# -- equal to dp-accounting called directly --------------------------------------
def test_rdp_poisson_equals_dp_accounting():
    ledger = _rounds(_ledger(), 40)
    ledger.charge(_release(z=3.0, kind="adaptive-clip-count", count=40))
    reference = RdpAccountant(RDP_ORDERS, NR.ADD_OR_REMOVE_ONE)
    reference.compose(dp_accounting.PoissonSampledDpEvent(0.01, G(1.1)), 40)
    reference.compose(dp_accounting.PoissonSampledDpEvent(0.01, G(3.0)), 40)
    assert ledger.epsilon() == reference.get_epsilon(1e-5)
    assert ledger.epsilon(1e-7) == reference.get_epsilon(1e-7)
    assert ledger.delta_for(1.0) == reference.get_delta(1.0)


def test_rdp_without_replacement_equals_dp_accounting_replace_one():
    ledger = _rounds(
        _ledger(sampling="without-replacement"), 30, sampling="without-replacement", population=100
    )
    reference = RdpAccountant(RDP_ORDERS, NR.REPLACE_ONE)
    reference.compose(dp_accounting.SampledWithoutReplacementDpEvent(100, 10, G(1.1)), 30)
    assert ledger.neighboring == "replace-one"
    assert ledger.epsilon() == reference.get_epsilon(1e-5)


# Unsampled, the count is folded into the std (z / sqrt(count)), and a small std is a
# wide PLD: 4 rounds (1.5 s of PLD each side at 25).
@pytest.mark.parametrize("sampling,rounds", [("poisson", 25), ("none", 4)])
def test_pld_equals_dp_accounting(sampling, rounds):
    ledger = _rounds(_ledger("pld", sampling), rounds, sampling=sampling, population=100)
    event = G(1.1) if sampling == "none" else dp_accounting.PoissonSampledDpEvent(0.1, G(1.1))
    reference = PLDAccountant(NR.ADD_OR_REMOVE_ONE, 1e-4)
    reference.compose(event, rounds)
    assert ledger.epsilon() == reference.get_epsilon(1e-5)


@pytest.mark.parametrize(
    "accountant,sampling", [("rdp", "none"), ("pld", "none"), ("pld", "poisson")]
)
def test_laplace_equals_dp_accounting_and_basic_composition_bounds_it(accountant, sampling):
    ledger = _ledger(accountant, sampling, mechanisms=("laplace",))
    ledger.charge([_release(sampling, laplace=0.5, count=20)])
    event = L(2.0) if sampling == "none" else dp_accounting.PoissonSampledDpEvent(0.01, L(2.0))
    if accountant == "rdp":
        reference = RdpAccountant(RDP_ORDERS, NR.ADD_OR_REMOVE_ONE)
    else:
        reference = PLDAccountant(NR.ADD_OR_REMOVE_ONE, 1e-4)
    reference.compose(event, 20)
    assert ledger.accountant_epsilon() == reference.get_epsilon(1e-5)
    assert ledger.basic_composition_epsilon() == 10.0  # 20 x 0.5, pure
    # The smaller of the two is reported: here the accountant's (eps, delta).
    assert ledger.epsilon() == min(10.0, reference.get_epsilon(1e-5)) < 10.0


# -- Flower's RdpAccountant: matched with the same orders, beaten by the finer grid ----
@pytest.mark.parametrize(
    "sampling,method,relation",
    [
        ("none", SamplingMethod.NO_AMPLIFICATION, NeighboringRelation.ADD_OR_REMOVE_ONE),
        ("poisson", SamplingMethod.POISSON, NeighboringRelation.ADD_OR_REMOVE_ONE),
        (
            "without-replacement",
            SamplingMethod.WITHOUT_REPLACEMENT,
            NeighboringRelation.REPLACE_ONE,
        ),
    ],
)
def test_equals_flower_rdp_accountant(sampling, method, relation):
    config = PrivacyConfig(
        target_delta=1e-5,
        population_size=200,
        neighboring_relation=relation,
        sampling_method=method,
    )
    flower = FlowerRdp(config, orders=RDP_ORDERS)
    flower.compose(
        GaussianPrivacyEvent(noise_multiplier=1.3, sample_size=20, population_size=200), count=25
    )
    ours = _ledger(sampling=sampling)
    ours.charge(_release(sampling, z=1.3, n=20, population=200, count=25))
    assert ours.epsilon() == flower.get_epsilon(1e-5)
    assert ours.delta_for(2.0) == flower.get_delta(2.0)
    default_orders = FlowerRdp(config)  # Flower's default: dp-accounting's default grid
    default_orders.compose(GaussianPrivacyEvent(1.3, 20, 200), count=25)
    assert ours.epsilon() <= default_orders.get_epsilon(1e-5)
    separately = _rounds(
        _ledger(sampling=sampling), 25, sampling=sampling, z=1.3, n=20, population=200
    )
    assert separately.epsilon() == pytest.approx(ours.epsilon(), rel=1e-12)


def test_pld_is_tighter_than_rdp_under_poisson_sampling():
    rdp, pld = _rounds(_ledger("rdp"), 100), _ledger("pld")
    pld.charge(_release(count=100))
    assert pld.epsilon() < 0.9 * rdp.epsilon()


# -- golden numbers from closed forms ----------------------------------------------
def _analytic_gaussian_epsilon(z: float, delta: float) -> float:
    """Balle & Wang 2018, Thm 8: delta(eps) = Phi(1/2z - eps z) - e^eps Phi(-1/2z - eps z)."""

    def gap(eps):
        tail = math.exp(eps + stats.norm.logcdf(-1 / (2 * z) - eps * z))
        return stats.norm.cdf(1 / (2 * z) - eps * z) - tail - delta

    return optimize.brentq(gap, 0.0, 200.0, xtol=1e-12)


@pytest.mark.parametrize(
    "z,delta,count,golden",
    [
        (1.0, 1e-5, 1, 4.377178),
        (2.0, 1e-5, 1, 1.993091),
        (3.0, 1e-6, 10, 5.189037),  # 10 releases of z = 3 compose to z = 3/sqrt(10)
    ],
)
def test_pld_matches_the_analytic_gaussian_mechanism(z, delta, count, golden):
    ledger = PrivacyLedger(accountant="pld", target_delta=delta, sampling="none")
    ledger.charge(_release("none", z=z, n=1, population=1, count=count))
    exact = _analytic_gaussian_epsilon(z / math.sqrt(count), delta)
    assert exact == pytest.approx(golden, abs=1e-6)
    assert ledger.epsilon() == pytest.approx(exact, abs=1e-3)
    assert ledger.epsilon() >= exact - 1e-9  # pessimistic discretisation: an upper bound


@pytest.mark.parametrize("z,count", [(1.0, 1), (2.0, 1), (4.0, 50)])
def test_rdp_between_exact_and_classical_conversion(z, count):
    delta = 1e-5
    ledger = PrivacyLedger(accountant="rdp", target_delta=delta, sampling="none")
    ledger.charge(_release("none", z=z, n=1, population=1, count=count))
    # Mironov 2017 Prop. 3 with the Gaussian's RDP count * a / (2 z^2), over the same orders.
    classical = min(count * a / (2 * z**2) + math.log(1 / delta) / (a - 1) for a in RDP_ORDERS)
    exact = _analytic_gaussian_epsilon(z / math.sqrt(count), delta)
    assert exact < ledger.epsilon() <= classical
    assert classical - ledger.epsilon() < 0.15 * classical


def test_delta_and_epsilon_are_inverse():
    for accountant in ("rdp", "pld"):
        ledger = _rounds(_ledger(accountant), 20)
        epsilon = ledger.epsilon()
        assert ledger.delta_for(epsilon) == pytest.approx(1e-5, rel=0.05)
    assert _ledger().epsilon() == 0.0 and _ledger().delta_for(1.0) == 0.0


# -- budget -------------------------------------------------------------------------
def test_budget_refusal_leaves_the_ledger_unchanged():
    ledger = _ledger(max_epsilon=1.0)
    charged = 0
    while not ledger.would_exceed([_release(server_round=charged + 1)]):
        ledger.charge([_release(server_round=charged + 1)])
        charged += 1
    before_eps, before = ledger.epsilon(), ledger.releases
    with pytest.raises(BudgetExceededError, match="nothing was charged") as info:
        ledger.charge([_release(server_round=charged + 1)])
    assert 10 < charged < 10_000
    assert info.value.current_epsilon == before_eps <= 1.0 < info.value.projected_epsilon
    assert info.value.max_epsilon == 1.0
    assert ledger.epsilon() == before_eps and ledger.releases == before
    # A batch is all or nothing, and a release that fits still does.
    with pytest.raises(BudgetExceededError):
        ledger.charge([_release(z=50.0), _release(count=5)])
    assert ledger.releases == before
    ledger.charge([_release(z=50.0, kind="tiny")])
    assert len(ledger.releases) == charged + 1 and ledger.epsilon() <= 1.0


def test_without_budget_nothing_is_refused():
    ledger = _ledger()
    assert not ledger.would_exceed([_release(z=0.1, count=1000)])
    ledger.charge(_release(z=0.1, count=1000))
    assert ledger.epsilon() > 100


# -- combinations ---------------------------------------------------------------------
def _by_hand(sampling, mechanism):
    base = G(1.0) if mechanism == "gaussian" else L(1.0)
    if sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(0.5, base)
    if sampling == "without-replacement":
        return dp_accounting.SampledWithoutReplacementDpEvent(2, 1, base)
    return base


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
@pytest.mark.parametrize("sampling", ["poisson", "without-replacement", "none"])
@pytest.mark.parametrize("mechanism", ["gaussian", "laplace"])
def test_supported_exactly_when_dp_accounting_supports(accountant, sampling, mechanism):
    relation = NR.REPLACE_ONE if sampling == "without-replacement" else NR.ADD_OR_REMOVE_ONE
    backend = RdpAccountant(None, relation) if accountant == "rdp" else PLDAccountant(relation)
    supported = backend.supports(_by_hand(sampling, mechanism))
    try:
        _ledger(accountant, sampling, mechanisms=(mechanism,))
        constructed = True
    except AccountingError:
        constructed = False
    assert constructed == supported


@pytest.mark.parametrize(
    "accountant,sampling,mechanism,advice",
    [
        ("pld", "without-replacement", "gaussian", "use accountant='rdp'"),
        ("pld", "without-replacement", "laplace", "or sampling='poisson'"),
        ("rdp", "poisson", "laplace", "use accountant='pld'"),
        ("rdp", "without-replacement", "laplace", "use mechanism='gaussian'"),
    ],
)
def test_incompatible_combinations_name_the_alternative(accountant, sampling, mechanism, advice):
    with pytest.raises(AccountingError, match=f"accountant='{accountant}'") as info:
        _ledger(accountant, sampling, mechanisms=(mechanism,))
    assert advice in str(info.value) and f"sampling='{sampling}'" in str(info.value)


def test_mismatched_neighboring_and_release_sampling_are_refused():
    with pytest.raises(AccountingError, match=r"neighboring in \['replace-one'\]"):
        _ledger(sampling="without-replacement", neighboring="add-or-remove-one")
    with pytest.raises(AccountingError, match=r"neighboring in \['add-or-remove-one'\]"):
        _ledger(sampling="poisson", neighboring=NR.REPLACE_ONE)
    # Zero-out (local noise) is never amplified by sampling (strategies.mechanisms.laplace).
    with pytest.raises(AccountingError, match=r"neighboring in \['add-or-remove-one'\]"):
        _ledger(sampling="poisson", neighboring="zero-out")
    ledger = _ledger(sampling="without-replacement")
    with pytest.raises(AccountingError, match="accounts sampling='without-replacement'"):
        ledger.charge(_release("poisson"))
    ledger.charge(_release("none"))  # no amplification claimed: fine under any ledger
    with pytest.raises(AccountingError, match="use accountant='pld'"):
        _ledger().charge(_release(laplace=1.0))  # Laplace under RDP + Poisson
    assert len(ledger.releases) == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"noise_multiplier": 1.0, "laplace_epsilon": 1.0}, "not laplace_epsilon"),
        ({"mechanism": "laplace", "noise_multiplier": 1.0}, "not noise_multiplier"),
        ({"noise_multiplier": -1.0}, "must be > 0"),
        ({"noise_multiplier": 1.0, "sample_size": 11}, "exceeds population"),
        ({"noise_multiplier": 1.0, "count": 0}, "count"),
        ({"noise_multiplier": 1.0, "count": True}, "count"),
        ({"noise_multiplier": 1.0, "sampling": "shuffle"}, "sampling must be one of"),
        ({"noise_multiplier": 1.0, "mechanism": "exponential"}, "mechanism must be one of"),
    ],
)
def test_release_validation(kwargs, match):
    base = {
        "server_round": 1,
        "kind": "model-update",
        "mechanism": "gaussian",
        "sampling": "poisson",
        "sample_size": 10,
        "population": 10,
    }
    with pytest.raises(AccountingError, match=match):
        Release(**{**base, **kwargs})


def test_events_built_as_documented():
    assert to_dp_event(_release("none", laplace=0.25), "add-or-remove-one") == L(4.0)
    assert to_dp_event(_release("poisson", count=3), NR.ADD_OR_REMOVE_ONE) == (
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(0.01, G(1.1)), 3)
    )
    assert to_dp_event(_release("without-replacement"), "replace-one") == (
        dp_accounting.SampledWithoutReplacementDpEvent(1000, 10, G(1.1))
    )
    with pytest.raises(AccountingError, match="neighboring='replace-one'"):
        to_dp_event(_release("without-replacement"), "add-or-remove-one")
    assert l2_sensitivity_factor("replace-one") == 2.0
    assert l2_sensitivity_factor(NR.ADD_OR_REMOVE_ONE) == 1.0


def test_rdp_orders_hold_dp_accountings_default_grid():
    # privacy.events writes the grid out (so that importing it does not import
    # dp-accounting); it must stay a superset: more orders can only lower ε.
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    assert set(map(float, DEFAULT_RDP_ORDERS)) <= set(RDP_ORDERS)
    assert list(RDP_ORDERS) == sorted(set(RDP_ORDERS))


@pytest.mark.parametrize(
    ("name", "relation"),
    [
        ("add-or-remove-one", NR.ADD_OR_REMOVE_ONE),
        ("replace-one", NR.REPLACE_ONE),
        ("zero-out", NR.REPLACE_SPECIAL),
    ],
)
def test_neighboring_names_and_dp_accountings_relations_map_both_ways(name, relation):
    from privacy.events import neighboring_name, neighboring_relation

    assert neighboring_relation(name) is relation
    assert neighboring_relation(relation) is relation
    assert neighboring_name(relation) == name
    assert neighboring_name(name) == name


@pytest.mark.parametrize("bad", ["add-remove", "ADD_OR_REMOVE_ONE", 1, None])
def test_an_unknown_neighboring_relation_is_refused_with_the_valid_names(bad):
    from privacy.events import neighboring_name

    with pytest.raises(AccountingError, match=r"add-or-remove-one.*replace-one.*zero-out"):
        neighboring_name(bad)
