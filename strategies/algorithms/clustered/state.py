"""Clustered FedAvg's state besides its K models: each client's last upload and
cluster, the last aggregated round's cluster sizes, and one history row per sampled
client per round; all of it in the run's checkpoint."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

# One history row per sampled client per round: the model it trained from, the
# cluster its upload fell into (-1: invalid reply), how it was assigned and the
# distance or score that decided it (NaN when drawn at random).
HISTORY_COLUMNS = ("round", "node-id", "assigned", "cluster", "how", "score")


class ClusterState:
    """What the strategy knows of its K clusters' members (``k``: the clusters)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.history: list[dict] = []
        self.uploads: dict[int, np.ndarray] = {}  # node -> its last valid upload, flat
        self.clusters: dict[int, int] = {}  # node -> its last (matched) cluster
        self.sizes = [0] * k  # cluster sizes of the last aggregated round
        self.round = 0  # the last aggregated round

    def largest(self) -> int:
        """Index of the largest cluster of the last aggregated round (ties: lowest)."""
        return int(np.argmax(self.sizes))

    def end_round(
        self,
        server_round: int,
        pending: dict,
        matched: dict[int, int],
        points: Mapping[int, np.ndarray],
    ) -> None:
        """Round ``server_round`` aggregated: each node of ``matched`` (node -> cluster)
        keeps its flat upload (``points``) and cluster; the sizes follow; rows written."""
        for node, k in matched.items():
            self.uploads[node], self.clusters[node] = points[node], k
        self.sizes = np.bincount(list(matched.values()), minlength=self.k).tolist()
        self.round = server_round
        self.record(server_round, pending, matched)

    def record(self, server_round: int, pending: dict, matched: dict[int, int]) -> None:
        """One history row per node ``pending`` sent a model (node -> choice)."""
        for node, (k, how, score) in sorted(pending.items()):
            row = (server_round, int(node), k, matched.get(node, -1), how, score)
            self.history.append(dict(zip(HISTORY_COLUMNS, row, strict=True)))

    def round_metrics(self, pending: dict, matched: dict[int, int]) -> dict[str, int]:
        """Cluster sizes, assignments per model and how many clients changed cluster."""
        assigned = np.bincount([k for k, _, _ in pending.values()], minlength=self.k)
        metrics = {f"cluster-{k}-size": self.sizes[k] for k in range(self.k)}
        metrics |= {f"assigned-{k}": int(assigned[k]) for k in range(self.k)}
        metrics["clusters-changed"] = sum(matched[n] != pending[n][0] for n in matched)
        return metrics

    def to_json(self) -> dict:
        """The round, sizes, clusters and history, JSON-serialisable (NaN: null)."""
        history = [
            {**row, "score": None if math.isnan(row["score"]) else row["score"]}
            for row in self.history
        ]
        return {
            "round": self.round,
            "cluster-sizes": list(self.sizes),
            "largest-cluster": self.largest(),
            "node-clusters": {str(n): c for n, c in sorted(self.clusters.items())},
            "history": history,
        }

    def state_dict(self) -> dict[str, Any]:
        """The history and the last round's sizes (the checkpoint's)."""
        return {"history": self.history, "sizes": self.sizes, "round": self.round}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.history, self.sizes, self.round = state["history"], state["sizes"], state["round"]

    def client_state_dict(self) -> dict[str, dict[int, Any]]:
        """Each client's last upload and cluster, by node id."""
        return {"uploads": self.uploads, "clusters": self.clusters}

    def load_client_state_dict(self, state: Mapping[str, dict[int, Any]]) -> None:
        """Restore :meth:`client_state_dict` (keyed by this run's node ids)."""
        self.uploads, self.clusters = state["uploads"], state["clusters"]
