"""Subspace-DP-FL: geometry-aligned DP-FedAvg with Private Metric Updates.

One home for the mechanism: the server wrapper (:class:`SubspaceDP`, ``strategy``)
composes the metric and PMU (``geometry``), the budget split (``budget``) and the
P-norm clipped sum (``aggregate``); ``settings`` declares its run-config keys. Design
notes: ``docs/notes.md``, ``strategies.mechanisms.subspace_dp``.
"""

from strategies.mechanisms.subspace_dp.budget import pmu_rounds
from strategies.mechanisms.subspace_dp.geometry import ALLOCATIONS, MAX_SKETCH_BYTES, POOLED
from strategies.mechanisms.subspace_dp.settings import SubspaceSettings
from strategies.mechanisms.subspace_dp.strategy import SubspaceDP

__all__ = [
    "ALLOCATIONS",
    "MAX_SKETCH_BYTES",
    "POOLED",
    "SubspaceDP",
    "SubspaceSettings",
    "pmu_rounds",
]
