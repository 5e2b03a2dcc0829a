"""Strategy and privacy registries: ``name -> factory``.

The ServerApp validates ``strategy`` and ``privacy`` against these names and builds
the strategy with :func:`build`: the base strategy, wrapped by the privacy strategy
(``"none"`` leaves it unwrapped). Privacy wrappers own the run's privacy ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from flwr.serverapp.strategy import FedAvg, FedProx, Strategy

from privacy.accounting import PrivacyLedger
from privacy.mechanisms import FRONT_LOADED_MODES, noise_generator
from strategies.aggregation import AggregationSettings
from strategies.clustered import ClusteredFedAvg
from strategies.clustered_dp import ClusteredDPFedAvgAdaptive, ClusteredDPFedAvgFixed
from strategies.correlated_noise import CORRELATED_PRIVACY
from strategies.dp_fedavg import DivergenceRelease, DPFedAvgFixed
from strategies.dp_fedavg_adaptive import DPFedAvgAdaptive
from strategies.dpsgd_clients import DPSGDClients
from strategies.frontloaded_clients import FrontLoadedDPClients
from strategies.hierarchical_fedavg import HierarchicalFedAvg
from strategies.laplace import LaplaceDP
from strategies.local import LocalOnly
from strategies.private import DATA_DEPENDENT_SELECTION
from strategies.secagg import SecAggSettings
from strategies.secure import SecureAggregation
from strategies.seeded import SeededSampling
from strategies.server_optimizer import ServerOptimizer, ServerOptimizerSettings
from strategies.settings import Settings, setting
from strategies.smart_fedprox import SmartFedProx
from strategies.subspace_dp import SubspaceDP

_SERVER_STREAM = 0x5E  # the server's generator: DP sampling and server-side noise

# Local noise: a client that takes part always sends its noise, so only its data may
# differ between neighbouring runs (its update replaced by zero), not its presence.
LAPLACE_NEIGHBORING = "zero-out"


@dataclass(frozen=True)
class StrategySettings:
    """What every factory needs, already validated by the ServerApp."""

    strategy: str
    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    seed: int
    options: Mapping[str, Any]  # the namespaced options: "fedprox.mu", "dp.clip-norm", ...
    round_timeout: float = 600.0  # seconds to wait for replies (also for in-round queries)
    local_epochs: int = 1  # the task's local epochs per round (SmartFedProx's epoch factor)
    num_rounds: int = 1  # rounds the run plans (subspace-dp splits its noise budget over them)
    released_keys: tuple[str, ...] | None = None  # head-only: the arrays DP wrappers release
    train_sample_size: int | None = None  # clients a data-dependent selection picks (DP: m)


def _sampling(s: StrategySettings) -> dict:
    return {
        "fraction_train": s.fraction_train,
        "fraction_evaluate": s.fraction_evaluate,
        "min_train_nodes": s.min_train_nodes,
        "min_evaluate_nodes": s.min_evaluate_nodes,
        "min_available_nodes": s.min_available_nodes,
    }


# Flower's FedAvg family takes every node it is shown; SeededSampling picks them.
_TAKE_ALL = {
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
        aggregation=AggregationSettings.from_options(
            {**{key: default for key, default, _ in AggregationSettings.specs()}, **s.options}
        ),
    )


STRATEGIES: dict[str, Callable[[StrategySettings], Strategy]] = {
    "fedavg": lambda s: _seeded(FedAvg(**_TAKE_ALL), s),
    "fedprox": lambda s: _seeded(
        FedProx(**_TAKE_ALL, proximal_mu=float(s.options["fedprox.mu"])), s
    ),
    "local": lambda s: _seeded(LocalOnly(**_TAKE_ALL), s),
    "clustered": lambda s: ClusteredFedAvg(
        **_sampling(s),
        k=int(s.options["cluster.k"]),
        assign=str(s.options["cluster.assign"]),
        space=str(s.options["cluster.space"]),
        update=str(s.options["cluster.update"]),
        init=str(s.options["cluster.init"]),
        seed=s.seed,
        query_timeout=s.round_timeout,
    ),
    "smart-fedprox": lambda s: SmartFedProx(
        **_sampling(s),
        proximal_mu=float(s.options["fedprox.mu"]),
        selection=str(s.options["smart.selection"]),
        adaptive_mu=bool(s.options["smart.adaptive-mu"]),
        cold_start_rounds=int(s.options["smart.cold-start-rounds"]),
        exploration_rate=float(s.options["smart.exploration-rate"]),
        mu_min=float(s.options["smart.mu-min"]),
        mu_max=float(s.options["smart.mu-max"]),
        local_epochs=s.local_epochs,
        ema_alpha=float(s.options["smart.ema-alpha"]),
        seed=s.seed,
        sample_size=s.train_sample_size,
        connect_timeout=s.round_timeout,
    ),
    "hierarchical": lambda s: HierarchicalFedAvg(
        fraction_evaluate=s.fraction_evaluate,
        min_evaluate_nodes=s.min_evaluate_nodes,
        num_edges=int(s.options["hier.num-edges"]),
        edge_rounds=int(s.options["hier.edge-rounds"]),
        local_updates=int(s.options["hier.local-updates"]),
        client_fraction=float(s.options["hier.client-fraction"]),
        edge_fraction=float(s.options["hier.edge-fraction"]),
        eta=float(s.options["hier.eta"]),
        seed=s.seed,
        timeout=s.round_timeout,
        min_available_nodes=s.min_available_nodes,
    ),
}


def secagg_settings(options: Mapping[str, Any]) -> SecAggSettings | None:
    """The ``secagg.*`` options, or None when ``secagg.enabled`` is false."""
    if not bool(options.get("secagg.enabled", False)):
        return None
    return SecAggSettings.from_options(options)


def distributed_dp(options: Mapping[str, Any]) -> bool:
    """Client-side noise under secure aggregation: the distributed Skellam mechanism."""
    return bool(options.get("secagg.enabled", False)) and options["dp.noise-site"] == "client"


def dp_mechanisms(s: StrategySettings) -> tuple[str, ...]:
    """The mechanisms a DP-FedAvg ledger charges."""
    return ("skellam",) if distributed_dp(s.options) else ("gaussian",)


def dp_sampling(s: StrategySettings) -> str:
    """The ledger's sampling model for a privacy wrapper that samples its clients:
    ``dp.sampling`` ("poisson", or "without-replacement" for "fixed"), or "none" around
    a strategy that selects clients by their data, and for distributed DP (the server
    that samples is the party the ε holds against): no amplification claimed."""
    if s.strategy in DATA_DEPENDENT_SELECTION or distributed_dp(s.options):
        return "none"
    return "poisson" if s.options["dp.sampling"] == "poisson" else "without-replacement"


def dp_neighboring(s: StrategySettings) -> str | None:
    """The relation of a DP-FedAvg ledger when not the one its sampling implies: around a
    strategy that selects clients by what they report, zero-out (a client's data
    replaced by none while it stays selectable: update 0, reports 0), since removing a
    client would also change whom the selection picks. For the unamplified Gaussian
    releases charged there it gives the same epsilon as add-or-remove-one."""
    if s.strategy in DATA_DEPENDENT_SELECTION or distributed_dp(s.options):
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
    o = s.options
    ledger = PrivacyLedger(
        accountant=resolved_accountant(str(o["dp.accountant"]), sampling),
        target_delta=float(o["dp.target-delta"]),
        max_epsilon=float(o["dp.max-epsilon"]) or None,
        sampling=sampling,
        neighboring=neighboring,
        mechanisms=mechanisms,
    )
    ledger.noise_from_seed = bool(o["dp.reproducible-noise"])
    return ledger


def dp_generator(s: StrategySettings):
    """The generator of the randomness a guarantee rests on (noise, DP sampling): secret,
    from OS entropy, unless ``dp.reproducible-noise`` derives it from the run seed."""
    return noise_generator(
        seed=s.seed,
        streams=(_SERVER_STREAM,),
        reproducible=bool(s.options["dp.reproducible-noise"]),
    )


def _wrapper_kwargs(s: StrategySettings) -> dict[str, bool]:
    """What every privacy wrapper takes (:class:`strategies.private.PrivacyWrapper`)."""
    return {
        "client_metrics": bool(s.options["dp.client-metrics"]),
        "noise_from_seed": bool(s.options["dp.reproducible-noise"]),
    }


def count_stddev(s: StrategySettings) -> float | None:
    """σ_b of adaptive clipping: ``dp.clip-count-stddev``; when 0, max(m/20, z), and
    None while z is still to be calibrated (the wrapper then sets it with z)."""
    o = s.options
    z = float(o["dp.noise-multiplier"])
    if float(o["dp.clip-count-stddev"]):
        return float(o["dp.clip-count-stddev"])
    return max(int(o["dp.num-sampled-clients"]) / 20, z) if z else None


def _noise(s: StrategySettings, key: str) -> float | None:
    """The noise parameter ``key`` (``dp.noise-multiplier``, ``dp.epsilon``), or None when
    it is 0: calibrated from ``dp.target-epsilon`` once the nodes are known."""
    return float(s.options[key]) or None


def _target(s: StrategySettings) -> float | None:
    return float(s.options["dp.target-epsilon"]) or None


def _dp_fedavg_kwargs(s: StrategySettings) -> dict[str, Any]:
    """What DP-FedAvg and subspace-dp take from the ``dp.*`` options."""
    o = s.options
    return {
        "clip_norm": float(o["dp.clip-norm"]),
        "noise_multiplier": _noise(s, "dp.noise-multiplier"),
        "target_epsilon": _target(s),
        "planned_rounds": s.num_rounds,
        "num_sampled_clients": int(o["dp.num-sampled-clients"]),
        "ledger": make_ledger(s, dp_sampling(s), dp_mechanisms(s), dp_neighboring(s)),
        "rng": dp_generator(s),
        "min_available_nodes": s.min_available_nodes,
        "connect_timeout": s.round_timeout,
        "uniform_sampling": s.strategy not in DATA_DEPENDENT_SELECTION,
        "released_keys": s.released_keys,
        **_wrapper_kwargs(s),
    }


def divergence_release(s: StrategySettings) -> DivergenceRelease | None:
    """SmartFedProx's divergence report under DP-FedAvg (``smart.divergence-*``)."""
    if s.strategy != "smart-fedprox":
        return None
    o = s.options
    return DivergenceRelease(
        bound=float(o["smart.divergence-clip"]),
        noise_multiplier=float(o["smart.divergence-noise"]) or None,
    )


