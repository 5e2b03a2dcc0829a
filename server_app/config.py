"""The run-config: every key the app accepts, parsed once into a frozen object.

The top-level keys are declared here; every other key belongs to the part that reads
it, declared once as a field of its settings dataclass (:mod:`config.settings`:
``fedprox.*``, ``aggregation.*``, ``cluster.*``, ``smart.*``, ``hier.*``, ``server.*``, ``dp.*``,
``subspace.*``, ``secagg.*``, ``audit.*``, ``run.*``) or as the task's ``OPTIONS``.
:func:`load` rejects unknown keys and invalid values with a message naming the key and
the valid values, then lets each part check the combination (``check``), before
anything is trained. ``pyproject.toml`` carries the same defaults, generated from the
declarations (:func:`pyproject_defaults`, written by ``docs/gen_tables.py``), because
Flower only accepts overrides of keys it has a default for.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import strategies
import tasks
from config.app import NUM_SERVER_ROUNDS, PRIVACY, SEED, STRATEGY, TASK
from config.options import ConfigError, Option, Scalar, check_unknown_keys, parse_options
from config.settings import Choice, Settings, Typed, listed
from privacy.accounting import AccountingError
from protocol import presets
from server_app.audit import AuditSettings
from server_app.failures import FailurePolicy
from server_app.rounds import ConsoleSettings
from server_app.tracking import TrackingSettings
from strategies import registry
from strategies.algorithms.clustered import ClusterSettings
from strategies.algorithms.hierarchical_fedavg import HierSettings
from strategies.algorithms.server_optimizer import ServerOptimizerSettings
from strategies.algorithms.smart_fedprox.private import DivergenceSettings
from strategies.algorithms.smart_fedprox.strategy import SmartSettings
from strategies.mechanisms.base import ADAPTIVE_INITIAL_CLIP, DEFAULT_CLIP, DPSettings
from strategies.mechanisms.correlated_noise import CorrelatedSettings
from strategies.mechanisms.dp_fedavg_adaptive import AdaptiveClipSettings, count_stddev
from strategies.mechanisms.subspace_dp import SubspaceSettings
from strategies.runtime.aggregation import AggregationSettings
from strategies.secure.secagg_plus import SecAggSettings

TOP_LEVEL: tuple[Option, ...] = (
    replace(TASK, choices=tuple(tasks.REGISTRY)),
    replace(STRATEGY, choices=tuple(strategies.STRATEGIES)),
    replace(PRIVACY, choices=tuple(strategies.PRIVACY)),
    NUM_SERVER_ROUNDS,
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
    Option(
        "preset",
        "",
        "A preset of experiments/ by name (e.g. 'digits-dp-eps8'): its keys replace the "
        "defaults; keys given on the command line with a value other than the default "
        "replace the preset's. Empty: no preset.",
    ),
)

# The parts that own run-config keys, in the order the reference lists them.
PARTS: tuple[type[Settings], ...] = (
    FailurePolicy,
    registry.FedProxSettings,
    AggregationSettings,
    ClusterSettings,
    SmartSettings,
    DivergenceSettings,
    HierSettings,
    ServerOptimizerSettings,
    DPSettings,
    AdaptiveClipSettings,
    CorrelatedSettings,
    SubspaceSettings,
    SecAggSettings,
    AuditSettings,
    TrackingSettings,
    ConsoleSettings,
)

# Keys of earlier versions, with what replaces them.
REMOVED_KEYS = {
    "dp.secure-rng": "DP noise and sampling are secret (OS entropy) by default; "
    "'dp.reproducible-noise' = true derives them from the seed for debugging",
}


def part_options(part: type[Settings]) -> tuple[Option, ...]:
    """A part's settings fields as run-config options."""
    return part.options()


