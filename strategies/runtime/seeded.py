"""Seeded node sampling around Flower's FedAvg family (fedavg, fedprox, local).

Flower's ``FedAvg`` samples nodes with Python's global ``random`` over whatever node ids
the grid returns, and sums replies in arrival order: two runs of one configuration train
different clients and add in different orders. :class:`SeededSampling` samples instead
with a generator derived from the run seed, over the nodes in partition order
(:mod:`strategies.runtime.partitions`), and hands the wrapped strategy (built with
``fraction_* = 1``) a grid holding only the sampled nodes; replies reach it sorted by
partition id.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from protocol.records import to_record
from protocol.replies import metrics_of
from strategies.runtime.aggregation import (
    AggregationSettings,
    bounded_updates,
    bounded_weights,
    robust_arrays,
    screen_replies,
    weight_of,
    weighted_metrics,
)
from strategies.runtime.partitions import PartitionMap, grid_view, nodes_for_round, seeded_sample

_STREAM = 0x5A  # this wrapper's generators: [seed, _STREAM, 0 train | 1 evaluate]


class SeededSampling(Strategy):
    """Sample ``fraction`` of the nodes (at least ``min_*``) with the run's generator.

    Parameters
    ----------
    strategy : Strategy
        A FedAvg-family strategy that takes every node of the grid it is shown.
    fraction_train, fraction_evaluate : float
        Shares of the connected nodes sampled per round (0: no such round).
    min_train_nodes, min_evaluate_nodes, min_available_nodes : int
        As Flower's FedAvg: the sample is ``max(int(n · fraction), min_*)`` of the
        ``n`` connected nodes, after waiting for ``min_available_nodes``.
    seed : int
        Run seed.
    timeout : float
        Seconds to wait for nodes (and for their partition ids) before sampling
        from those connected.
    partitions : PartitionMap, optional
        The run's node -> partition map (default: a new one, owned by this strategy).
    aggregation : AggregationSettings, optional
        The aggregation rule and the weight bound (default: the weighted mean, weights
        bounded by ``aggregation.max-weight-share``'s default).
    """

    def __init__(
        self,
        strategy: Strategy,
        *,
        fraction_train: float,
        fraction_evaluate: float,
        min_train_nodes: int,
        min_evaluate_nodes: int,
        min_available_nodes: int,
        seed: int,
        timeout: float,
        partitions: PartitionMap | None = None,
        aggregation: AggregationSettings | None = None,
    ) -> None:
        self.strategy = strategy
        self.aggregation = aggregation if aggregation is not None else AggregationSettings()
        self.partitions = partitions if partitions is not None else PartitionMap()
        self.fraction_train, self.fraction_evaluate = fraction_train, fraction_evaluate
        self.min_train_nodes, self.min_evaluate_nodes = min_train_nodes, min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.timeout = timeout
        self.rng_train = np.random.default_rng([seed, _STREAM, 0])
        self.rng_evaluate = np.random.default_rng([seed, _STREAM, 1])
        self._reference: ArrayRecord | None = None  # this round's global arrays

    def _sample(self, grid: Grid, fraction: float, minimum: int, rng) -> list[int]:
        nodes = nodes_for_round(
            grid,
            self.partitions,
            min_available=self.min_available_nodes,
            min_sample=minimum,
            timeout=self.timeout,
        )
        return seeded_sample(nodes, fraction, minimum, rng, self.partitions)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's round on the seeded sample."""
        if self.fraction_train == 0.0:
            return []
        nodes = self._sample(grid, self.fraction_train, self.min_train_nodes, self.rng_train)
        self._reference = arrays  # what every reply must match
        return self.strategy.configure_train(server_round, arrays, config, grid_view(grid, nodes))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The aggregate of the valid replies (:func:`screen_replies`) in partition order,
        their weights bounded (:func:`bounded_weights`); nothing when none is valid.
        What became of each reply is noted in the partition map for the participation
        record; the metrics are those of the replies whose models entered the aggregate."""
        replies = self.partitions.sort_replies(replies)
        reference = self._reference
        screened = None
        if reference is not None:
            notes: dict[int, str] = {}
            screened = screen_replies(
                replies, reference, who=type(self.strategy).__name__, notes=notes
            )
            for node, what in notes.items():
                self.partitions.note(node, what)
            replies = [message for message, _ in screened]
        if screened is None:  # no round configured here: the wrapped strategy's own
            return self.strategy.aggregate_train(server_round, replies)
        assert reference is not None  # screened above
        if not replies:
            log(
                WARNING,
                "Round %d: no valid training reply, the global model is kept",
                server_round,
            )
            return None, None
        strategy = self.strategy
        weights = self._bounded(server_round, replies)
        records = [metrics_of(m, w) for m, w in zip(replies, weights, strict=True)]
        if len(reference) and _plain_fedavg(strategy):
            # Flower's FedAvg/FedProx aggregate (or a robust rule on Flower's functions),
            # from the arrays the screening decoded
            log(INFO, "aggregate_train: Received %d results and 0 failures", len(replies))
            rule = self.aggregation.rule
            if rule == "mean":
                screened, weights = self._clipped(server_round, screened, weights, reference)
                records = [metrics_of(m, w) for m, w in zip(replies, weights, strict=True)]
            result = robust_arrays(rule, screened, weights, reference, self.aggregation)
            left_out = [replies[i].metadata.src_node_id for i in result.left_out]
            for node, why in zip(left_out, result.left_out.values(), strict=True):
                self.partitions.note(node, why)
            if left_out:  # what the rule does by design: the record has each reason
                log(
                    INFO,
                    "Round %d: %d of %d replies %s: nodes %s",
                    server_round,
                    len(left_out),
                    len(replies),
                    next(iter(result.left_out.values())),
                    left_out,
                )
            if result.arrays is None:
                return None, None
            return result.arrays, weighted_metrics([records[i] for i in result.used])
        arrays, metrics = strategy.aggregate_train(server_round, replies)
        if getattr(strategy, "train_metrics_aggr_fn", None) is aggregate_metricrecords:
            metrics = weighted_metrics(records)  # per key, over the replies reporting it
        if arrays is not None and len(reference):
            # Flower's FedAvg returns float64 averages of integer arrays (BatchNorm's
            # num_batches_tracked): keep the global model's dtypes, which the next
            # round's replies are checked against.
            arrays = to_record(reference, [arrays[key].numpy() for key in reference])
        return arrays, metrics

    def _bounded(self, server_round: int, replies: list[Message]) -> list[float]:
        """The replies' ``num-examples``, each bounded (:func:`bounded_weights`); a
        clipped one is logged and noted."""
        nodes = [m.metadata.src_node_id for m in replies]
        weights, clipped = bounded_weights(
            [weight_of(m) for m in replies],
            [self.partitions.size_of(node) for node in nodes],
            float(self.aggregation.max_weight_share),
        )
        for index, why in clipped.items():
            log(WARNING, "Round %d: reply of node %d: %s", server_round, nodes[index], why)
            self.partitions.note(nodes[index], why)
        return weights

    def _clipped(
        self, server_round: int, screened: list, weights: list[float], reference: ArrayRecord
    ) -> tuple[list, list[float]]:
        """The screened replies and their weights, each update's norm bounded
        (:func:`bounded_updates`); a clipped one is logged and noted."""
        screened, weights, clipped = bounded_updates(
            screened, weights, reference, float(self.aggregation.max_update_norm)
        )
        for index, why in clipped.items():
            node = screened[index][0].metadata.src_node_id
            log(WARNING, "Round %d: reply of node %d: %s", server_round, node, why)
            self.partitions.note(node, why)
        return screened, weights

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's evaluation on the seeded sample."""
        if self.fraction_evaluate == 0.0:
            return []
        nodes = self._sample(
            grid, self.fraction_evaluate, self.min_evaluate_nodes, self.rng_evaluate
        )
        return self.strategy.configure_evaluate(
            server_round, arrays, config, grid_view(grid, nodes)
        )

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """The wrapped strategy's evaluation metrics, in partition order."""
        replies = self.partitions.sort_replies(replies)
        return self.strategy.aggregate_evaluate(server_round, replies)

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The sampling generators' states."""
        return {
            "rng-train": self.rng_train.bit_generator.state,
            "rng-evaluate": self.rng_evaluate.bit_generator.state,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the generators in place)."""
        self.rng_train.bit_generator.state = state["rng-train"]
        self.rng_evaluate.bit_generator.state = state["rng-evaluate"]

    def summary(self) -> None:
        """Log the sampling, then the wrapped strategy's summary."""
        log(
            INFO,
            "\t├──> Seeded sampling: %g of the nodes to train (at least %d), %g to evaluate "
            "(at least %d), in partition order",
            self.fraction_train,
            self.min_train_nodes,
            self.fraction_evaluate,
            self.min_evaluate_nodes,
        )
        self.strategy.summary()


def _plain_fedavg(strategy: Strategy) -> bool:
    """Whether ``strategy`` aggregates training as Flower's FedAvg does (FedAvg, and
    FedProx, which changes only what it sends)."""
    return (
        isinstance(strategy, FedAvg) and type(strategy).aggregate_train is FedAvg.aggregate_train
    )
