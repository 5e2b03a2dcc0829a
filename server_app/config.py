"""The run-config: every key the app accepts, parsed once into a frozen object.

Keys are declared as :class:`tasks.options.Option` specs: the top-level keys here,
the strategies' and privacy mechanisms' namespaced keys here too (``strategies/``
may not import ``tasks``), and each task's keys on its class. :func:`load` rejects
unknown keys and invalid values with a message naming the key and the valid values,
before anything is trained. ``pyproject.toml`` carries the same defaults (a test
checks they agree) because Flower only accepts overrides of keys it has a default for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import strategies
import tasks
from privacy.accounting import AccountingError
from privacy.quantization import step_for_bits, topup_noise_multiplier
from privacy.subspace import pmu_noise_multiplier
from strategies import registry
from strategies.server_optimizer import ONE_GLOBAL_MODEL, OPTIMIZERS, server_optimizer_settings
from strategies.subspace_dp import pmu_rounds
from tasks.base import SEED
from tasks.options import ConfigError, Option, Scalar, check_unknown_keys, parse_options

TOP_LEVEL: tuple[Option, ...] = (
    Option("task", "digits", "Learning task.", choices=tuple(tasks.REGISTRY)),
    Option("strategy", "fedavg", "Federated strategy.", choices=tuple(strategies.STRATEGIES)),
    Option("privacy", "none", "Privacy mechanism.", choices=tuple(strategies.PRIVACY)),
    Option("num-server-rounds", 10, "Number of federated rounds.", low=1),
    SEED,
    Option(
        "output-dir",
        "runs",
        "Where run directories are created; a relative path resolves against the "
        "app's source directory (where you run `flwr run .`).",
    ),
    Option(
        "fraction-train",
        0.5,
        "Fraction of nodes sampled for training each round.",
        low=0.0,
        high=1.0,
        low_open=True,
    ),
    Option(
        "fraction-evaluate",
        1.0,
        "Fraction of nodes sampled for federated evaluation (0 disables it).",
        low=0.0,
        high=1.0,
    ),
    Option("min-train-nodes", 2, "Minimum number of nodes sampled for training.", low=1),
    Option("min-evaluate-nodes", 2, "Minimum number of nodes sampled for evaluation.", low=0),
    Option("min-available-nodes", 2, "Nodes that must be connected before a round starts.", low=1),
    Option(
        "round-timeout",
        600.0,
        "Seconds to wait for replies in each round.",
        low=0.0,
        low_open=True,
    ),
    Option("central-eval", True, "Evaluate the global model on the central test set every round."),
    Option(
        "resume-from",
        "",
        "A run directory to continue from its last finished round (its checkpoint); every "
        "other key must equal that run's. Empty: a new run.",
    ),
)

STRATEGY_OPTIONS: tuple[Option, ...] = (
    Option(
        "run.max-failed-rounds",
        3,
        "Stop the run (outcome 'failed') after this many consecutive rounds in which no "
        "client contributed; 0: never.",
        low=0,
    ),
    Option(
        "run.divergence-factor",
        1000.0,
        "Stop the run (outcome 'failed') when an evaluation loss exceeds this many times "
        "its first value (non-finite metrics always stop it); 0: no ratio check.",
        low=0.0,
    ),
    Option("fedprox.mu", 0.1, "FedProx proximal weight mu (strategy=fedprox).", low=0.0),
    Option("cluster.k", 3, "Clustered FedAvg: number K of global models.", low=1),
    Option(
        "cluster.assign",
        "l2",
        "Clustered FedAvg: how a client picks its model: `l2` (closest weights to its "
        "last upload, the seed's rule) or `loss` (best local evaluation, IFCA).",
        choices=("l2", "loss"),
    ),
    Option(
        "smart.selection",
        "hybrid",
        "SmartFedProx client selection: `hybrid` (30/50/20 % from the high/middle/low "
        "smoothed-divergence thirds) or `random`.",
        choices=("hybrid", "random"),
    ),
    Option(
        "smart.adaptive-mu",
        True,
        "SmartFedProx: clients scale `fedprox.mu` by their divergence history and epochs.",
    ),
    Option("smart.cold-start-rounds", 3, "SmartFedProx: first rounds sampled at random.", low=0),
    Option(
        "smart.exploration-rate",
        0.15,
        "SmartFedProx: probability that a round after the cold start samples at random.",
        low=0.0,
        high=1.0,
    ),
    Option("smart.mu-min", 0.0, "SmartFedProx: lower clamp of the adaptive mu.", low=0.0),
    Option("smart.mu-max", 1.0, "SmartFedProx: upper clamp of the adaptive mu.", low=0.0),
    Option(
        "smart.ema-alpha",
        0.3,
        "SmartFedProx: weight of the newest divergence in the clients' EMA.",
        low=0.0,
        high=1.0,
        low_open=True,
    ),
    Option(
        "smart.divergence-clip",
        0.0,
        "SmartFedProx under DP-FedAvg: public bound D each client clips its reported "
        "divergence to; 0: the round's clip norm C.",
        low=0.0,
    ),
    Option(
        "smart.divergence-noise",
        0.0,
        "SmartFedProx under DP-FedAvg: noise multiplier of the divergence report (std / "
        "D), charged every round; 0: the run's `dp.noise-multiplier` z.",
        low=0.0,
    ),
    Option("hier.num-edges", 2, "Hierarchical: edges (groups of SuperNodes).", low=1),
    Option(
        "hier.edge-rounds",
        2,
        "Hierarchical: edge aggregations per cloud round (tau_2).",
        low=1,
    ),
    Option(
        "hier.local-updates",
        6,
        "Hierarchical: local iterations per edge aggregation (tau_1; CG modes: epochs of "
        "one step each).",
        low=1,
    ),
    Option(
        "hier.client-fraction",
        0.2,
        "Hierarchical: share of an edge's clients in each edge aggregation (cfrac).",
        low=0.0,
        high=1.0,
        low_open=True,
    ),
    Option(
        "hier.edge-fraction",
        1.0,
        "Hierarchical: share of the edges in each cloud round (efrac).",
        low=0.0,
        high=1.0,
        low_open=True,
    ),
    Option(
        "hier.eta",
        1.0,
        "Hierarchical CP-NP: edge learning rate on the averaged deltas (1: FedAvg).",
        low=0.0,
        low_open=True,
    ),
    Option(
        "server.optimizer",
        "sgd",
        "Server optimizer on the round's aggregate (strategies with one global model; under "
        "DP post-processing of the released aggregate): `sgd` and `momentum` (Flower's "
        "FedAvgM), `adam`, `yogi`, `adagrad` (FedAdam, FedYogi, FedAdagrad; Reddi et al. "
        "2021).",
        choices=OPTIMIZERS,
    ),
    Option(
        "server.lr",
        1.0,
        "Server learning rate (sgd/momentum) or eta (adam/yogi/adagrad); sgd with 1.0 is "
        "plain FedAvg.",
        low=0.0,
        low_open=True,
    ),
    Option(
        "server.momentum",
        0.9,
        "Server momentum of `server.optimizer = momentum`.",
        low=0.0,
        high=1.0,
        high_open=True,
    ),
    Option(
        "server.beta1",
        0.9,
        "First-moment decay of adam and yogi.",
        low=0.0,
        high=1.0,
        high_open=True,
    ),
    Option(
        "server.beta2",
        0.99,
        "Second-moment decay of adam and yogi.",
        low=0.0,
        high=1.0,
        high_open=True,
    ),
    Option(
        "server.tau",
        1e-3,
        "Adaptivity tau of adam, yogi and adagrad (added to the root of the second moment).",
        low=0.0,
        low_open=True,
    ),
)

# ``dp.clip-norm = 0``: adaptive clipping starts at 0.1, as Andrew et al. (2021), TFF's
# and Flower's adaptive-clipping aggregators do (a model's first updates are often far
# above the quantile it converges to, and the noise scales with C until it gets there);
# a fixed clip, DP-SGD's per-example clip and the hierarchical modes start at 1.
ADAPTIVE_INITIAL_CLIP = 0.1
DEFAULT_CLIP = 1.0

PRIVACY_OPTIONS: tuple[Option, ...] = (
    Option(
        "dp.clip-norm",
        0.0,
        "L2 clip norm C: of each client update (DP-FedAvg; the initial C when "
        "adaptive), of each example's gradient (DP-SGD). 0: the mechanism's default, "
        f"{ADAPTIVE_INITIAL_CLIP:g} for dp-fedavg-adaptive (Andrew et al. 2021), "
        f"{DEFAULT_CLIP:g} otherwise.",
        low=0.0,
    ),
    Option(
        "dp.noise-multiplier",
        0.0,
        "z: noise std / C (DP-FedAvg, subspace-dp: on the sum of the round's updates; "
        "DP-SGD: on each batch's gradient sum). 0: calibrated from dp.target-epsilon; "
        "give one of the two.",
        low=0.0,
    ),
    Option(
        "dp.num-sampled-clients",
        5,
        "m: clients per DP round (dp.sampling = poisson: the expected number, each client "
        "taken with probability m/N; fixed: exactly m, without replacement). The mean "
        "divides by m either way.",
        low=1,
    ),
    Option(
        "dp.sampling",
        "poisson",
        "How DP-FedAvg, subspace-dp and Laplace sample clients: `poisson` (each client "
        "independently, add-or-remove-one, PLD by default) or `fixed` (exactly m without "
        "replacement, replace-one, RDP; seed 002's DP-FedAvg). Laplace: `poisson` samples "
        "q = m/N, `fixed` is the strategy's `fraction-train`; neither is charged as "
        "amplified (local noise).",
        choices=("poisson", "fixed"),
    ),
    Option(
        "dp.noise-site", "server", "Who adds the Gaussian noise.", choices=("server", "client")
    ),
    Option(
        "dp.accountant",
        "auto",
        "Privacy accountant (dp-accounting): `auto` is pld for Poisson sampling and rdp "
        "otherwise (dp-accounting's PLD has no sampling without replacement).",
        choices=("auto", "rdp", "pld"),
    ),
    Option(
        "dp.target-delta",
        1e-5,
        "delta at which epsilon is reported.",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
    ),
    Option(
        "dp.max-epsilon",
        0.0,
        "Budget: a round that would exceed it is refused (0: no limit).",
        low=0.0,
    ),
    Option(
        "dp.reproducible-noise",
        False,
        "Debugging only: derive DP noise and DP sampling from `seed` (reproducible) "
        "instead of OS entropy. No epsilon then holds against anyone who knows the seed; "
        "the ledger, the summary and metrics.csv say so.",
    ),
    Option(
        "dp.client-metrics",
        False,
        "Under a privacy mechanism, clients also report their training metrics and run "
        "federated evaluation (no epsilon covers either; written under curator/). "
        "False: clients send only what the mechanism needs.",
    ),
    Option(
        "dp.target-quantile",
        0.5,
        "Adaptive clipping: quantile of update norms that C tracks.",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
    ),
    Option(
        "dp.clip-lr",
        0.2,
        "Adaptive clipping: geometric learning rate of C.",
        low=0.0,
        low_open=True,
    ),
    Option(
        "dp.clip-count-stddev",
        0.0,
        "Adaptive clipping: noise sigma_b of the clipped count (0: max(m/20, z)).",
        low=0.0,
    ),
    Option(
        "dp.sensitivity", 15.0, "Laplace: L1 clip norm S of each update.", low=0.0, low_open=True
    ),
    Option(
        "dp.epsilon",
        0.0,
        "Laplace: epsilon per round (noise scale S/epsilon). 0: calibrated from "
        "dp.target-epsilon; give one of the two.",
        low=0.0,
    ),
    Option(
        "dp.target-epsilon",
        0.0,
        "The epsilon (at dp.target-delta) the whole run meets: the server calibrates z "
        "(DP-FedAvg, subspace-dp) or the Laplace scale once the nodes are known, and "
        "refuses a round beyond it; DP-SGD: each client calibrates its noise for this "
        "sample-level epsilon. 0: use dp.noise-multiplier / dp.epsilon.",
        low=0.0,
    ),
    Option(
        "dp.noise-std",
        0.01,
        "CG-NG / CG-NP / CP-NP: std sigma of the Gaussian noise on the averaged gradient, "
        "the parameters or the clipped delta (the seed's --sigma).",
        low=0.0,
    ),
    Option(
        "subspace.rank",
        32,
        "Subspace-DP: k, directions of the metric P = U diag(lambda) U^T + tau I.",
        low=1,
    ),
    Option(
        "subspace.tau",
        0.8,
        "Subspace-DP: tau, the metric's floor (its eigenvalue off U).",
        low=0.0,
        low_open=True,
    ),
    Option(
        "subspace.trace-budget",
        25.0,
        "Subspace-DP: B = Tr(diag(lambda)), split evenly over the k directions.",
        low=0.0,
    ),
    Option(
        "subspace.sketch-dim",
        256,
        "Subspace-DP: s > k, JL sketch dimension of Private Metric Updates (the server "
        "holds a d x s sketch).",
        low=2,
    ),
    Option(
        "subspace.pmu-every",
        40,
        "Subspace-DP: rounds between Private Metric Updates (rounds 1, 1 + every, ...).",
        low=1,
    ),
    Option(
        "subspace.lambda-ptr",
        1.0,
        "Subspace-DP: PTR gate factor; a new subspace is adopted when its eigengap and "
        "k-th eigenvalue exceed this many noise spectral norms.",
        low=0.0,
    ),
    Option(
        "subspace.init",
        "isotropic",
        "Subspace-DP: the metric before the first adopted PMU: `isotropic` (P = tau I) or "
        "`public` (top-k subspace of per-example gradients on the public warm-start split; "
        "no privacy cost).",
        choices=("isotropic", "public"),
    ),
    Option(
        "subspace.pmu-budget-reserve",
        0.15,
        "Subspace-DP: share of the noise budget (zCDP rho) spent on PMU sketches (0: no "
        "PMU, P = tau I).",
        low=0.0,
        high=1.0,
        high_open=True,
    ),
    Option(
        "subspace.allocation",
        "uniform",
        "Subspace-DP: how the trace budget is split over U's directions: `uniform` (B/k), "
        "`water-filling` (Theorem 5, from the public split's gradient energies) or "
        "`fairness` (Theorem 9: minimise the largest group distortion; needs `data.groups`).",
        choices=("uniform", "water-filling", "fairness"),
    ),
    Option(
        "subspace.quantize-bits",
        0,
        "Subspace-DP: quantize each clipped update to this many bits per coordinate in the "
        "metric's whitened coordinates, with a Gaussian top-up (0: off; 2..16).",
        low=0,
        high=16,
    ),
    Option(
        "dp.per-example",
        False,
        "CG-NG: clip per example (Opacus) and noise every step, then accounted as "
        "sample-level DP; false: the seed's per-batch clipping, no formal guarantee.",
    ),
)


SECAGG_OPTIONS: tuple[Option, ...] = (
    Option(
        "secagg.enabled",
        False,
        "Run each train round as SecAgg+ (strategies/secagg.py): the server obtains only the "
        "sum of the sampled clients' encoded updates. With dp.noise-site = 'client': "
        "distributed DP (Skellam), an epsilon against the server itself.",
    ),
    Option(
        "secagg.num-shares",
        1.0,
        "Shares of each client's secrets: a fraction (0, 1] of the cohort (1: every client "
        "is every client's neighbour) or an integer > 2 (Flower's num_shares).",
        low=0.0,
        low_open=True,
    ),
    Option(
        "secagg.reconstruction-threshold",
        0.67,
        "t: shares that reconstruct a secret, a fraction (0, 1] of the shares or an integer "
        ">= 2. A client's update stays hidden unless the server colludes with t of its "
        "neighbours; fewer than t survivors abandon the round.",
        low=0.0,
        low_open=True,
    ),
    Option(
        "secagg.clipping-range",
        8.0,
        "Update coordinates are encoded over [-range, range] (without DP each is clipped "
        "to it); with quantization-range it sets the scale.",
        low=0.0,
        low_open=True,
    ),
    Option(
        "secagg.quantization-range",
        4194304,
        "Integer levels over [-clipping-range, clipping-range] (scale = levels / 2 range).",
        low=2,
    ),
    Option(
        "secagg.modulus-range",
        4294967296,
        "M, a power of two up to 2^62: the sum is taken modulo M (Flower's default 2^32); "
        "a round whose sum could wrap around is refused before anything is sent.",
        low=4,
    ),
    Option(
        "secagg.max-weight",
        1000.0,
        "Without DP: a client's weight is min(num-examples, max-weight) / max-weight.",
        low=0.0,
        low_open=True,
    ),
    Option(
        "secagg.min-survivors",
        0,
        "The fewest vectors a round's sum needs to be unmasked (distributed DP calibrates "
        "each client's noise share for this many); 0: the reconstruction threshold.",
        low=0,
    ),
)

AUDIT_OPTIONS: tuple[Option, ...] = (
    Option(
        "audit.canaries",
        0,
        "Empirical privacy audit: k canary clients, the federation's last k partition ids "
        "(simulation: num-supernodes = N + k); each is inserted with probability 1/2, the "
        "rest are held out. 0: no audit.",
        low=0,
    ),
    Option(
        "audit.canary-rate",
        1.0,
        "Audit: probability that a sampled inserted canary uploads its direction in a round "
        "(1: it is sampled and uploads exactly like a real client).",
        low=0.0,
        high=1.0,
        low_open=True,
    ),
    Option(
        "audit.every",
        0,
        "Audit also the global model of every this many rounds (its delta from the initial "
        "model; audit.json 'history'); 0: only the final model.",
        low=0,
    ),
    Option(
        "audit.confidence",
        0.95,
        "Audit: confidence of the one-run epsilon lower bound (Steinke et al. 2023).",
        low=0.5,
        high=1.0,
        high_open=True,
    ),
)


# Keys of earlier versions, with what replaces them.
REMOVED_KEYS = {
    "dp.secure-rng": "DP noise and sampling are secret (OS entropy) by default; "
    "'dp.reproducible-noise' = true derives them from the seed for debugging",
}


def all_options() -> tuple[Option, ...]:
    """Every option the app declares, tasks included, each key once.

    Raises
    ------
    ConfigError
        If two parts declare the same key with different defaults (pyproject.toml
        can hold only one default per key).
    """
    seen: dict[str, Option] = {}
    declared = [*TOP_LEVEL, *STRATEGY_OPTIONS, *PRIVACY_OPTIONS, *SECAGG_OPTIONS, *AUDIT_OPTIONS]
    for task_cls in tasks.REGISTRY.values():
        declared.extend(task_cls.OPTIONS)
    for opt in declared:
        other = seen.setdefault(opt.key, opt)
        if other.default != opt.default or type(other.default) is not type(opt.default):
            raise ConfigError(
                f"'{opt.key}' is declared twice with different defaults "
                f"({other.default!r} and {opt.default!r})"
            )
    return tuple(seen.values())


@dataclass(frozen=True)
class RunConfig:
    """The validated run-config.

    Top-level keys are typed fields; the namespaced options of strategies, privacy
    and the task are in ``options`` (read-only, keyed as in the run-config).
    """

    task: str
    strategy: str
    privacy: str
    num_server_rounds: int
    seed: int
    output_dir: str
    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    round_timeout: float
    central_eval: bool
    resume_from: str
    options: Mapping[str, Scalar]

    def strategy_settings(self) -> strategies.StrategySettings:
        """The settings the strategy factories take."""
        return strategies.StrategySettings(
            strategy=self.strategy,
            fraction_train=self.fraction_train,
            fraction_evaluate=self.fraction_evaluate,
            min_train_nodes=self.min_train_nodes,
            min_evaluate_nodes=self.min_evaluate_nodes,
            min_available_nodes=self.min_available_nodes,
            seed=self.seed,
            options=self.options,
            round_timeout=self.round_timeout,
            local_epochs=self.local_epochs,
            num_rounds=self.num_server_rounds,
        )

    @property
    def local_epochs(self) -> int:
        """The task's local epochs per round (1 for tasks without epochs)."""
        key = tasks.get(self.task).EPOCHS_KEY
        return int(self.options[key]) if key is not None else 1

    def to_dict(self) -> dict[str, Scalar]:
        """The resolved flat run-config (every key, defaults filled in)."""
        top = {opt.key: getattr(self, opt.key.replace("-", "_")) for opt in TOP_LEVEL}
        return {**top, **self.options}


