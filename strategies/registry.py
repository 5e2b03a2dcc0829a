"""Strategy and privacy registries: ``name -> factory``.

The ServerApp validates ``strategy`` and ``privacy`` against these names and builds
the strategy with :func:`build`: the base strategy, wrapped by the privacy strategy
(``"none"`` leaves it unwrapped). Privacy wrappers own the run's privacy ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from flwr.clientapp.typing import Mod
from flwr.serverapp.strategy import FedAvg, FedProx, Strategy

from config.options import Scalar
from config.settings import Settings, Typed, setting
from privacy.accounting import SPARSE_CHECKPOINTS, PrivacyLedger
from privacy.mechanisms import FRONT_LOADED_MODES
from strategies.algorithms.clustered import ClusteredFedAvg, ClusterSettings
from strategies.algorithms.hierarchical_fedavg import HierarchicalFedAvg, HierSettings
from strategies.algorithms.local import LocalOnly
from strategies.algorithms.server_optimizer import ServerOptimizer, ServerOptimizerSettings
from strategies.algorithms.smart_fedprox.private import DivergenceRelease, DivergenceSettings
from strategies.algorithms.smart_fedprox.strategy import SmartFedProx, SmartSettings
from strategies.mechanisms.base import (  # noqa: F401 (_SERVER_STREAM: the tests and bench)
    _SERVER_STREAM,
    DATA_DEPENDENT_SELECTION,
    DPSettings,
    dp_generator,
    report_metrics_mod,
)
from strategies.mechanisms.clustered_dp import ClusteredDPFedAvgAdaptive, ClusteredDPFedAvgFixed
from strategies.mechanisms.correlated_noise import CORRELATED_PRIVACY, CorrelatedSettings
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed, dp_fedavg_mod
from strategies.mechanisms.dp_fedavg_adaptive import AdaptiveClipSettings, DPFedAvgAdaptive
from strategies.mechanisms.dpsgd_clients import DPSGDClients
from strategies.mechanisms.frontloaded_clients import FrontLoadedDPClients, front_loaded_mod
from strategies.mechanisms.laplace import LaplaceDP, laplace_mod
from strategies.mechanisms.subspace_dp import SubspaceDP, SubspaceSettings
from strategies.runtime.aggregation import AggregationSettings
from strategies.runtime.seeded import SeededSampling
from strategies.secure.distributed_dp import SecureNoise
from strategies.secure.secagg_plus import SecAggSettings
from strategies.secure.secure_aggregation import SecureAggregation

# Local noise: a client that takes part always sends its noise, so only its data may
# differ between neighbouring runs (its update replaced by zero), not its presence.
LAPLACE_NEIGHBORING = "zero-out"


@dataclass(frozen=True)
class StrategySettings(Typed):
    """What every factory needs, already validated by the ServerApp; each part reads
    its typed settings with ``part`` (e.g. ``s.part(DPSettings).clip_norm``)."""

    strategy: str
    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    seed: int
    options: Mapping[str, Any]  # the parsed namespaced options the parts are built from
    round_timeout: float = 600.0  # seconds to wait for replies (also for in-round queries)
    local_epochs: int = 1  # the task's local epochs per round (SmartFedProx's epoch factor)
    num_rounds: int = 1  # rounds the run plans (subspace-dp splits its noise budget over them)
    released_keys: tuple[str, ...] | None = None  # head-only: the arrays DP wrappers release
    train_sample_size: int | None = None  # clients a data-dependent selection picks (DP: m)
    aggregate_device: str | None = None  # DP-FedAvg's server sum on the clients' GPU (None: NumPy)
    parts: dict[tuple[type, int], tuple[Mapping[str, Scalar], Any]] = field(
        default_factory=dict, compare=False, repr=False
    )


def _sampling(s: StrategySettings) -> dict:
    return {
        "fraction_train": s.fraction_train,
        "fraction_evaluate": s.fraction_evaluate,
        "min_train_nodes": s.min_train_nodes,
        "min_evaluate_nodes": s.min_evaluate_nodes,
        "min_available_nodes": s.min_available_nodes,
    }


# Flower's FedAvg family takes every node it is shown; SeededSampling picks them.
_TAKE_ALL: dict[str, Any] = {
    "fraction_train": 1.0,
    "fraction_evaluate": 1.0,
    "min_train_nodes": 1,
    "min_evaluate_nodes": 1,
    "min_available_nodes": 1,
}


def _seeded(strategy: Strategy, s: StrategySettings) -> Strategy:
    return SeededSampling(
        strategy,
        **_sampling(s),
        seed=s.seed,
        timeout=s.round_timeout,
        aggregation=s.part(AggregationSettings),
    )


# Each strategy is built from its settings object: every field of its settings dataclass
# is the constructor argument of the same name (``Settings.kwargs``), so a new key
# reaches the strategy without an edit here (docs/extending.md).


def _clustered(s: StrategySettings) -> Strategy:
    return ClusteredFedAvg(
        **_sampling(s),
        **s.part(ClusterSettings).kwargs(),
        seed=s.seed,
        query_timeout=s.round_timeout,
    )


def _smart_fedprox(s: StrategySettings) -> Strategy:
    return SmartFedProx(
        **_sampling(s),
        **s.part(SmartSettings).kwargs(),
        proximal_mu=s.part(FedProxSettings).mu,
        local_epochs=s.local_epochs,
        seed=s.seed,
        sample_size=s.train_sample_size,
        connect_timeout=s.round_timeout,
    )


def _hierarchical(s: StrategySettings) -> Strategy:
    return HierarchicalFedAvg(
        fraction_evaluate=s.fraction_evaluate,
        min_evaluate_nodes=s.min_evaluate_nodes,
        **s.part(HierSettings).kwargs(),
        seed=s.seed,
        timeout=s.round_timeout,
        min_available_nodes=s.min_available_nodes,
    )


STRATEGIES: dict[str, Callable[[StrategySettings], Strategy]] = {
    "fedavg": lambda s: _seeded(FedAvg(**_TAKE_ALL), s),
    "fedprox": lambda s: _seeded(FedProx(**_TAKE_ALL, proximal_mu=s.part(FedProxSettings).mu), s),
    "local": lambda s: _seeded(LocalOnly(**_TAKE_ALL), s),
    "clustered": _clustered,
    "smart-fedprox": _smart_fedprox,
    "hierarchical": _hierarchical,
}


def secagg_settings(s: Typed) -> SecAggSettings | None:
    """The ``secagg.*`` settings, or None when ``secagg.enabled`` is false (the other
    ``secagg.*`` keys are then not checked)."""
    return s.part(SecAggSettings) if SecAggSettings.on_in(s) else None


def distributed_dp(s: Typed) -> bool:
    """Client-side noise under secure aggregation: the distributed Skellam mechanism."""
    return SecAggSettings.on_in(s) and s.part(DPSettings).noise_site == "client"


def dp_mechanisms(s: StrategySettings) -> tuple[str, ...]:
    """The mechanisms a DP-FedAvg ledger charges."""
    return ("skellam",) if distributed_dp(s) else ("gaussian",)


def dp_sampling(s: StrategySettings) -> str:
    """The ledger's sampling model for a privacy wrapper that samples its clients:
    ``dp.sampling`` ("poisson", or "without-replacement" for "fixed"), or "none" around
    a strategy that selects clients by their data, and for distributed DP (the server
    that samples is the party the ε holds against): no amplification claimed."""
    if s.strategy in DATA_DEPENDENT_SELECTION or distributed_dp(s):
        return "none"
    return "poisson" if s.part(DPSettings).sampling == "poisson" else "without-replacement"


def dp_neighboring(s: StrategySettings) -> str | None:
    """The relation of a DP-FedAvg ledger when not the one its sampling implies: around a
    strategy that selects clients by what they report, zero-out (a client's data
    replaced by none while it stays selectable: update 0, reports 0), since removing a
    client would also change whom the selection picks. For the unamplified Gaussian
    releases charged there it gives the same epsilon as add-or-remove-one."""
    if s.strategy in DATA_DEPENDENT_SELECTION or distributed_dp(s):
        return "zero-out"  # distributed DP: a client always sends its noise share
    return None


def resolved_accountant(accountant: str, sampling: str) -> str:
    """``dp.accountant``, with ``auto`` resolved: PLD for Poisson sampling (tighter, and
    what dp-accounting recommends for it), RDP otherwise (PLD has no sampling without
    replacement)."""
    if accountant != "auto":
        return accountant
    return "pld" if sampling == "poisson" else "rdp"


def make_ledger(
    s: StrategySettings,
    sampling: str,
    mechanisms: tuple[str, ...] = ("gaussian",),
    neighboring: str | None = None,
) -> PrivacyLedger:
    """The run's ledger, configured from the ``dp.*`` options; it refuses at once an
    accountant x sampling x mechanism combination dp-accounting cannot account.
    ``neighboring``: the relation, when not the one ``sampling`` implies (Laplace:
    :data:`LAPLACE_NEIGHBORING`)."""
    dp = s.part(DPSettings)
    ledger = PrivacyLedger(
        accountant=resolved_accountant(dp.accountant, sampling),
        target_delta=dp.target_delta,
        max_epsilon=dp.max_epsilon or None,
        sampling=sampling,
        neighboring=neighboring,
        mechanisms=mechanisms,
    )
    ledger.noise_from_seed = dp.reproducible_noise
    ledger.checkpoints = SPARSE_CHECKPOINTS  # PLD: ε at checkpoint counts (privacy.accounting)
    return ledger


def _wrapper_kwargs(s: StrategySettings) -> dict[str, bool]:
    """What every privacy wrapper takes (:class:`strategies.mechanisms.base.PrivacyWrapper`)."""
    dp = s.part(DPSettings)
    return {"client_metrics": dp.client_metrics, "noise_from_seed": dp.reproducible_noise}


def _dp_fedavg_kwargs(s: StrategySettings) -> dict[str, Any]:
    """What DP-FedAvg and subspace-dp take from the ``dp.*`` options (a noise parameter
    or target of 0 is None: calibrated from ``dp.target-epsilon`` once the nodes are
    known)."""
    dp = s.part(DPSettings)
    return {
        "clip_norm": dp.clip_norm,
        "noise_multiplier": dp.noise_multiplier or None,
        "target_epsilon": dp.target_epsilon or None,
        "planned_rounds": s.num_rounds,
        "num_sampled_clients": dp.num_sampled_clients,
        "ledger": make_ledger(s, dp_sampling(s), dp_mechanisms(s), dp_neighboring(s)),
        "rng": dp_generator(s),
        "min_available_nodes": s.min_available_nodes,
        "connect_timeout": s.round_timeout,
        "uniform_sampling": s.strategy not in DATA_DEPENDENT_SELECTION,
        "released_keys": s.released_keys,
        "aggregate_device": s.aggregate_device,
        **_wrapper_kwargs(s),
    }


def divergence_release(s: StrategySettings) -> DivergenceRelease | None:
    """SmartFedProx's divergence report under DP-FedAvg (``smart.divergence-*``)."""
    if s.strategy != "smart-fedprox":
        return None
    release = s.part(DivergenceSettings)
    return DivergenceRelease(
        bound=release.divergence_clip,
        noise_multiplier=release.divergence_noise or None,
    )


