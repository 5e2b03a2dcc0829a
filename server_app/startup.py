"""Start-up checks against the federation, before round 1.

Design notes: ``docs/notes.md``, ``server_app.startup``.
"""

from __future__ import annotations

import time
from collections import Counter
from logging import INFO

from flwr.common.logger import log
from flwr.serverapp import Grid

from server_app.audit import AuditSettings
from server_app.config import RunConfig
from strategies import StopTraining
from strategies.algorithms.clustered import ClusteredFedAvg
from strategies.algorithms.hierarchical_fedavg import HierSettings
from strategies.runtime.capabilities import innermost
from strategies.runtime.nodes import fedavg_sample_size
from strategies.runtime.partitions import partition_map
from tasks.base import Task

SETTLE_S = 1.0  # simulation: virtual SuperNodes register within this of the first one
LOG_EVERY_S = 10.0


def needs(cfg: RunConfig, strategy) -> dict[str, int]:
    """``key -> the number of connected nodes it needs``."""
    need = {"min-available-nodes": cfg.min_available_nodes}
    if cfg.strategy != "local":
        need["min-train-nodes"] = cfg.min_train_nodes
    cohort = getattr(strategy, "num_sampled_clients", None) or getattr(
        strategy, "expected_clients", None
    )
    if cohort:
        need["dp.num-sampled-clients"] = int(cohort)
    if cfg.strategy == "hierarchical":
        need["hier.num-edges"] = cfg.part(HierSettings).num_edges
    return need


def _is_simulation(grid: Grid) -> bool:
    """Flower's simulation runs the ServerApp on an ``InMemoryGrid``."""
    return type(grid).__name__ == "InMemoryGrid"


def wait_for_federation(grid: Grid, need: dict[str, int], timeout: float) -> list[int]:
    """The connected node ids once every key's need is met, or what is there when it
    cannot be met any more (a simulation's count is final; a deployment waited
    ``timeout`` seconds)."""
    needed = max(need.values())
    simulation = _is_simulation(grid)
    started = time.monotonic()
    logged = -LOG_EVERY_S
    while True:
        nodes = sorted(grid.get_node_ids())
        waited = time.monotonic() - started
        if len(nodes) >= needed or waited >= timeout:
            return nodes
        if simulation and nodes:
            time.sleep(SETTLE_S)
            return sorted(grid.get_node_ids())
        if waited - logged >= LOG_EVERY_S:
            logged = waited
            short = ", ".join(f"'{k}' = {v}" for k, v in need.items() if v > len(nodes))
            log(
                INFO,
                "Waiting for nodes: %d connected, %d needed (%s); up to 'round-timeout' = %g s",
                len(nodes),
                needed,
                short,
                timeout,
            )
        time.sleep(0.5)


