"""Clustered FedAvg: K global models, updated by k-means over the clients' uploads or
by each client's assignment (IFCA).

The clustered FL of the federated-RL study ("Clustered Federated Learning",
``cluster_and_average_models`` and ``find_closest_model``), with the loss-based
assignment of IFCA (Ghosh et al. 2020, "An Efficient Framework for Clustered Federated
Learning", arXiv:2006.04088).

The package: :mod:`.strategy` (the strategy, composed of) :mod:`.assignment` (which
model each client trains from), :mod:`.kmeans` (the k-means step), :mod:`.state`
(members, sizes, history: the checkpoint's state) and :mod:`.settings` (``cluster.*``).

Design notes: ``docs/notes.md``, ``strategies.algorithms.clustered``.
"""

from strategies.algorithms.clustered.kmeans import match_by_members, unit_rows
from strategies.algorithms.clustered.settings import (
    CENTRAL_CLUSTERED,
    CLUSTERED_PRIVACY,
    ClusterSettings,
)
from strategies.algorithms.clustered.strategy import ClusteredFedAvg, model_seeds

__all__ = [
    "CENTRAL_CLUSTERED",
    "CLUSTERED_PRIVACY",
    "ClusterSettings",
    "ClusteredFedAvg",
    "match_by_members",
    "model_seeds",
    "unit_rows",
]