def _dp_fedavg(base: Strategy, s: StrategySettings, adaptive: bool) -> Strategy:
    o = s.options
    kwargs = {**_dp_fedavg_kwargs(s), "noise_site": str(o["dp.noise-site"])}
    kwargs["divergence"] = divergence_release(s)
    clustered = s.strategy == "clustered"
    if not adaptive:
        return (ClusteredDPFedAvgFixed if clustered else DPFedAvgFixed)(base, **kwargs)
    return (ClusteredDPFedAvgAdaptive if clustered else DPFedAvgAdaptive)(
        base,
        target_quantile=float(o["dp.target-quantile"]),
        clip_lr=float(o["dp.clip-lr"]),
        count_stddev=count_stddev(s),
        **kwargs,
    )


def _subspace_dp(base: Strategy, s: StrategySettings) -> Strategy:
    o = s.options
    return SubspaceDP(
        base,
        rank=int(o["subspace.rank"]),
        tau=float(o["subspace.tau"]),
        trace_budget=float(o["subspace.trace-budget"]),
        sketch_dim=int(o["subspace.sketch-dim"]),
        pmu_every=int(o["subspace.pmu-every"]),
        lambda_ptr=float(o["subspace.lambda-ptr"]),
        pmu_reserve=float(o["subspace.pmu-budget-reserve"]),
        allocation=str(o["subspace.allocation"]),
        quantize_bits=int(o["subspace.quantize-bits"]),
        seed=s.seed,
        **_dp_fedavg_kwargs(s),
    )


