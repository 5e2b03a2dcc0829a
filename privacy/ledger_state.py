"""The ledger's configuration, side records and JSON state (schema, validation).

``state_dict`` holds the configuration, every release, every unaccounted release and
every client-reported local guarantee, plus a schema name and version; loading
validates all of it and fails with ``AccountingError`` naming
what is wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from numbers import Real

from privacy.events import (
    ACCOUNTANTS,
    ALLOWED_NEIGHBORING,
    MECHANISMS,
    SAMPLINGS,
    AccountingError,
    Release,
)

SCHEMA = "flower-privacy-lab/privacy-ledger"
SCHEMA_VERSION = 1
_TOP_KEYS = {"schema", "schema_version", "config", "releases", "unaccounted", "local_guarantees"}


def _number(
    name: str,
    value: object,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = True,
    high_open: bool = True,
) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise AccountingError(f"{name} must be a finite number, got {value!r}")
    number = float(value)
    if (number <= low if low_open else number < low) or (
        number >= high if high_open else number > high
    ):
        raise AccountingError(
            f"{name} must be in {'(' if low_open else '['}{low:g}, "
            f"{high:g}{')' if high_open else ']'}, got {value!r}"
        )
    return number


def _round(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AccountingError(f"server_round must be an integer >= 0, got {value!r}")
    return value


def _nonempty(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise AccountingError(f"{name} must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class LedgerConfig:
    """A ledger's validated configuration (see ``PrivacyLedger``)."""

    accountant: str
    sampling: str
    neighboring: str
    target_delta: float
    max_epsilon: float | None
    mechanisms: tuple[str, ...]
    rdp_orders: tuple[float, ...] | None
    pld_discretization: float | None

    def __post_init__(self) -> None:
        for name, value, choices in (
            ("accountant", self.accountant, ACCOUNTANTS),
            ("sampling", self.sampling, SAMPLINGS),
        ):
            if value not in choices:
                raise AccountingError(f"{name} must be one of {list(choices)}, got {value!r}")
        allowed = ALLOWED_NEIGHBORING[self.sampling]
        if self.neighboring not in allowed:
            raise AccountingError(
                f"sampling={self.sampling!r} must be accounted with neighboring in "
                f"{list(allowed)} (fixed-size sampling without replacement: replace-one; "
                f"Poisson: add-or-remove-one; no sampling: that, or zero-out for local "
                f"noise), "
                f"got neighboring={self.neighboring!r}"
            )
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        put("target_delta", _number("target_delta", self.target_delta, low=0.0, high=1.0))
        if self.max_epsilon is not None:
            put("max_epsilon", _number("max_epsilon", self.max_epsilon, low=0.0))
        # An empty tuple is a ledger of side records only (e.g. DP-SGD's sample-level
        # guarantees): it accepts no client-level release.
        if any(m not in MECHANISMS for m in self.mechanisms):
            raise AccountingError(
                f"mechanisms must be drawn from {list(MECHANISMS)}, got {self.mechanisms!r}"
            )
        put("mechanisms", tuple(self.mechanisms))
        put("rdp_orders", _rdp_orders(self.accountant, self.rdp_orders))
        put("pld_discretization", _pld_discretization(self.accountant, self.pld_discretization))


def _rdp_orders(accountant: str, orders) -> tuple[float, ...] | None:
    if (orders is None) != (accountant == "pld"):
        raise AccountingError(
            "rdp_orders applies to accountant='rdp' only (and must be set for it)"
        )
    if orders is None:
        return None
    if not orders:
        raise AccountingError("rdp_orders must not be empty")
    return tuple(_number("RDP order", a, low=1.0) for a in orders)


def _pld_discretization(accountant: str, interval) -> float | None:
    if (interval is None) != (accountant == "rdp"):
        raise AccountingError(
            "pld_discretization applies to accountant='pld' only (and must be set for it)"
        )
    return None if interval is None else _number("pld_discretization", interval, low=0.0, high=1.0)


@dataclass(frozen=True, kw_only=True)
class UnaccountedRelease:
    """A release with no formal privacy guarantee: recorded, never given an ε."""

    server_round: int
    kind: str
    reason: str
    details: dict

    def __post_init__(self) -> None:
        _round(self.server_round)
        _nonempty("kind", self.kind)
        _nonempty("reason", self.reason)
        if not isinstance(self.details, dict):
            raise AccountingError(f"details must be a dict, got {type(self.details).__name__}")
        try:  # a JSON copy: what is recorded is exactly what the ledger file holds
            details = json.loads(json.dumps(self.details, allow_nan=False))
        except (TypeError, ValueError) as err:
            raise AccountingError(f"details must be JSON-serialisable: {err}") from None
        object.__setattr__(self, "details", details)


@dataclass(frozen=True, kw_only=True)
class LocalGuarantee:
    """A guarantee a client reports for its own training (e.g. DP-SGD, sample-level)."""

    server_round: int
    client: str
    epsilon: float
    delta: float
    unit: str = "sample-level"

    def __post_init__(self) -> None:
        _round(self.server_round)
        _nonempty("client", self.client)
        object.__setattr__(
            self, "epsilon", _number("epsilon", self.epsilon, low=0.0, low_open=False)
        )
        object.__setattr__(
            self, "delta", _number("delta", self.delta, low=0.0, high=1.0, low_open=False)
        )
        _nonempty("unit", self.unit)