def all_options() -> tuple[Option, ...]:
    """Every option the app declares, tasks included, each key once.

    Raises
    ------
    ConfigError
        If two parts declare the same key with different defaults (pyproject.toml
        can hold only one default per key).
    """
    seen: dict[str, Option] = {}
    declared = [*TOP_LEVEL, *(opt for part in PARTS for opt in part_options(part))]
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
class RunConfig(Typed):
    """The validated run-config.

    Top-level keys are typed fields; the namespaced options of strategies, privacy
    and the task are in ``options`` (read-only, keyed as in the run-config), and each
    part reads its own typed settings with ``part`` (``cfg.part(DPSettings).clip_norm``),
    each built once per run and shared with the strategy settings and the checks.
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
    preset: str
    options: Mapping[str, Scalar]
    parts: dict[tuple[type, int], tuple[Mapping[str, Scalar], Any]] = field(
        default_factory=dict, compare=False, repr=False
    )

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
            parts=self.parts,
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


def load(run_config: Mapping[str, Any], explicit: Collection[str] | None = None) -> RunConfig:
    """Validate ``run_config`` (Flower's flat dict) and return the typed config, its
    ``preset`` resolved (:mod:`protocol.presets`).

    ``explicit``: the keys the user gave on the command line, where known (the
    ServerApp reads them from ``Grid.run``): a key given at its default value that a
    preset sets otherwise is refused, as the ClientApps would run the preset's value.

    Raises
    ------
    ConfigError
        On an unknown key or an invalid value, naming the key and the valid values.
    """
    options = all_options()
    run_config = resolve_preset(run_config, explicit)
    check_unknown_keys(run_config, options, REMOVED_KEYS)
    values = parse_options(run_config, options)
    if values["dp.clip-norm"] == 0.0:
        adaptive = values["privacy"] == "dp-fedavg-adaptive"
        values["dp.clip-norm"] = ADAPTIVE_INITIAL_CLIP if adaptive else DEFAULT_CLIP
    top: dict[str, Any] = {opt.key.replace("-", "_"): values.pop(opt.key) for opt in TOP_LEVEL}
    cfg = RunConfig(**top, options=MappingProxyType(values))
    check_combinations(cfg)
    return cfg


def defaults() -> dict[str, Scalar]:
    """Every key's declared default (equal to ``pyproject.toml``'s, a test checks)."""
    return {opt.key: opt.default for opt in all_options()}


def resolve_preset(
    run_config: Mapping[str, Any], explicit: Collection[str] | None = None
) -> dict[str, Any]:
    """``run_config`` with its preset applied, as the ClientApps apply it."""
    try:
        if explicit is not None:
            presets.refuse_ambiguous(run_config, explicit, defaults())
        return presets.resolve(run_config, defaults())
    except presets.PresetError as err:
        raise ConfigError(str(err)) from None


def check_combinations(cfg: RunConfig) -> None:
    """Reject combinations of valid values that cannot run (or cannot be accounted):
    the app-wide rules here, then each part's own ``check``."""
    if cfg.privacy != "none" and cfg.strategy == "local":
        raise ConfigError(
            f"'privacy' = {cfg.privacy!r} needs a federated strategy: under "
            "'strategy' = 'local' nothing is released; use 'privacy' = 'none'"
        )
    if cfg.privacy == "dp-sgd" and "dp-sgd" not in _traits(cfg.task):
        valid = [p for p in strategies.PRIVACY if p != "dp-sgd"]
        raise ConfigError(
            f"'privacy' = 'dp-sgd' is not available for 'task' = {cfg.task!r}; valid "
            "values for this task: " + listed(valid)
        )
    _check_head_only(cfg)
    choice = Choice(
        strategy=cfg.strategy,
        privacy=cfg.privacy,
        task=cfg.task,
        num_rounds=cfg.num_server_rounds,
        options=cfg.options,
        traits=_traits(cfg.task),
        tasks_with={t: tuple(n for n in tasks.REGISTRY if t in _traits(n)) for t in TRAITS},
        head_only=bool(cfg.options.get("subspace.head-only", False)),
        warm_start=int(cfg.options.get("subspace.warm-start", 0)),
        parts=cfg.parts,
    )
    for part in registry.settings_to_check(PARTS, cfg.strategy, cfg.privacy, choice):
        try:
            part.check(choice)
        except ValueError as err:  # SettingsError, or a settings class's own range check
            raise ConfigError(str(err)) from None
    _check_ledger(cfg)


# What a task may support, as the parts' checks ask about it.
TRAITS = ("dp-sgd", "hierarchical", "head-only")


def _traits(task: str) -> frozenset[str]:
    cls = tasks.get(task)
    traits = {"dp-sgd"} if cls.SUPPORTS_DP_SGD else set()
    if cls.HIERARCHICAL:
        traits.add("hierarchical")
    if any(opt.key == "subspace.head-only" for opt in cls.OPTIONS):
        traits.add("head-only")
    return frozenset(traits)


# Privacy under which head-only training releases only the head: the DP-FedAvg family
# updates just the released arrays; other mechanisms would noise (or clip) everything.
HEAD_ONLY_PRIVACY = ("none", "dp-fedavg-fixed", "dp-fedavg-adaptive", "subspace-dp")


