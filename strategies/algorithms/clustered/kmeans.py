"""Clustered FedAvg's k-means step: the uploads (or their update directions) clustered,
and each cluster matched to one of the K global models."""

from __future__ import annotations

import warnings

import numpy as np

_KMEANS_STREAM = 0xC2  # k-means initialisation, one seed per round


def flatten(arrays: list[np.ndarray]) -> np.ndarray:
    """All arrays, in order, as one float64 vector."""
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


def kmeans_labels(points: np.ndarray, n_clusters: int, random_state: int) -> np.ndarray:
    """k-means labels of ``points`` (rows), n_init=10; a cluster may come out empty."""
    # Imported on use: every ServerApp imports this module through the strategy
    # registry, and sklearn.cluster costs ~0.1 s (bench/BENCHMARKS.md, start-up).
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():  # fewer distinct points than clusters: handled below
        warnings.simplefilter("ignore", ConvergenceWarning)
        kmeans = KMeans(n_clusters=n_clusters, n_init=10, random_state=random_state)
        return kmeans.fit_predict(points)


def match_to_models(points: np.ndarray, labels: np.ndarray, models: np.ndarray) -> np.ndarray:
    """The global model index of every point: each non-empty cluster is matched to one
    model (rows of ``models``), minimising the total squared centroid-model distance."""
    present = np.unique(labels)
    centroids = np.stack([points[labels == c].mean(axis=0) for c in present])
    cost = np.stack([((centroids - m) ** 2).sum(axis=1) for m in models], axis=1)
    return _matched(labels, present, cost)


def unit_rows(points: np.ndarray) -> np.ndarray:
    """Each row scaled to unit L2 norm; a zero row (a client that did not move) stays 0."""
    norms = np.linalg.norm(points, axis=1, keepdims=True)
    return np.divide(points, norms, out=np.zeros_like(points), where=norms > 0)


def match_by_members(labels: np.ndarray, assigned: np.ndarray, k: int) -> np.ndarray:
    """The global model index of every point: each non-empty cluster is matched to one
    of the ``k`` models, maximising how many points keep the model they trained from
    (``assigned``). Ties are broken by scipy's solver, the same way for the same input."""
    present = np.unique(labels)
    counts = np.stack([np.bincount(assigned[labels == c], minlength=k) for c in present])
    return _matched(labels, present, -counts)


def _matched(labels: np.ndarray, present: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Each label's model under the Hungarian assignment of minimum total ``cost``
    (rows: the ``present`` labels, columns: the models)."""
    from scipy.optimize import linear_sum_assignment  # on use, as KMeans above

    rows, cols = linear_sum_assignment(cost)
    to_model = {int(present[r]): int(c) for r, c in zip(rows, cols, strict=True)}
    return np.asarray([to_model[int(label)] for label in labels])


def mean_arrays(uploads: list[list[np.ndarray]]) -> list[np.ndarray]:
    """The unweighted float64 mean of the uploads, array by array."""
    return [
        np.mean(np.stack([np.asarray(a, dtype=np.float64) for a in parts]), axis=0)
        for parts in zip(*uploads, strict=True)
    ]


def kmeans_seed(seed: int, server_round: int) -> int:
    """The k-means initialisation seed of round ``server_round`` of a run of ``seed``."""
    sequence = np.random.SeedSequence([seed, _KMEANS_STREAM, server_round])
    return int(sequence.generate_state(1)[0])


def kmeans_models(
    points: np.ndarray, assigned: list[int], models_flat: np.ndarray, space: str, seed: int
) -> np.ndarray:
    """The model index (a row of ``models_flat``) each upload (a row of ``points``) is
    averaged into: k-means with at most one cluster per model, over the uploads
    (``space = "weights"``, matched to the closest models) or over the unit update
    directions from the model each client trained from (matched to keep the most
    clients on their model)."""
    n_clusters, k = min(len(models_flat), len(points)), len(models_flat)
    if space == "weights":
        return match_to_models(points, kmeans_labels(points, n_clusters, seed), models_flat)
    assigned_ = np.asarray(assigned)
    directions = unit_rows(points - models_flat[assigned_])
    # k-means on unit vectors: the Euclidean distance between two of them is
    # sqrt(2 - 2 cos), so it splits on the cosine (scikit-learn has no spherical k-means).
    return match_by_members(kmeans_labels(directions, n_clusters, seed), assigned_, k)