def dump(config: LedgerConfig, releases, unaccounted, local) -> dict:
    """The JSON-serialisable state of a ledger."""
    cfg = asdict(config)
    cfg["mechanisms"] = list(config.mechanisms)
    cfg["rdp_orders"] = None if config.rdp_orders is None else list(config.rdp_orders)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "config": cfg,
        "releases": [asdict(r) for r in releases],
        "unaccounted": [asdict(u) for u in unaccounted],
        "local_guarantees": [asdict(g) for g in local],
    }


def _records(state: dict, key: str, cls: type) -> list:
    items = state[key]
    if not isinstance(items, list):
        raise AccountingError(f"ledger state {key!r} must be a list")
    names = {f.name for f in fields(cls)}
    out = []
    for index, item in enumerate(items):
        if not isinstance(item, dict) or set(item) - names:
            raise AccountingError(
                f"ledger state {key}[{index}] is not a valid {cls.__name__}: {item!r}"
            )
        try:
            out.append(cls(**item))
        except TypeError as err:
            raise AccountingError(f"ledger state {key}[{index}]: {err}") from None
        except AccountingError as err:
            raise AccountingError(f"ledger state {key}[{index}]: {err}") from None
    return out


def load(state: dict) -> tuple[LedgerConfig, list, list, list]:
    """Validate ``state`` and return (config, releases, unaccounted, local guarantees)."""
    if not isinstance(state, dict) or set(state) != _TOP_KEYS:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise AccountingError(
            f"ledger state must have exactly the keys {sorted(_TOP_KEYS)}, got {got}"
        )
    if state["schema"] != SCHEMA or state["schema_version"] != SCHEMA_VERSION:
        raise AccountingError(
            f"unsupported ledger state {state['schema']!r} version "
            f"{state['schema_version']!r}; expected {SCHEMA!r} version {SCHEMA_VERSION}"
        )
    cfg = state["config"]
    names = {f.name for f in fields(LedgerConfig)}
    if not isinstance(cfg, dict) or set(cfg) != names:
        raise AccountingError(f"ledger state config must have the keys {sorted(names)}")
    for key in ("mechanisms", "rdp_orders"):
        if isinstance(cfg[key], list):
            cfg = {**cfg, key: tuple(cfg[key])}
    config = LedgerConfig(**cfg)
    return (
        config,
        _records(state, "releases", Release),
        _records(state, "unaccounted", UnaccountedRelease),
        _records(state, "local_guarantees", LocalGuarantee),
    )


def check_same_config(*, saved: LedgerConfig, current: LedgerConfig) -> None:
    """Raise AccountingError naming each field where a saved config differs."""
    diffs = [
        f"{f.name}: saved {getattr(saved, f.name)!r}, current {getattr(current, f.name)!r}"
        for f in fields(LedgerConfig)
        if getattr(saved, f.name) != getattr(current, f.name)
    ]
    if diffs:
        shown = [d if len(d) < 200 else d[:197] + "..." for d in diffs]
        raise AccountingError("saved ledger was configured differently: " + "; ".join(shown))


def statements(ledger, epsilon: float, basic: float | None) -> list[str]:
    """Plain-language statements about what the ledger's ε does and does not cover."""
    n = sum(r.count for r in ledger.releases)
    if n:
        out = [
            f"(epsilon, delta) = ({epsilon:.6g}, {ledger.target_delta:g}) is a client-level "
            f"guarantee over {n} accounted release(s): accountant {ledger.accountant}, "
            f"sampling {ledger.sampling}, neighbouring relation {ledger.neighboring}."
        ]
    else:
        out = [
            "No client-level guarantee: no release of this run was made private at "
            "the client level (no client-level epsilon exists for it)."
        ]
    if ledger.privacy_unit and n:
        out.append(
            f"Unit of privacy: {ledger.privacy_unit}; neighbouring runs differ in one such client."
        )
    if basic is not None and n:
        accountant = ledger.accountant_epsilon()
        tighter = "basic composition" if basic <= accountant else "the accountant"
        out.append(
            f"Laplace releases: basic composition gives pure epsilon = {basic:.6g} (delta = "
            f"0), the {ledger.accountant} accountant {accountant:.6g} at delta = "
            f"{ledger.target_delta:g}; the reported epsilon is the smaller ({tighter})."
        )
    if ledger.noise_from_seed and n:
        out.insert(
            0,
            "NO EPSILON HOLDS against anyone who knows the run seed: dp.reproducible-noise "
            "= true derives the DP noise and sampling from it (a debugging setting). The "
            "epsilon below holds only if the seed is secret.",
        )
    for note in getattr(ledger, "post_processing", []):
        out.append(f"Post-processing, no privacy cost: {note}.")
    if ledger.unaccounted:
        kinds = sorted({u.kind for u in ledger.unaccounted})
        out.append(
            f"NOT COVERED: {len(ledger.unaccounted)} release(s) ({', '.join(kinds)}) "
            "have no formal privacy guarantee; the run's epsilon does not cover them."
        )
    if ledger.local_guarantees:
        worst = max(ledger.local_guarantees, key=lambda g: g.epsilon)
        out.append(
            f"{len(ledger.local_guarantees)} client-reported {worst.unit} guarantee(s) are "
            f"listed separately (worst: epsilon = {worst.epsilon:.6g} at delta = "
            f"{worst.delta:g}); they protect single examples, not clients, and are not "
            "part of the client-level epsilon."
        )
    out.append(
        "Not covered by any epsilon: who was sampled, what the clients report beyond what "
        "the mechanism needs (losses, accuracies, rewards, example counts, divergences; by "
        "default clients send none of it under DP), federated evaluation, raw "
        "diagnostics and wall-clock timing: the run directory keeps them under curator/, "
        "which is not to be published."
    )
    return out