def load(run_config: Mapping[str, Any]) -> RunConfig:
    """Validate ``run_config`` (Flower's flat dict) and return the typed config.

    Raises
    ------
    ConfigError
        On an unknown key or an invalid value, naming the key and the valid values.
    """
    options = all_options()
    check_unknown_keys(run_config, options, REMOVED_KEYS)
    values = parse_options(run_config, options)
    if values["dp.clip-norm"] == 0.0:
        adaptive = values["privacy"] == "dp-fedavg-adaptive"
        values["dp.clip-norm"] = ADAPTIVE_INITIAL_CLIP if adaptive else DEFAULT_CLIP
    top = {opt.key.replace("-", "_"): values.pop(opt.key) for opt in TOP_LEVEL}
    cfg = RunConfig(**top, options=MappingProxyType(values))
    check_combinations(cfg)
    return cfg


def check_combinations(cfg: RunConfig) -> None:
    """Reject combinations of valid values that cannot run (or cannot be accounted)."""
    o = cfg.options
    if cfg.privacy != "none" and cfg.strategy == "local":
        raise ConfigError(
            f"'privacy' = {cfg.privacy!r} needs a federated strategy: under "
            "'strategy' = 'local' nothing is released; use 'privacy' = 'none'"
        )
    if cfg.privacy == "dp-sgd" and not tasks.get(cfg.task).SUPPORTS_DP_SGD:
        raise ConfigError(
            f"'privacy' = 'dp-sgd' is not available for 'task' = {cfg.task!r}; valid "
            "values for this task: " + ", ".join(repr(p) for p in _privacy_for(cfg.task))
        )
    if cfg.strategy == "clustered":
        _check_clustered(cfg)
    if cfg.strategy == "smart-fedprox":
        _check_smart(cfg)
    if cfg.strategy == "hierarchical" or cfg.privacy in FRONT_LOADED:
        _check_hierarchical(cfg)
    _check_head_only(cfg)
    if bool(o["secagg.enabled"]):
        _check_secagg(cfg)
    _check_audit(cfg)
    _check_noise_parameters(cfg)
    _check_server_optimizer(cfg)
    if cfg.privacy == "subspace-dp":
        _check_subspace(cfg)
    neighboring = None
    if cfg.privacy in registry.SELF_SAMPLING:
        settings = cfg.strategy_settings()
        sampling, mechanisms = registry.dp_sampling(settings), registry.dp_mechanisms(settings)
        neighboring = registry.dp_neighboring(settings)
    elif cfg.privacy == "laplace":
        # Never charged as amplified (strategies.laplace), whatever dp.sampling is.
        sampling, mechanisms = "none", ("laplace",)
        neighboring = registry.LAPLACE_NEIGHBORING
    else:
        return
    try:  # accountant x sampling x mechanism must be one dp-accounting supports
        registry.make_ledger(cfg.strategy_settings(), sampling, mechanisms, neighboring)
    except AccountingError as err:
        raise ConfigError(f"'dp.accountant' = {o['dp.accountant']!r}: {err}") from None
    if cfg.privacy == "dp-fedavg-adaptive" and float(o["dp.noise-multiplier"]):
        sigma_b, z = (
            registry.count_stddev(cfg.strategy_settings()),
            float(o["dp.noise-multiplier"]),
        )
        if sigma_b <= z / 2:
            raise ConfigError(
                f"'dp.clip-count-stddev' = {sigma_b:g} must exceed 'dp.noise-multiplier'/2 "
                f"= {z / 2:g} (adaptive clipping splits z between updates and count)"
            )


