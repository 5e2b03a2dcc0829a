"""Front-loaded DP for hierarchical FL (seed 003): CG-NG, CG-NP, CP-NP, and their ledger.

The mechanisms run on the clients (``tasks.frontloaded``); this wrapper tells the
hierarchical strategy's clients which one to run, switches the edges to delta
aggregation for CP-NP, and keeps the run's privacy ledger honest:

* **CP-NP** is client-level Gaussian: each sampled client releases its update Δw
  clipped to L2 norm C plus N(0, σ²) noise, a Gaussian mechanism of sensitivity C and
  noise multiplier z = σ/C. Each edge aggregation samples ``cfrac`` of every edge's
  clients without replacement; a client belongs to one edge, so one edge aggregation
  is one release for every client, charged with the largest sampling rate of the
  edges that took part (an upper bound for every client), and composed over the run.
  That ε holds against the cloud and anyone who sees only edge or cloud models
  (the sample is hidden from them). An edge sees which of its clients took part and
  their individual noisy updates: against an edge, no amplification holds; that view
  is accounted separately (``dp-epsilon-edge-view``: every edge aggregation charged
  at sampling rate 1).
* **CG-NG / CG-NP** clip each *batch* gradient, not each example's: no formal
  guarantee. Every cloud round is recorded as an unaccounted release with its σ and
  clip, and the ledger summary says so. With ``dp.per-example`` CG-NG clips per
  example and adds noise in every step (full-batch DP-SGD); clients then report a
  sample-level ε, kept apart from the client-level ε.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from privacy.accounting import PrivacyLedger, Release, l2_sensitivity_factor
from strategies import keys
from strategies.base import StopTraining, TrainingWrapper
from strategies.dpsgd import record_local_epsilons

MODES = ("cg-ng", "cg-np", "cp-np")


class FrontLoadedDP(TrainingWrapper):
    """Run one of the seed's client modes under a hierarchical strategy; keep the ledger.

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
    """

    CHECKPOINT = ("ledger", "edge_view")  # strategies.checkpoint

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
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"'privacy' = {mode!r} is not one of {MODES}")
        super().__init__(strategy)
        self.mode, self.clip, self.sigma, self.per_example = mode, clip, sigma, per_example
        self.ledger, self.edge_view = ledger, edge_view
        strategy.client_config.update(
            {
                keys.FRONT_LOADED_MODE: mode,
                keys.FRONT_LOADED_CLIP: clip,
                keys.FRONT_LOADED_SIGMA: sigma,
                keys.FRONT_LOADED_PER_EXAMPLE: per_example,
                keys.DPSGD_DELTA: ledger.target_delta,
            }
        )
        strategy.delta_updates = mode == "cp-np"
        if mode == "cp-np":  # charged before anything is sent; refused: nothing is sent
            strategy.before_edge_aggregation = self._charge
        if per_example:  # every edge aggregation's replies, not only the last one's
            strategy.on_replies = self._record_local_epsilons

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
        if self.ledger.would_exceed(releases):
            raise StopTraining(
                f"the next edge aggregation would exceed dp.max-epsilon = "
                f"{self.ledger.max_epsilon} (epsilon so far {self.ledger.epsilon():.4f} at "
                f"delta {self.ledger.target_delta:g}); nothing was sent"
            )
        self.ledger.charge(releases)
        self.edge_view.charge(self.releases(server_round, edges, sampling="none"))

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's round (it runs the edge aggregations and charges)."""
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
        if metrics is not None and self.mode == "cp-np":
            metrics["dp-epsilon"] = self.ledger.epsilon()
            metrics["dp-epsilon-edge-view"] = self.edge_view.epsilon()
        return arrays, metrics

    def _record_local_epsilons(self, server_round: int, replies: list[Message]) -> None:
        record_local_epsilons(self.ledger, server_round, replies, "CG-NG")

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
