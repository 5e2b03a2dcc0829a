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
)

STRATEGY_OPTIONS: tuple[Option, ...] = (
    Option("fedprox.mu", 0.1, "FedProx proximal weight mu (strategy=fedprox).", low=0.0),
)

PRIVACY_OPTIONS: tuple[Option, ...] = ()


def all_options() -> tuple[Option, ...]:
    """Every option the app declares, tasks included, each key once.

    Raises
    ------
    ConfigError
        If two parts declare the same key with different defaults (pyproject.toml
        can hold only one default per key).
    """
    seen: dict[str, Option] = {}
    declared = [*TOP_LEVEL, *STRATEGY_OPTIONS, *PRIVACY_OPTIONS]
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
    options: Mapping[str, Scalar]

    def strategy_settings(self) -> strategies.StrategySettings:
        """The settings the strategy factories take."""
        return strategies.StrategySettings(
            fraction_train=self.fraction_train,
            fraction_evaluate=self.fraction_evaluate,
            min_train_nodes=self.min_train_nodes,
            min_evaluate_nodes=self.min_evaluate_nodes,
            min_available_nodes=self.min_available_nodes,
            proximal_mu=float(self.options["fedprox.mu"]),
        )

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
    check_unknown_keys(run_config, options)
    values = parse_options(run_config, options)
    top = {opt.key.replace("-", "_"): values.pop(opt.key) for opt in TOP_LEVEL}
    return RunConfig(**top, options=MappingProxyType(values))


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