# Each mechanism's noise parameter: give it, or dp.target-epsilon to calibrate it.
NOISE_PARAMETER = {
    "dp-fedavg-fixed": "dp.noise-multiplier",
    "dp-fedavg-adaptive": "dp.noise-multiplier",
    "subspace-dp": "dp.noise-multiplier",
    "dp-sgd": "dp.noise-multiplier",
    "laplace": "dp.epsilon",
}


def _check_noise_parameters(cfg: RunConfig) -> None:
    """Exactly one of a mechanism's noise parameter and dp.target-epsilon; client-side
    noise only with fixed-size sampling."""
    o = cfg.options
    target = float(o["dp.target-epsilon"])
    if cfg.privacy in FRONT_LOADED and target:
        raise ConfigError(
            f"'dp.target-epsilon' = {target:g} is not available with 'privacy' = "
            f"{cfg.privacy!r} (its noise is 'dp.noise-std'); valid values with a target: "
            + ", ".join(repr(p) for p in NOISE_PARAMETER)
        )
    key = NOISE_PARAMETER.get(cfg.privacy)
    if key is None:
        return
    given = float(o[key])
    if given and target:
        raise ConfigError(
            f"both {key!r} = {given:g} and 'dp.target-epsilon' = {target:g} are given; give "
            f"one: {key!r} sets the noise, 'dp.target-epsilon' calibrates it"
        )
    if not given and not target:
        raise ConfigError(
            f"'privacy' = {cfg.privacy!r} needs its noise: set {key!r} > 0, or "
            "'dp.target-epsilon' > 0 to calibrate it for the whole run"
        )
    if (
        cfg.privacy in ("dp-fedavg-fixed", "dp-fedavg-adaptive")
        and o["dp.noise-site"] == "client"
        and o["dp.sampling"] == "poisson"
        and cfg.strategy not in registry.DATA_DEPENDENT_SELECTION
    ):
        raise ConfigError(
            "'dp.noise-site' = 'client' needs 'dp.sampling' = 'fixed': with Poisson "
            "sampling the number of noise shares in the sum, and so whether a client took "
            "part, would show in the released mean (add-or-remove-one would not hold)"
        )