def _laplace(base: Strategy, s: StrategySettings) -> Strategy:
    o = s.options
    poisson = o["dp.sampling"] == "poisson"
    return LaplaceDP(
        base,
        sensitivity=float(o["dp.sensitivity"]),
        epsilon=_noise(s, "dp.epsilon"),
        target_epsilon=_target(s),
        planned_rounds=s.num_rounds,
        expected_clients=int(o["dp.num-sampled-clients"]) if poisson else None,
        min_available_nodes=s.min_available_nodes,
        connect_timeout=s.round_timeout,
        # Charged without amplification either way (strategies.laplace's docstring).
        ledger=make_ledger(s, "none", ("laplace",), LAPLACE_NEIGHBORING),
        rng=dp_generator(s),
        **_wrapper_kwargs(s),
    )


def _dp_sgd(base: Strategy, s: StrategySettings) -> Strategy:
    o = s.options
    return DPSGDClients(
        base,
        noise_multiplier=float(o["dp.noise-multiplier"]),  # 0 with a target: calibrated
        max_grad_norm=float(o["dp.clip-norm"]),
        target_epsilon=float(o["dp.target-epsilon"]),
        ledger=make_ledger(s, "none", mechanisms=()),
        **_wrapper_kwargs(s),
    )


def _front_loaded(mode: str) -> Callable[[Strategy, StrategySettings], Strategy]:
    def build(base: Strategy, s: StrategySettings) -> Strategy:
        o = s.options
        cp_np = mode == "cp-np"
        return FrontLoadedDPClients(
            base,
            mode=mode,
            clip=float(o["dp.clip-norm"]),
            sigma=float(o["dp.noise-std"]),
            per_example=bool(o["dp.per-example"]),
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

# Wrappers that sample clients themselves (Laplace: under Poisson sampling): the base
# strategy must take every node of the (restricted) grid it is shown.
SELF_SAMPLING: frozenset[str] = frozenset({"dp-fedavg-fixed", "dp-fedavg-adaptive", "subspace-dp"})


def self_sampling(privacy: str, options: Mapping[str, Any]) -> bool:
    """Whether the privacy wrapper ``privacy`` samples the clients itself."""
    return (
        privacy in SELF_SAMPLING
        or privacy in CORRELATED_PRIVACY
        or (privacy == "laplace" and options.get("dp.sampling") == "poisson")
    )


def build(privacy: str, settings: StrategySettings) -> Strategy:
    """Build ``settings.strategy`` wrapped by the privacy strategy ``privacy``, and by
    the server optimizer when one is asked for (:mod:`strategies.server_optimizer`)."""
    base_settings = settings
    if self_sampling(privacy, settings.options):
        base_settings = replace(
            settings, fraction_train=1.0, min_train_nodes=1, min_available_nodes=1
        )
        if settings.strategy in DATA_DEPENDENT_SELECTION:  # it picks the wrapper's m
            m = int(settings.options["dp.num-sampled-clients"])
            base_settings = replace(base_settings, train_sample_size=m)
    base = STRATEGIES[settings.strategy](base_settings)
    strategy = PRIVACY[privacy](base, settings)
    secagg = secagg_settings(settings.options)
    if secagg is not None:
        strategy = SecureAggregation(strategy, secagg)
    optimizer = ServerOptimizerSettings.from_options(settings.options)
    if optimizer.is_identity:
        return strategy
    return ServerOptimizer(strategy, optimizer)


@dataclass(frozen=True)
class FedProxSettings(Settings):
    """FedProx's run-config key (``fedprox.mu``; also SmartFedProx's base mu)."""

    PREFIX: ClassVar[str] = "fedprox"
    mu: float = setting(
        0.1,
        "FedProx proximal weight mu (strategy=fedprox).",
        low=0.0,
    )
