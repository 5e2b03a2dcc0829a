"""Central evaluation of the global model(s) on the server's test set."""

from __future__ import annotations

from collections.abc import Callable

import torch
from flwr.app import ArrayRecord, MetricRecord

from strategies.capabilities import MultiModel
from tasks.base import Task

# Metric-name parts that say which way is better (tasks' EVAL_* keys).
HIGHER_IS_BETTER = ("reward", "accuracy", "r2", "auc", "hr10")
LOWER_IS_BETTER = ("loss", "mse")


def central_eval(
    task: Task, model: torch.nn.Module, strategy=None, test_set=None
) -> Callable[[int, ArrayRecord], MetricRecord]:
    """Evaluation of the global model on the central test set (``test_set``, loaded
    now when not given).

    A strategy that keeps several models (:class:`~strategies.capabilities.MultiModel`)
    has each one evaluated too, as ``<label>-<k>-<key>``. For clusters (K global
    models) the plain keys are :func:`best_of_clusters`; otherwise (hierarchical edges)
    they are the global model's own.
    """
    if test_set is None:
        test_set = task.load_central_test()

    def evaluate_one(arrays: ArrayRecord) -> dict:
        model.load_state_dict(arrays.to_torch_state_dict())
        return task.evaluate(model, test_set)

    def evaluate(_server_round: int, arrays: ArrayRecord) -> MetricRecord:
        if not isinstance(strategy, MultiModel) or not strategy.models:  # none before round 1
            return MetricRecord(evaluate_one(arrays))
        per_model = [evaluate_one(m) for m in strategy.models]
        if strategy.MODEL_LABEL == "cluster":
            return MetricRecord(best_of_clusters(per_model))
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
    clients would pick with perfect assignment. Other keys (counts, stds, gaps) are
    model 0's.
    """
    merged = _prefixed(per_model, "cluster")
    for key, first in per_model[0].items():
        values = [metrics[key] for metrics in per_model]
        if "std" in key:
            merged[key] = first
        elif any(word in key for word in HIGHER_IS_BETTER):
            merged[key] = max(values)
        elif any(word in key for word in LOWER_IS_BETTER):
            merged[key] = min(values)
        else:
            merged[key] = first
    return merged