def _check_server_optimizer(cfg: RunConfig) -> None:
    optimizer = server_optimizer_settings(cfg.options)
    if not optimizer.is_identity and cfg.strategy not in ONE_GLOBAL_MODEL:
        raise ConfigError(
            f"'server.optimizer' = {optimizer.name!r} (lr {optimizer.lr:g}) needs a strategy "
            f"with one global model, not 'strategy' = {cfg.strategy!r}; valid strategies: "
            + ", ".join(repr(s) for s in ONE_GLOBAL_MODEL)
        )


# What the audit's canaries fit: one global model that averages uploads, released under
# a client-level mechanism (or none). DP-SGD is sample-level (a canary client would
# exceed its epsilon by design); the hierarchical modes, clusters and SmartFedProx's
# selection are not one average of sampled uploads.
AUDIT_STRATEGIES = ("fedavg", "fedprox")
AUDIT_PRIVACY = ("none", "dp-fedavg-fixed", "dp-fedavg-adaptive", "laplace", "subspace-dp")


def _check_audit(cfg: RunConfig) -> None:
    k = int(cfg.options["audit.canaries"])
    if not k:
        return
    if k < 4:
        raise ConfigError(
            f"'audit.canaries' = {k} is too few: the estimate fits a Gaussian to the inserted "
            "and to the held-out canaries (each about k/2); valid values: 0 (off) or >= 4"
        )
    if cfg.strategy not in AUDIT_STRATEGIES:
        raise ConfigError(
            f"'audit.canaries' = {k} is not available with 'strategy' = {cfg.strategy!r}; "
            "valid strategies: " + ", ".join(repr(s) for s in AUDIT_STRATEGIES)
        )
    if cfg.privacy not in AUDIT_PRIVACY:
        raise ConfigError(
            f"'audit.canaries' = {k} is not available with 'privacy' = {cfg.privacy!r} (the "
            "audit tests a client-level guarantee of one released model); valid values: "
            + ", ".join(repr(p) for p in AUDIT_PRIVACY)
        )


