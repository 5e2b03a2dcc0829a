"""Disposable-income regression on Indian personal-finance data (the SmartFedProx study): the real
Kaggle CSV (``finance.data-path``) or its synthetic twin, the study's non-IID
partitionings, a BatchNorm MLP with FedBN as an option, and sample-level DP-SGD on a
LayerNorm variant of the MLP."""

from tasks.finance import data, task
from tasks.finance.data import FinanceTable, PreparedData
from tasks.finance.task import (
    EVAL_MSE,
    EVAL_R2,
    FinanceCentralTest,
    FinanceConfig,
    FinancePartition,
    FinanceTask,
    RegressionSplit,
)


def clear_caches() -> None:
    """Forget every cached table, prepared array and partition of this process."""
    for cached in (data.load_table, data.prepared_data, task.load_partitions):
        cached.cache_clear()


__all__ = [
    "EVAL_MSE",
    "EVAL_R2",
    "FinanceCentralTest",
    "FinanceConfig",
    "FinancePartition",
    "FinanceTable",
    "FinanceTask",
    "PreparedData",
    "RegressionSplit",
    "clear_caches",
]
