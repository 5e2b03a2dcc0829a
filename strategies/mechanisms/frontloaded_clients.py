"""Front-loaded DP for hierarchical FL: CG-NG, CG-NP, CP-NP, and their ledger.

Design notes: ``docs/notes.md``, ``strategies.mechanisms.frontloaded_clients``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import INFO
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from privacy.accounting import PrivacyLedger, Release, l2_sensitivity_factor
from privacy.mechanisms import FRONT_LOADED_MODES
from protocol import keys
from protocol.records import as_float
from strategies.errors import BudgetExhausted
from strategies.mechanisms.base import PrivacyWrapper, client_mod
from strategies.mechanisms.dpsgd_clients import record_local_epsilons
from strategies.runtime.checkpoint import ledger_state, load_ledger

if TYPE_CHECKING:
    from strategies.algorithms.hierarchical_fedavg import HierarchicalFedAvg


class FrontLoadedDPClients(PrivacyWrapper):
    """Run one of frontloaded-dp-hfl's client modes under a hierarchical strategy; keep the ledger.

    Parameters
    ----------
    strategy : HierarchicalFedAvg
        The wrapped strategy (its ``client_config``, ``delta_updates`` and
        ``on_edge_aggregation`` are set here).
    mode : str
        ``cg-ng``, ``cg-np`` or ``cp-np``.
    clip, sigma : float
        ``dp.clip-norm`` (C) and ``dp.noise-std`` (σ).
    per_example : bool
        ``dp.per-example`` (CG-NG only).
    ledger, edge_view : PrivacyLedger
        The run's ledger (amplified by the edges' sampling) and the edge-view ledger
        (no amplification); only CP-NP charges them.
    rng : numpy.random.Generator
        The secret DP generator: the strategy's edge and client sampling, and the noise
        of CP-NP clients counted as zero deltas.
    **kwargs
        ``client_metrics`` and ``noise_from_seed`` (:class:`PrivacyWrapper`).
    """

    strategy: HierarchicalFedAvg

    RELEASED_METRICS = (
        *PrivacyWrapper.RELEASED_METRICS,
        "dp-epsilon-edge-view",
        keys.LOCAL_EPSILON,
    )

    def __init__(
        self,
        strategy,
        *,
        mode: str,
        clip: float,
        sigma: float,
        per_example: bool,
        ledger: PrivacyLedger,
        edge_view: PrivacyLedger,
        rng: np.random.Generator,
        **kwargs,
    ) -> None:
        if mode not in FRONT_LOADED_MODES:
            raise ValueError(f"'privacy' = {mode!r} is not one of {FRONT_LOADED_MODES}")
        super().__init__(strategy, **kwargs)
        self.mode, self.clip, self.sigma, self.per_example = mode, clip, sigma, per_example
        self.ledger, self.edge_view = ledger, edge_view
        strategy.rng = rng  # edge and client sampling: secret, amplification rests on it
        strategy.client_config.update(
            {
                keys.FRONT_LOADED_MODE: mode,
                keys.FRONT_LOADED_CLIP: clip,
                keys.FRONT_LOADED_SIGMA: sigma,
                keys.FRONT_LOADED_PER_EXAMPLE: per_example,
                keys.DPSGD_DELTA: ledger.target_delta,
                keys.DPSGD_MAX_EPSILON: float(ledger.max_epsilon or 0.0),
                **self.report_config(),
            }
        )
        self._refused = ""  # a client's budget refusal: the run stops before the next round
        strategy.delta_updates = mode == "cp-np"
        if mode == "cp-np":  # charged before anything is sent; refused: nothing is sent
            strategy.before_edge_aggregation = self._charge
            strategy.failed_upload = self._noised_zero
            if not self.client_metrics:  # the edge query: no example count either
                reported = [keys.EDGE_ID, keys.PARTITION_ID]
                strategy.edges.query_config = {keys.REPORT_METRICS: reported}
        if per_example:  # every edge aggregation's replies, not only the last one's
            strategy.on_replies = self._record_local_epsilons

    def reported_metrics(self) -> list[str]:
        """CP-NP: nothing (edges average unweighted); CG modes: the example count the
        edges weigh by and, per example, the sample-level ε."""
        if self.mode == "cp-np":
            return []
        return [keys.LOCAL_EPSILON, keys.NUM_EXAMPLES]

    def _noised_zero(self, reference: list[np.ndarray]) -> list[np.ndarray]:
        """A failed CP-NP client's contribution: N(0, σ²) on every floating array (what a
        zero delta would carry), drawn with the secret generator; zero elsewhere."""
        rng = self.strategy.rng
        return [
            rng.normal(0.0, self.sigma, size=a.shape)
            if np.issubdtype(a.dtype, np.floating) and self.sigma > 0
            else np.zeros(a.shape)
            for a in reference
        ]

    def releases(
        self, server_round: int, edges: dict[int, tuple[int, int]], sampling: str | None = None
    ) -> list[Release]:
        """One edge aggregation of CP-NP, as the ledger accounts it (the worst edge's
        sampling rate); ``sampling="none"``: as an edge sees it, without amplification
        (same neighbours, so same sensitivity: replace-one counts 2C)."""
        sampled, size = max(edges.values(), key=lambda pair: pair[0] / pair[1])
        sampling = sampling or self.ledger.sampling
        note = (
            "CP-NP: clipped, noised client deltas; largest edge sampling rate"
            if sampling != "none"
            else "CP-NP as an edge sees it: no amplification by sampling"
        )
        z = self.sigma / self.clip / l2_sensitivity_factor(self.ledger.neighboring)
        return [
            Release(
                server_round=server_round,
                kind="edge-aggregation",
                mechanism="gaussian",
                noise_multiplier=z,
                laplace_epsilon=None,
                sampling=sampling,
                sample_size=sampled,
                population=size,
                note=note,
            )
        ]

    def _charge(self, server_round: int, _edge_round: int, edges: dict) -> None:
        if not edges:
            return
        releases = self.releases(server_round, edges)
        seen = self.releases(server_round, edges, sampling="none")
        if self.ledger.would_exceed(releases) or self.edge_view.would_exceed(seen):
            raise BudgetExhausted(
                f"the next edge aggregation would exceed dp.max-epsilon = "
                f"{self.ledger.max_epsilon} (epsilon so far {self.ledger.epsilon():.4f}, "
                f"against an edge {self.edge_view.epsilon():.4f}, at delta "
                f"{self.ledger.target_delta:g}); nothing was sent"
            )
        self.ledger.charge(releases)
        self.edge_view.charge(seen)

    def on_resume(self) -> None:
        """CP-NP: the cloud round under way when the server stopped may have sent edge
        models to clients (edge aggregations 1..tau_2-1 happen inside it); its charges
        were not committed, so charge tau_2 edge aggregations, without amplification
        (their sample is lost), to both views."""
        if self.mode != "cp-np":
            return
        worst = {0: (1, 1)}  # sampling rate 1: no amplification claimed
        rounds = self.strategy.edge_rounds
        self.ledger.charge(
            [Release(**{**r.__dict__, "sampling": "none", "count": rounds,
                        "note": "interrupted cloud round, charged on resume"})
             for r in self.releases(0, worst, sampling="none")]
        )  # fmt: skip
        self.edge_view.charge(
            [Release(**{**r.__dict__, "count": rounds}) for r in self.releases(0, worst, "none")]
        )
        log(INFO, "resume: the interrupted cloud round charged as %d edge aggregations", rounds)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's round (it runs the edge aggregations and charges);
        none once a client refused a round for its budget."""
        if self._refused:
            raise BudgetExhausted(self._refused)
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate as the wrapped strategy; record what CG modes released."""
        replies = list(replies)
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if self.mode != "cp-np" and not self.per_example:
            self.ledger.record_unaccounted(
                server_round,
                kind=f"{self.mode} edge models",
                reason="per-batch gradient clipping bounds no single example's or client's "
                "influence: no formal privacy guarantee",
                details={"noise-std": self.sigma, "clip-norm": self.clip},
            )
        if metrics is not None:
            metrics = MetricRecord(self.mark(dict(metrics)))
            if self.mode == "cp-np":
                metrics[keys.DP_EPSILON] = self.ledger.epsilon()
                metrics["dp-epsilon-edge-view"] = self.edge_view.epsilon()
        return arrays, metrics

    def _record_local_epsilons(self, server_round: int, replies: list[Message]) -> None:
        for message in replies:
            if message.has_error() and keys.DPSGD_BUDGET_REFUSAL in (message.error.reason or ""):
                self._refused = f"a client refused to train: {message.error.reason}"
        record_local_epsilons(self.ledger, server_round, replies, "CG-NG", self.partitions)

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The ledgers (the generator is the wrapped strategy's)."""
        return {"ledger": ledger_state(self.ledger), "edge-view": ledger_state(self.edge_view)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the ledgers in place)."""
        load_ledger(self.ledger, state["ledger"])
        load_ledger(self.edge_view, state["edge-view"])

    def summary(self) -> None:
        """Log the mode and its guarantee, then the wrapped strategy's summary."""
        guarantee = {
            "cp-np": "client-level (epsilon, delta) in the ledger",
            "cg-ng": "sample-level, reported by clients" if self.per_example else "none",
            "cg-np": "none",
        }[self.mode]
        log(INFO, "\t├──> Front-loaded DP %s: clip %g, sigma %g", self.mode, self.clip, self.sigma)
        log(INFO, "\t│\t└── Formal guarantee: %s", guarantee)
        self.strategy.summary()


# -- the client half ----------------------------------------------------------------
def noised_zero_delta(
    config: ConfigRecord, reference: list[np.ndarray], rng: np.random.Generator
) -> list[np.ndarray]:
    """CP-NP: what a client whose training failed sends, the noise of a zero delta
    (N(0, sigma²) on every floating coordinate)."""
    sigma = as_float(config[keys.FRONT_LOADED_SIGMA])
    return [
        rng.normal(0.0, sigma, size=a.shape)
        if np.issubdtype(a.dtype, np.floating)
        else np.zeros(a.shape)
        for a in reference
    ]


# The front-loaded modes' client mod: the task clips and noises (CG-NG, CG-NP: per step;
# CP-NP: the delta); under CP-NP a failed client sends the noised zero delta.
front_loaded_mod = client_mod(
    client_noised=lambda config: config.get(keys.FRONT_LOADED_MODE) == "cp-np",
    noised_zero=noised_zero_delta,
    name="front_loaded_mod",
)