def secure_noise_site(s: StrategySettings) -> SecureNoise | None:
    """DP-FedAvg's noise site under SecAgg+ (None without it): the server's noise on the
    unmasked sum, or the clients' distributed Skellam shares (``dp.noise-site``)."""
    secagg = secagg_settings(s)
    return None if secagg is None else SecureNoise(secagg, distributed_dp(s))


def _dp_fedavg(base: Strategy, s: StrategySettings, adaptive: bool) -> Strategy:
    dp = s.part(DPSettings)
    kwargs = {**_dp_fedavg_kwargs(s), "noise_site": dp.noise_site}
    kwargs["secure"] = secure_noise_site(s)
    kwargs["divergence"] = divergence_release(s)
    clustered = s.strategy == "clustered"
    if not adaptive:
        return (ClusteredDPFedAvgFixed if clustered else DPFedAvgFixed)(base, **kwargs)
    adaptive_cls = ClusteredDPFedAvgAdaptive if clustered else DPFedAvgAdaptive
    return adaptive_cls(base, **s.part(AdaptiveClipSettings).kwargs(), **kwargs)


def _subspace_dp(base: Strategy, s: StrategySettings) -> Strategy:
    return SubspaceDP(
        base, **s.part(SubspaceSettings).kwargs(), seed=s.seed, **_dp_fedavg_kwargs(s)
    )


