"""Canary clients of the privacy audit (``audit.canaries = k``, :mod:`privacy.audit`).

A canary is a node of the federation like any other: the server samples it, sends it
the global model and config, and its reply passes through the same client mods
(clipping, client-side noise) as every client's. Which nodes are canaries is a
property of their node config: the last ``k`` partition ids, ``partition-id >=
num-partitions - k`` (in a simulation, the last ``k`` virtual SuperNodes: run with
``num-supernodes = N + k``; deployed, the SuperNodes started with those partition
ids). Real clients split the data ``num-partitions - k`` ways.

Design notes: ``docs/notes.md``, ``client_app.canary``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from config.app import PRIVACY, SEED
from privacy import audit
from privacy.settings import AuditSettings, DPSettings
from protocol import keys
from protocol.records import arrays_of

CANARIES = AuditSettings.key("canaries")


def num_canaries(run_config: Mapping[str, Any]) -> int:
    return AuditSettings.from_run_config(run_config).canaries


def real_partitions(run_config: Mapping[str, Any], num_partitions: int) -> int:
    """How many ways the real clients split the data: ``num-partitions`` minus the
    canaries."""
    real = num_partitions - num_canaries(run_config)
    if real < 1:
        raise ValueError(
            f"'{CANARIES}' = {num_canaries(run_config)} leaves no real client among "
            f"num-partitions = {num_partitions}; the federation needs N + k nodes"
        )
    return real


def canary_index(
    run_config: Mapping[str, Any], partition_id: int, num_partitions: int
) -> int | None:
    """``j`` if this node is canary ``j``, else None."""
    k = num_canaries(run_config)
    first = num_partitions - k
    return partition_id - first if k and partition_id >= first else None


def shadow_partition(index: int, real: int) -> int:
    """The real partition a canary takes its weight and evaluation split from."""
    return index % real


def partition(task, run_config: Mapping[str, Any], partition_id: int, num_partitions: int):
    """This node's partition of ``task`` among the ``num-partitions - k`` real ones: its
    own, or, for canary ``j``, the one it shadows."""
    real = real_partitions(run_config, num_partitions)
    index = canary_index(run_config, partition_id, num_partitions)
    shadow = partition_id if index is None else shadow_partition(index, real)
    return task.load_partition(shadow, real)


def reports_nothing_trained(config) -> bool:
    """Whether the train config restricts replies to keys training does not compute (a
    canary then replies without training)."""
    if keys.REPORT_METRICS not in config:
        return False
    return set(config[keys.REPORT_METRICS]) <= {keys.NUM_EXAMPLES, keys.DP_NORM_BIT}


def _scale(direction: np.ndarray, config, run_config: Mapping[str, Any]) -> float:
    """The factor of the canary's upload ``s · direction``: twice the bound the round
    clips to (:func:`privacy.audit.canary_norm`): the client's L1 bound (Laplace) or L2
    clip norm (DP-FedAvg); subspace-DP clips on the server in the P-norm, ``‖x‖_P >=
    sqrt(tau) ‖x‖``, so L2 C / sqrt(tau). Without a mechanism nothing clips: the
    canary's norm is ``dp.clip-norm`` (1 when 0), a scale."""
    if keys.LAPLACE_SENSITIVITY in config:
        bound = float(config[keys.LAPLACE_SENSITIVITY])
        return audit.canary_norm(direction, l2_bound=None, l1_bound=bound)
    if keys.DP_CLIP_NORM in config:
        clip = float(config[keys.DP_CLIP_NORM])
        return audit.canary_norm(direction, l2_bound=clip, l1_bound=None)
    clip = DPSettings.from_run_config(run_config).clip_norm or 1.0
    if PRIVACY.read(run_config) == "subspace-dp":
        # On use: subspace-dp's settings live beside its server half, which a client
        # imports only under that mechanism (client_app.mods).
        from strategies.mechanisms.subspace_dp import SubspaceSettings

        tau = SubspaceSettings.from_run_config(run_config).tau
        return audit.canary_norm(direction, l2_bound=clip / math.sqrt(tau), l1_bound=None)
    return clip


def absent_when_held_out(config, run_config: Mapping[str, Any]) -> bool:
    """Whether a held-out canary must send nothing this round: under add-or-remove-one
    (Poisson sampling) any report beyond the zero update, i.e. the adaptive clip's norm
    bit, would make "out" differ from "absent"."""
    if not config.get(keys.DP_ADAPTIVE):
        return False
    return DPSettings.from_run_config(run_config).sampling == "poisson"


HELD_OUT = "held-out audit canary: absent this round (add-or-remove-one)"


def inserted(config, run_config: Mapping[str, Any], index: int) -> bool:
    """Whether canary ``index`` inserts its direction in this round."""
    seed = int(SEED.read(run_config))
    server_round = int(config.get(keys.SERVER_ROUND, 0))
    settings = AuditSettings.from_run_config(run_config)
    return bool(audit.inclusion(seed, settings.canaries)[index]) and (
        audit.inserts_in_round(seed, index, server_round, settings.canary_rate)
    )


def update(
    received, config, run_config: Mapping[str, Any], index: int
) -> tuple[list[np.ndarray], bool]:
    """The canary's trained arrays (received + its update) and whether it inserted its
    direction this round."""
    reference = arrays_of(received)
    seed = int(SEED.read(run_config))
    if not inserted(config, run_config, index):
        return [np.array(a, copy=True) for a in reference], False
    flat = audit.flatten(reference)
    direction = audit.canary_direction(seed, index, flat.size)
    scale = _scale(direction, config, run_config)
    return audit.unflatten(flat + scale * direction, reference), True