# Privacy under which head-only training releases only the head: the DP-FedAvg family
# updates just the released arrays; other mechanisms would noise (or clip) everything.
HEAD_ONLY_PRIVACY = ("none", "dp-fedavg-fixed", "dp-fedavg-adaptive", "subspace-dp")


def _check_head_only(cfg: RunConfig) -> None:
    o = cfg.options
    if not bool(o.get("subspace.head-only", False)):
        return
    task_cls = tasks.get(cfg.task)
    if not any(opt.key == "subspace.head-only" for opt in task_cls.OPTIONS):
        valid = [
            name
            for name, cls in tasks.REGISTRY.items()
            if any(opt.key == "subspace.head-only" for opt in cls.OPTIONS)
        ]
        raise ConfigError(
            f"'subspace.head-only' = true: 'task' = {cfg.task!r} has no head-only mode; "
            "valid tasks: " + ", ".join(repr(t) for t in valid)
        )
    if cfg.privacy not in HEAD_ONLY_PRIVACY:
        raise ConfigError(
            f"'subspace.head-only' = true is not available with 'privacy' = "
            f"{cfg.privacy!r}; valid values: " + ", ".join(repr(p) for p in HEAD_ONLY_PRIVACY)
        )
    if cfg.strategy not in ("fedavg", "fedprox"):
        raise ConfigError(
            f"'subspace.head-only' = true is not available with 'strategy' = "
            f"{cfg.strategy!r}; valid values: 'fedavg', 'fedprox'"
        )