def _laplace(base: Strategy, s: StrategySettings) -> Strategy:
    dp = s.part(DPSettings)
    poisson = dp.sampling == "poisson"
    return LaplaceDP(
        base,
        sensitivity=dp.sensitivity,
        epsilon=dp.epsilon or None,
        target_epsilon=dp.target_epsilon or None,
        planned_rounds=s.num_rounds,
        expected_clients=dp.num_sampled_clients if poisson else None,
        min_available_nodes=s.min_available_nodes,
        connect_timeout=s.round_timeout,
        # Charged without amplification either way (strategies.mechanisms.laplace's docstring).
        ledger=make_ledger(s, "none", ("laplace",), LAPLACE_NEIGHBORING),
        rng=dp_generator(s),
        **_wrapper_kwargs(s),
    )


def _dp_sgd(base: Strategy, s: StrategySettings) -> Strategy:
    dp = s.part(DPSettings)
    return DPSGDClients(
        base,
        noise_multiplier=dp.noise_multiplier,  # 0 with a target: calibrated
        max_grad_norm=dp.clip_norm,
        target_epsilon=dp.target_epsilon,
        ledger=make_ledger(s, "none", mechanisms=()),
        **_wrapper_kwargs(s),
    )


def _front_loaded(mode: str) -> Callable[[Strategy, StrategySettings], Strategy]:
    def build(base: Strategy, s: StrategySettings) -> Strategy:
        dp = s.part(DPSettings)
        cp_np = mode == "cp-np"
        return FrontLoadedDPClients(
            base,
            mode=mode,
            clip=dp.clip_norm,
            sigma=dp.noise_std,
            per_example=dp.per_example,
            ledger=make_ledger(
                s, "without-replacement" if cp_np else "none", ("gaussian",) if cp_np else ()
            ),
            # An edge sees its clients' noisy deltas and who sent them: no
            # amplification (FrontLoadedDPClients charges it with the run ledger's
            # sensitivity, so both count the same neighbours); the budget holds for it.
            edge_view=make_ledger(s, "none"),
            rng=dp_generator(s),
            **_wrapper_kwargs(s),
        )

    return build


