"""The single-agent baseline: every client trains only its own model.

Nothing is averaged. Clients are sampled exactly as FedAvg samples them, so each
client takes the same number of local steps as it would under FedAvg; the server
only tells them to train and evaluate their own model, which each client keeps
between rounds in ``context.state``.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from protocol import keys


class LocalOnly(FedAvg):
    """FedAvg's sampling and metric aggregation, without model averaging.

    Contract with the client: when the train or evaluate config carries
    ``config["local-only"] = True``, the client loads its own model from
    ``context.state["local-model"]`` (falling back to the received arrays in its
    first round), trains or evaluates it, and stores it back::

        if config.get("local-only"):
            if "local-model" in context.state:
                arrays = context.state["local-model"]
            ...train...
            context.state["local-model"] = ArrayRecord(model.state_dict())

    ``aggregate_train`` returns no arrays, so the initial "global" model is never
    replaced, and server-side evaluation of it is meaningless: the ServerApp skips it
    for this strategy and reports the clients' evaluation of their own models.
    """

    NO_GLOBAL_MODEL = "strategy=local keeps no global model: central evaluation is skipped"

    def summary(self) -> None:
        """Log summary configuration of the strategy."""
        log(INFO, "\t├──> Local training only: no aggregation of models")
        super().summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample as FedAvg does and tell clients to train their own model."""
        config[keys.LOCAL_ONLY] = True
        return super().configure_train(server_round, arrays, config, grid)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample as FedAvg does and tell clients to evaluate their own model."""
        config[keys.LOCAL_ONLY] = True
        return super().configure_evaluate(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate the clients' training metrics; keep no averaged model."""
        _, metrics = super().aggregate_train(server_round, replies)
        return None, metrics