def _check_head_only(cfg: RunConfig) -> None:
    """Head-only training (a task's mode) with the strategies and mechanisms that
    release only the head."""
    if not bool(cfg.options.get("subspace.head-only", False)):
        return
    if "head-only" not in _traits(cfg.task):
        valid = [name for name in tasks.REGISTRY if "head-only" in _traits(name)]
        raise ConfigError(
            f"'subspace.head-only' = true: 'task' = {cfg.task!r} has no head-only mode; "
            "valid tasks: " + listed(valid)
        )
    if cfg.privacy not in HEAD_ONLY_PRIVACY:
        raise ConfigError(
            f"'subspace.head-only' = true is not available with 'privacy' = "
            f"{cfg.privacy!r}; valid values: " + listed(HEAD_ONLY_PRIVACY)
        )
    if cfg.strategy not in ("fedavg", "fedprox"):
        raise ConfigError(
            f"'subspace.head-only' = true is not available with 'strategy' = "
            f"{cfg.strategy!r}; valid values: 'fedavg', 'fedprox'"
        )


def _check_ledger(cfg: RunConfig) -> None:
    """The accountant x sampling x mechanism of the run must be one dp-accounting
    supports; adaptive clipping's count noise must leave the updates their share."""
    dp = cfg.part(DPSettings)
    settings = cfg.strategy_settings()
    if cfg.privacy in registry.SELF_SAMPLING:
        sampling, mechanisms = registry.dp_sampling(settings), registry.dp_mechanisms(settings)
        neighboring = registry.dp_neighboring(settings)
    elif cfg.privacy == "laplace":
        # Never charged as amplified (strategies.mechanisms.laplace), whatever dp.sampling is.
        sampling, mechanisms = "none", ("laplace",)
        neighboring = registry.LAPLACE_NEIGHBORING
    else:
        return
    try:
        registry.make_ledger(settings, sampling, mechanisms, neighboring)
    except AccountingError as err:
        raise ConfigError(f"'dp.accountant' = {dp.accountant!r}: {err}") from None
    z = dp.noise_multiplier
    if cfg.privacy == "dp-fedavg-adaptive" and z:
        given = cfg.part(AdaptiveClipSettings).clip_count_stddev
        sigma_b = count_stddev(given, dp.num_sampled_clients, z)
        if sigma_b <= z / 2:
            raise ConfigError(
                f"'dp.clip-count-stddev' = {sigma_b:g} must exceed 'dp.noise-multiplier'/2 "
                f"= {z / 2:g} (adaptive clipping splits z between updates and count)"
            )


# Keys a rerun leaves out: where to continue from, and the preset (the resolved keys
# are given instead, so a rerun does not depend on the preset file staying the same).
NOT_RERUN = ("resume-from", "preset")


def command_line(cfg: RunConfig) -> dict[str, Scalar]:
    """The keys a ``--run-config`` must give to make ``cfg`` again: those whose value
    differs from the default, and ``dp.clip-norm`` only where it is not the value that
    a 0 (the default) stands for."""
    fill = ADAPTIVE_INITIAL_CLIP if cfg.privacy == "dp-fedavg-adaptive" else DEFAULT_CLIP
    given = defaults()
    return {
        key: value
        for key, value in cfg.to_dict().items()
        if key not in NOT_RERUN
        and not (key == "dp.clip-norm" and value == fill)
        and (type(value) is not type(given[key]) or value != given[key])
    }


def run_config_arg(values: Mapping[str, Scalar]) -> str:
    """``values`` as one ``--run-config`` string that Flower parses back to them
    (``flwr.common.config.parse_config_args``)."""
    return " ".join(f"{key}={_arg_value(value)}" for key, value in values.items())


def _arg_value(value: Scalar) -> str:
    if isinstance(value, str):
        return f'"{value}"' if "'" in value else f"'{value}'"
    return _toml_value(value)


def _toml_value(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def pyproject_defaults() -> str:
    """The ``[tool.flwr.app.config]`` lines of ``pyproject.toml``, one per declared key
    with its default, generated from the declarations (``docs/gen_tables.py``)."""
    lines = []
    for opt in all_options():
        key = opt.key if "." not in opt.key else json.dumps(opt.key)
        value = json.dumps(opt.default) if isinstance(opt.default, str) else None
        lines.append(f"{key} = {value or _toml_value(opt.default)}")
    return "\n".join(lines)


def markdown_table() -> str:
    """The docs' run-config reference, generated from the declarations."""
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
