"""Central evaluation of the global model(s) on the server's test set."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord
from flwr.app.typing import MetricRecordValues

from protocol.records import to_state_dict
from strategies.runtime.capabilities import MultiModel, provides
from tasks.base import Task

# Metric-name parts that say which way is better (tasks' EVAL_* keys).
HIGHER_IS_BETTER = ("reward", "accuracy", "r2", "auc", "hr10")
LOWER_IS_BETTER = ("loss", "mse")
SPREADS = ("std", "se")  # key parts of a metric's spread, which follows its model


def central_eval(
    task: Task, model: torch.nn.Module, strategy=None, test_set=None
) -> Callable[[int, ArrayRecord], MetricRecord]:
    """Evaluation of the global model on the central test set (``test_set``, loaded
    now when not given).

    A strategy that keeps several models (:class:`~strategies.runtime.capabilities.MultiModel`)
    has each one evaluated too, as ``<label>-<k>-<key>``. For clusters (K global
    models) the plain keys are :func:`best_of_clusters`; otherwise (hierarchical edges)
    they are the global model's own.
    """
    if test_set is None:
        test_set = task.load_central_test()

    def evaluate_one(arrays: ArrayRecord) -> dict:
        model.load_state_dict(to_state_dict(arrays))
        return task.evaluate(model, test_set)

    def evaluate(_server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if not provides(strategy, MultiModel) or not strategy.models:  # none before round 1
            return MetricRecord(evaluate_one(arrays))
        per_model = [evaluate_one(m) for m in strategy.models]
        if strategy.MODEL_LABEL == "cluster":
            return MetricRecord(dict[str, MetricRecordValues](best_of_clusters(per_model)))
        return MetricRecord(evaluate_one(arrays) | _prefixed(per_model, strategy.MODEL_LABEL))

    return evaluate


def _prefixed(per_model: list[dict[str, float]], label: str) -> dict[str, float]:
    return {
        f"{label}-{k}-{key}": value
        for k, metrics in enumerate(per_model)
        for key, value in metrics.items()
    }


def best_of_clusters(per_model: list[dict[str, float]]) -> dict[str, float]:
    """Merge the central evaluation of K cluster models.

    Every model's metrics appear as ``cluster-<k>-<key>``. The plain keys are the
    best model's per key (highest reward, accuracy, R², AUC or hit rate; lowest loss
    or squared error): for a per-planet reward, that is the cluster model the planet's
    clients would pick with perfect assignment. A spread (a key with a ``std`` or
    ``se`` part, e.g. ``eval-reward-se-moon``) is that of the model picked for its
    headline key (the same key without that part, ``eval-reward-moon``), so a mean and
    its standard error describe one model. Other keys (counts, gaps, and spreads
    without a headline) are model 0's.
    """
    merged = _prefixed(per_model, "cluster")
    best: dict[str, int] = {}  # key -> index of the model picked for it
    for key in per_model[0]:
        values = [metrics[key] for metrics in per_model]
        if _spread_headline(key) is not None:
            continue
        if any(word in key for word in HIGHER_IS_BETTER):
            best[key] = int(np.argmax(values))
        elif any(word in key for word in LOWER_IS_BETTER):
            best[key] = int(np.argmin(values))
    for key in per_model[0]:
        k = best.get(key, best.get(_spread_headline(key) or key, 0))
        merged[key] = per_model[k][key]
    return merged


def _spread_headline(key: str) -> str | None:
    """``key`` without its ``std``/``se`` parts, if it has any (else None)."""
    parts = key.split("-")
    kept = [part for part in parts if part not in SPREADS]
    return "-".join(kept) if len(kept) < len(parts) else None