def check_federation(grid: Grid, cfg: RunConfig, task: Task, strategy) -> list[int]:
    """Run the start-up checks (module docstring); return the connected nodes in
    partition order.

    Raises
    ------
    StopTraining
        A check failed; the message names the key, the value and the fix.
    """
    partitions = partition_map(strategy)  # the run's node -> partition map
    need = needs(cfg, strategy)
    nodes = wait_for_federation(grid, need, cfg.round_timeout)
    short = {k: v for k, v in need.items() if v > len(nodes)}
    if short:
        where = (
            "the simulation has"
            if _is_simulation(grid)
            else f"connected within 'round-timeout' = {cfg.round_timeout:g} s:"
        )
        keys = ", ".join(f"'{k}' = {v}" for k, v in short.items())
        raise StopTraining(
            f"{keys} needs at least {max(short.values())} nodes, but {where} {len(nodes)}. "
            "Start more SuperNodes (simulation: --federation-config "
            '"num-supernodes=<n> client-resources-num-cpus=1") or lower the key'
        )
    _check_clusters(cfg, strategy, len(nodes))
    started = time.monotonic()
    log(
        INFO,
        "Learning the partition ids of %d nodes (%s)",
        len(nodes),
        "from the simulation's node order, confirmed by a few nodes; their answers wait "
        "for Ray to start the ClientApps, which import PyTorch and the app: seconds"
        if _is_simulation(grid)
        else "one query message each",
    )
    partitions.discover(grid, nodes, timeout=cfg.round_timeout)  # duplicates raise here
    log(INFO, "Partition ids known after %.1f s", time.monotonic() - started)
    errors = Counter(partitions.query_error(n) for n in nodes if partitions.query_error(n))
    if errors and sum(errors.values()) == len(nodes):
        grouped = "; ".join(f"{c} of {len(nodes)} nodes: {r}" for r, c in errors.most_common())
        raise StopTraining(f"no node could report its partition: {grouped}")
    sizes = Counter(n for node in nodes if (n := partitions.num_partitions_of(node)) is not None)
    if len(sizes) > 1:
        listed = ", ".join(f"{count} nodes say {size}" for size, count in sorted(sizes.items()))
        raise StopTraining(
            f"the SuperNodes' node configs disagree on num-partitions ({listed}); give every "
            "SuperNode the same 'num-partitions=<n>'"
        )
    canaries = cfg.part(AuditSettings).canaries
    if sizes:
        (size,) = sizes
        _check_size(size, canaries, cfg.task, task)
    described = _describe(sizes)
    if canaries:  # say which nodes are not real clients: a federation not sized N + k
        described += f" ({canaries} of them the audit's canaries, the last partition ids)"
    log(INFO, "Federation: %d nodes, %s", len(nodes), described)
    return partitions.order(nodes)


def _check_clusters(cfg: RunConfig, strategy, connected: int) -> None:
    """``cluster.k`` against the clients one round trains (module docstring)."""
    base = innermost(strategy)
    if not isinstance(base, ClusteredFedAvg):
        return
    cohort = getattr(strategy, "num_sampled_clients", None) or getattr(
        strategy, "expected_clients", None
    )
    if cohort:
        per_round, source = int(cohort), f"'dp.num-sampled-clients' = {int(cohort)}"
    else:
        per_round = fedavg_sample_size(connected, base.fraction_train, base.min_train_nodes)
        source = (
            f"'fraction-train' = {base.fraction_train:g} of {connected} nodes, at least "
            f"'min-train-nodes' = {base.min_train_nodes}"
        )
    if base.k > per_round:
        raise StopTraining(
            f"'cluster.k' = {base.k} is more than the {per_round} clients a round trains "
            f"({source}): every round would leave at least {base.k - per_round} of the "
            f"{base.k} models untrained. Set 'cluster.k' to at most {per_round}, or train "
            "more clients per round"
        )


def _check_size(size: int, canaries: int, name: str, task: Task) -> None:
    """num-partitions against the audit's canaries and a task that fixes its clients."""
    if canaries and size <= canaries:
        raise StopTraining(
            f"'audit.canaries' = {canaries} needs num-partitions = N + {canaries} with N "
            f">= 1 real clients, but the federation has num-partitions = {size} "
            "(simulation: --federation-config "
            f'"num-supernodes={size + canaries} client-resources-num-cpus=1")'
        )
    defined = task.num_partitions()
    clients = size - canaries  # the last partition ids are the audit's canaries
    try:
        task.check_partitioning(clients)  # e.g. more clients than examples to split
    except ValueError as err:
        raise StopTraining(str(err)) from None
    if defined is None or clients == defined:
        return
    try:
        task.load_partition(0, clients)  # the task's own message names the fix
    except ValueError as err:
        raise StopTraining(str(err)) from None
    raise StopTraining(
        f"task '{name}' defines {defined} clients but the federation has "
        f"num-partitions={size}" + (f" ({canaries} of them 'audit.canaries')" if canaries else "")
    )


def _describe(sizes: Counter) -> str:
    return f"num-partitions = {next(iter(sizes))}" if sizes else "num-partitions not reported"