PRIVACY: dict[str, Callable[[Strategy, StrategySettings], Strategy]] = {
    "none": lambda strategy, _settings: strategy,
    "dp-fedavg-fixed": lambda b, s: _dp_fedavg(b, s, adaptive=False),
    "dp-fedavg-adaptive": lambda b, s: _dp_fedavg(b, s, adaptive=True),
    "subspace-dp": _subspace_dp,
    "laplace": _laplace,
    "dp-sgd": _dp_sgd,
    **{mode: _front_loaded(mode) for mode in FRONT_LOADED_MODES},
    **CORRELATED_PRIVACY,
}

# The client half of each privacy mechanism: the mods the ClientApp runs for it
# (:func:`client_mods`), beside the server wrapper above.
CLIENT_MODS: dict[str, tuple[Mod, ...]] = {
    "none": (),
    "dp-fedavg-fixed": (dp_fedavg_mod,),
    "dp-fedavg-adaptive": (dp_fedavg_mod,),
    "subspace-dp": (dp_fedavg_mod,),
    "laplace": (laplace_mod,),
    "dp-sgd": (report_metrics_mod,),
    **{mode: (front_loaded_mod,) for mode in FRONT_LOADED_MODES},
    # Correlated noise clips as DP-FedAvg does (the server wrapper's client config).
    **{mechanism: (dp_fedavg_mod,) for mechanism in CORRELATED_PRIVACY},
}


