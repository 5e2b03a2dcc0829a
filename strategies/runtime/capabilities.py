"""What the ServerApp may ask of a strategy beyond Flower's ``Strategy``.

Small Protocols name each optional capability once instead of the app probing
attributes with ``getattr``; :func:`provides` checks one. Wrappers that forward unknown
attributes to the strategy they wrap (server optimizer, secure aggregation) provide
the wrapped strategy's capabilities too.

The Protocols are deliberately not ``runtime_checkable``: since Python 3.12,
``isinstance`` against one looks members up with ``inspect.getattr_static``, which
skips a wrapper's forwarding ``__getattr__``, so a wrapped DP strategy looked like no
privacy mechanism at all (no ledger, nothing charged on resume). ``isinstance``
against them raises ``TypeError`` on every Python: the mistake cannot come back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, cast

from flwr.serverapp.strategy import Strategy

if TYPE_CHECKING:
    from flwr.app import ArrayRecord

    from privacy.accounting import PrivacyLedger


class MultiModel(Protocol):
    """Keeps several global models (K clusters, E edges), each written and evaluated
    as ``<MODEL_LABEL>-<k>``; ``models`` is empty before round 1."""

    MODEL_LABEL: ClassVar[str]
    models: list[ArrayRecord]


class NoGlobalModel(Protocol):
    """Keeps no global model (each client trains its own): no central evaluation."""

    NO_GLOBAL_MODEL: ClassVar[str]  # why, as the ServerApp logs it


class WritesTables(Protocol):
    """Keeps per-client records (``clusters.csv``, ``selection.csv``, ``edges.csv``)."""

    def tables(self) -> dict[str, list[dict]]:
        """``table name -> rows`` to write after each round."""
        ...


class Accounted(Protocol):
    """A privacy mechanism: owns the run's ledger and says which metrics it releases."""

    ledger: PrivacyLedger | None

    def releases_metric(self, key: str) -> bool:
        """Whether the train metric ``key`` is computed from released quantities only."""
        ...


class Resumable(Protocol):
    """Acts once when a run resumes, before its first round (privacy wrappers charge
    what the interrupted round may have released)."""

    def on_resume(self) -> None:
        """Called after the checkpoint's state is loaded."""
        ...


def layers(strategy: Strategy) -> list[Strategy]:
    """``strategy`` and the strategies it wraps (``.strategy``), outermost first."""
    chain = [strategy]
    while isinstance(inner := getattr(chain[-1], "strategy", None), Strategy):
        chain.append(inner)
    return chain


def innermost(strategy: Strategy) -> Strategy:
    """The base strategy inside the wrappers."""
    return layers(strategy)[-1]


def protocol_members(capability: type) -> tuple[str, ...]:
    """The attributes and public methods the Protocol ``capability`` declares."""
    names = set(vars(capability).get("__annotations__", {}))
    names |= {n for n, v in vars(capability).items() if callable(v) and not n.startswith("_")}
    return tuple(sorted(names))


def provides(strategy: object, capability: type) -> bool:
    """Whether ``strategy`` has every member of the Protocol ``capability``, looked up
    with ``hasattr``, which follows a wrapper's forwarding ``__getattr__`` (the module
    docstring says why not ``isinstance``)."""
    return all(hasattr(strategy, name) for name in protocol_members(capability))


def ledger_of(strategy: Strategy) -> PrivacyLedger | None:
    """The run's ledger (None without a privacy mechanism)."""
    return cast(Accounted, strategy).ledger if provides(strategy, Accounted) else None