SECAGG_STRATEGIES = ("fedavg", "fedprox")
SECAGG_PRIVACY = ("none", "dp-fedavg-fixed", "dp-fedavg-adaptive")


def _check_secagg(cfg: RunConfig) -> None:
    o = cfg.options
    if cfg.strategy not in SECAGG_STRATEGIES:
        raise ConfigError(
            f"'secagg.enabled' = true gives the server only the sum of the updates; "
            f"'strategy' = {cfg.strategy!r} needs each client's own update or report "
            "(cluster assignments, divergences, edge sums, local models); valid values "
            "with secure aggregation: " + ", ".join(repr(v) for v in SECAGG_STRATEGIES)
        )
    if cfg.privacy not in SECAGG_PRIVACY:
        raise ConfigError(
            f"'secagg.enabled' = true is not available with 'privacy' = {cfg.privacy!r}; "
            "valid values: " + ", ".join(repr(v) for v in SECAGG_PRIVACY)
        )
    if cfg.privacy != "none" and o["dp.sampling"] != "fixed":
        raise ConfigError(
            f"'secagg.enabled' = true with 'privacy' = {cfg.privacy!r} needs 'dp.sampling' = "
            "'fixed': under Poisson sampling the cohort's size depends on who was sampled, "
            "and a secure round of fewer than 2 clients (or below the reconstruction "
            "threshold) is abandoned, a release the subsampled Gaussian's bound does not "
            "cover; valid value: 'fixed'"
        )
    if cfg.privacy == "dp-fedavg-adaptive" and o["dp.noise-site"] == "client":
        raise ConfigError(
            "'secagg.enabled' = true with 'dp.noise-site' = 'client' (distributed DP) "
            "supports 'privacy' = 'dp-fedavg-fixed' only: adaptive clipping's count of norm "
            "bits has no distributed mechanism here; use 'dp.noise-site' = 'server' (the "
            "bits are summed securely and the server noises their count)"
        )
    if bool(o.get("subspace.head-only", False)):
        raise ConfigError(
            "'subspace.head-only' = true is not available with 'secagg.enabled' = true"
        )
    if int(o["audit.canaries"]):
        raise ConfigError(
            "'audit.canaries' > 0 is not available with 'secagg.enabled' = true (the "
            "audit's canaries upload crafted updates the secure sum would hide)"
        )
    try:
        settings = registry.secagg_settings(o)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    assert settings is not None
    cohort = int(o["dp.num-sampled-clients"]) if cfg.privacy != "none" else 0
    if cfg.privacy != "none" and cohort < 2:
        raise ConfigError(
            f"'dp.num-sampled-clients' = {cohort} with 'secagg.enabled' = true: secure "
            "aggregation needs at least 2 clients per round"
        )
    if cohort and settings.survivors_needed(cohort) > cohort:
        raise ConfigError(
            f"'secagg.min-survivors' = {settings.min_survivors} exceeds the "
            f"{cohort} clients sampled per round ('dp.num-sampled-clients')"
        )