def client_mods(privacy: str) -> tuple[Mod, ...]:
    """The client mods of the privacy mechanism ``privacy`` (``"none"``: none)."""
    try:
        return CLIENT_MODS[privacy]
    except KeyError:
        raise ValueError(f"privacy = {privacy!r}; valid values: {sorted(CLIENT_MODS)}") from None


# Wrappers that sample clients themselves (Laplace: under Poisson sampling): the base
# strategy must take every node of the (restricted) grid it is shown.
SELF_SAMPLING: frozenset[str] = frozenset({"dp-fedavg-fixed", "dp-fedavg-adaptive", "subspace-dp"})


def self_sampling(privacy: str, s: Typed) -> bool:
    """Whether the privacy wrapper ``privacy`` samples the clients itself."""
    return (
        privacy in SELF_SAMPLING
        or privacy in CORRELATED_PRIVACY
        or (privacy == "laplace" and s.part(DPSettings).sampling == "poisson")
    )


# The settings of a strategy or mechanism beyond the app-wide ones, by name: a run
# checks only those of the strategy and mechanism it chose (:func:`settings_to_check`).
STRATEGY_SETTINGS: dict[str, tuple[type[Settings], ...]] = {
    "clustered": (ClusterSettings,),
    "smart-fedprox": (SmartSettings, DivergenceSettings),
    "hierarchical": (HierSettings,),
}
PRIVACY_SETTINGS: dict[str, tuple[type[Settings], ...]] = {
    "subspace-dp": (SubspaceSettings,),
    "dp-fedavg-adaptive": (AdaptiveClipSettings,),
    # The front-loaded modes are client modes of hierarchical FL.
    **{mode: (HierSettings,) for mode in FRONT_LOADED_MODES},
    **{mechanism: (CorrelatedSettings,) for mechanism in CORRELATED_PRIVACY},
}


def settings_to_check(
    parts: Iterable[type[Settings]], strategy: str, privacy: str, run: Typed
) -> list[type[Settings]]:
    """Of ``parts``, those whose ``check`` a run of ``strategy`` and ``privacy`` needs:
    the app-wide ones and the chosen strategy's and mechanism's, each unless ``run``
    leaves it off (:attr:`config.settings.Settings.OFF`)."""
    chosen = {*STRATEGY_SETTINGS.get(strategy, ()), *PRIVACY_SETTINGS.get(privacy, ())}
    named = {
        p for table in (STRATEGY_SETTINGS, PRIVACY_SETTINGS) for ps in table.values() for p in ps
    }
    return [p for p in parts if (p in chosen or p not in named) and p.on_in(run)]


def build(privacy: str, settings: StrategySettings) -> Strategy:
    """Build ``settings.strategy`` wrapped by the privacy strategy ``privacy``, and by
    the server optimizer when one is asked for (:mod:`strategies.algorithms.server_optimizer`)."""
    base_settings = settings
    if self_sampling(privacy, settings):
        base_settings = replace(
            settings, fraction_train=1.0, min_train_nodes=1, min_available_nodes=1
        )
        if settings.strategy in DATA_DEPENDENT_SELECTION:  # it picks the wrapper's m
            m = settings.part(DPSettings).num_sampled_clients
            base_settings = replace(base_settings, train_sample_size=m)
    base = STRATEGIES[settings.strategy](base_settings)
    strategy = PRIVACY[privacy](base, settings)
    secagg = secagg_settings(settings)
    if secagg is not None:
        strategy = SecureAggregation(strategy, secagg)
    if not ServerOptimizerSettings.on_in(settings):
        return strategy
    return ServerOptimizer(strategy, settings.part(ServerOptimizerSettings), settings.num_rounds)


@dataclass(frozen=True)
class FedProxSettings(Settings):
    """FedProx's run-config key (``fedprox.mu``; also SmartFedProx's base mu)."""

    PREFIX: ClassVar[str] = "fedprox"
    mu: float = setting(
        0.1,
        "FedProx proximal weight mu (strategy=fedprox).",
        low=0.0,
    )
