"""What the ServerApp may ask of a strategy beyond Flower's ``Strategy``.

Small Protocols, checked with ``isinstance``, name each optional capability once
instead of the app probing attributes with ``getattr``. Wrappers that forward unknown
attributes to the strategy they wrap (server optimizer, secure aggregation) satisfy
the wrapped strategy's Protocols too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from flwr.serverapp.strategy import Strategy

if TYPE_CHECKING:
    from flwr.app import ArrayRecord

    from privacy.accounting import PrivacyLedger


@runtime_checkable
class MultiModel(Protocol):
    """Keeps several global models (K clusters, E edges), each written and evaluated
    as ``<MODEL_LABEL>-<k>``; ``models`` is empty before round 1."""

    MODEL_LABEL: ClassVar[str]
    models: list[ArrayRecord]


@runtime_checkable
class WritesTables(Protocol):
    """Keeps per-client records (``clusters.csv``, ``selection.csv``, ``edges.csv``)."""

    def tables(self) -> dict[str, list[dict]]:
        """``table name -> rows`` to write after each round."""
        ...


@runtime_checkable
class Accounted(Protocol):
    """A privacy mechanism: owns the run's ledger and says which metrics it releases."""

    ledger: PrivacyLedger | None

    def releases_metric(self, key: str) -> bool:
        """Whether the train metric ``key`` is computed from released quantities only."""
        ...


@runtime_checkable
class Resumable(Protocol):
    """Acts once when a run resumes, before its first round (privacy wrappers charge
    what the interrupted round may have released)."""

    def on_resume(self) -> None:
        """Called after the checkpoint's state is loaded."""
        ...


def layers(strategy: Strategy) -> list[Strategy]:
    """``strategy`` and the strategies it wraps (``.strategy``), outermost first."""
    chain = [strategy]
    while isinstance(getattr(chain[-1], "strategy", None), Strategy):
        chain.append(chain[-1].strategy)
    return chain


def innermost(strategy: Strategy) -> Strategy:
    """The base strategy inside the wrappers."""
    return layers(strategy)[-1]


def ledger_of(strategy: Strategy) -> PrivacyLedger | None:
    """The run's ledger (None without a privacy mechanism)."""
    return strategy.ledger if isinstance(strategy, Accounted) else None
