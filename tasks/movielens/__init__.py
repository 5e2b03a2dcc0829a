"""MovieLens-1M recommendations with Neural Collaborative Filtering (Subspace-DP-FL): the real
``ratings.dat`` (``movielens.data-path``) or a synthetic twin with latent structure,
users as clients, NeuMF, and NCF's leave-one-out evaluation (AUC, HR@10)."""

from tasks.movielens import data, task
from tasks.movielens.data import PreparedRatings, Ratings
from tasks.movielens.model import NeuMF
from tasks.movielens.task import (
    EVAL_AUC,
    EVAL_HR10,
    HeldOut,
    MovieLensCentralTest,
    MovieLensConfig,
    MovieLensPartition,
    MovieLensTask,
    PositiveInteractions,
)


def clear_caches() -> None:
    """Forget every cached rating table, prepared split and partition of this process."""
    for cached in (data.load_ratings, data.prepared_ratings, task.load_partition_data):
        cached.cache_clear()


__all__ = [
    "EVAL_AUC",
    "EVAL_HR10",
    "HeldOut",
    "MovieLensCentralTest",
    "MovieLensConfig",
    "MovieLensPartition",
    "MovieLensTask",
    "NeuMF",
    "PositiveInteractions",
    "PreparedRatings",
    "Ratings",
    "clear_caches",
]