def _check_subspace(cfg: RunConfig) -> None:
    o = cfg.options
    rank, sketch = int(o["subspace.rank"]), int(o["subspace.sketch-dim"])
    if rank >= sketch:
        raise ConfigError(
            f"'subspace.rank' = {rank} must be below 'subspace.sketch-dim' = {sketch} (PMU "
            "takes the top-k eigenpairs of an s x s sketch and tests the gap to the next)"
        )
    for key, value, default in (
        ("subspace.init", o["subspace.init"], "isotropic"),
        ("subspace.allocation", o["subspace.allocation"], "uniform"),
    ):
        if value != default and int(o.get("subspace.warm-start", 0)) == 0:
            raise ConfigError(
                f"{key!r} = {value!r} needs public data: set 'subspace.warm-start' > 0 (a "
                f"vision task's public split of the held-out set), or {key!r} = {default!r}"
            )
    bits = int(o["subspace.quantize-bits"])
    if bits == 1:
        raise ConfigError(
            "'subspace.quantize-bits' = 1 cannot code a coordinate of a clipped update "
            "(the dithered codes take at least three values); valid values: 0 (off) or 2..16"
        )
    if bits and float(o["dp.noise-multiplier"]):  # calibrated z: checked when calibrated
        rounds, every = cfg.num_server_rounds, int(o["subspace.pmu-every"])
        z_train, _ = pmu_noise_multiplier(
            float(o["dp.noise-multiplier"]),
            float(o["subspace.pmu-budget-reserve"]),
            rounds,
            pmu_rounds(rounds, every),
        )
        clip = float(o["dp.clip-norm"])
        try:
            topup_noise_multiplier(
                z_train,
                clip_norm=clip,
                step=step_for_bits(clip, bits),
                num_clients=int(o["dp.num-sampled-clients"]),
            )
        except ValueError as err:
            raise ConfigError(f"'subspace.quantize-bits' = {bits}: {err}") from None
    if str(o["dp.noise-site"]) != "server":
        raise ConfigError(
            "'privacy' = 'subspace-dp' clips in the P-norm and adds elliptical noise on the "
            "server (clients would need U, d x k, every round); set 'dp.noise-site' = 'server'"
        )


def _privacy_for(task: str) -> list[str]:
    supported = tasks.get(task).SUPPORTS_DP_SGD
    return [p for p in strategies.PRIVACY if p != "dp-sgd" or supported]


# Privacy under which clustered FedAvg stays sound: under local noise every client's
# upload is itself private, so k-means over uploads is post-processing; under DP-FedAvg
# there is no k-means: each client's update enters the private mean of the model it
# was assigned by its own data (strategies.clustered_dp), one Gaussian per round.
CLUSTERED_PRIVACY = ("none", "laplace", "dp-sgd", "dp-fedavg-fixed", "dp-fedavg-adaptive")
CENTRAL_CLUSTERED = ("dp-fedavg-fixed", "dp-fedavg-adaptive")


def _check_clustered(cfg: RunConfig) -> None:
    if cfg.privacy not in CLUSTERED_PRIVACY:
        raise ConfigError(
            f"'privacy' = {cfg.privacy!r} cannot protect 'strategy' = 'clustered': valid "
            "values with clustered: " + ", ".join(repr(p) for p in CLUSTERED_PRIVACY)
        )
    if cfg.privacy in CENTRAL_CLUSTERED:
        if cfg.options["dp.noise-site"] != "server":
            raise ConfigError(
                f"'strategy' = 'clustered' with 'privacy' = {cfg.privacy!r} needs "
                "'dp.noise-site' = 'server': the server assigns each client a model from "
                "its raw scores or upload, so no guarantee could hold against it"
            )
        return
    if cfg.privacy != "none" and cfg.options["cluster.assign"] == "loss":
        raise ConfigError(
            "'cluster.assign' = 'loss' lets each client release which model fits its data "
            f"best, which no mechanism protects; with 'privacy' = {cfg.privacy!r} use "
            "'cluster.assign' = 'l2' (assignment from the already private uploads)"
        )


# SmartFedProx selects clients by the divergence each one reports. Under DP-SGD that
# report is post-processing of an already private model; under DP-FedAvg each client
# releases it clipped and noised, and the ledger charges it (strategies.dp_fedavg).
# Laplace and subspace-dp have no divergence release, hierarchical modes no selection.
SMART_PRIVACY = ("none", "dp-sgd", "dp-fedavg-fixed", "dp-fedavg-adaptive")


def _check_smart(cfg: RunConfig) -> None:
    if cfg.privacy not in SMART_PRIVACY:
        raise ConfigError(
            f"'privacy' = {cfg.privacy!r} cannot protect 'strategy' = 'smart-fedprox': it "
            "selects clients by the divergence ||w_local - w_global|| each reports, which "
            "only DP-SGD and the DP-FedAvg family make private; valid values with "
            "smart-fedprox: " + ", ".join(repr(p) for p in SMART_PRIVACY)
        )
    reports = [k for k in ("smart.divergence-clip", "smart.divergence-noise") if cfg.options[k]]
    if reports and cfg.privacy not in ("dp-fedavg-fixed", "dp-fedavg-adaptive"):
        key = reports[0]
        raise ConfigError(
            f"{key!r} = {cfg.options[key]:g} sets the divergence release of DP-FedAvg; with "
            f"'privacy' = {cfg.privacy!r} nothing is released that way; valid privacy "
            "values for it: 'dp-fedavg-fixed', 'dp-fedavg-adaptive'"
        )
    low, high = float(cfg.options["smart.mu-min"]), float(cfg.options["smart.mu-max"])
    if low > high:
        raise ConfigError(f"'smart.mu-min' = {low:g} must not exceed 'smart.mu-max' = {high:g}")


# The seed-003 client modes exist only in the client -> edge -> cloud topology, and the
# hierarchical strategy takes no other privacy (DP-FedAvg samples clients itself).
FRONT_LOADED = ("cg-ng", "cg-np", "cp-np")
HIERARCHICAL_PRIVACY = ("none", *FRONT_LOADED)


def _check_hierarchical(cfg: RunConfig) -> None:
    if cfg.strategy != "hierarchical":
        raise ConfigError(
            f"'privacy' = {cfg.privacy!r} is a client mode of hierarchical FL (seed 003); "
            "use it with 'strategy' = 'hierarchical'"
        )
    if cfg.privacy not in HIERARCHICAL_PRIVACY:
        raise ConfigError(
            f"'privacy' = {cfg.privacy!r} is not available with 'strategy' = 'hierarchical'; "
            "valid values: " + ", ".join(repr(p) for p in HIERARCHICAL_PRIVACY)
        )
    if not tasks.get(cfg.task).HIERARCHICAL:
        valid = [name for name, cls in tasks.REGISTRY.items() if cls.HIERARCHICAL]
        raise ConfigError(
            f"'strategy' = 'hierarchical' needs a task that trains for a number of local "
            f"iterations; 'task' = {cfg.task!r} does not; valid tasks: "
            + ", ".join(repr(t) for t in valid)
        )
    if bool(cfg.options["dp.per-example"]) and cfg.privacy != "cg-ng":
        raise ConfigError(
            f"'dp.per-example' = true applies to 'privacy' = 'cg-ng' only (got "
            f"{cfg.privacy!r}): noise added once to the final parameters (cg-np) has no "
            "sound per-example bound, and cp-np is already client-level"
        )


def _toml_value(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def markdown_table() -> str:
    """The README's run-config reference, generated from the declarations."""
    lines = ["| key | default | valid values | meaning |", "| --- | --- | --- | --- |"]
    for opt in all_options():
        valid = (
            opt.range_text()
            if opt.choices or opt.low is not None or opt.high is not None
            else type(opt.default).__name__
        )
        lines.append(f"| `{opt.key}` | `{_toml_value(opt.default)}` | {valid} | {opt.help} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
