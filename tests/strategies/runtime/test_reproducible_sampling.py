"""Sampling and summation follow partition ids, not Flower's node ids."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from protocol import keys
from strategies.errors import DuplicatePartitionError, StopTraining
from strategies.runtime.partitions import QUERY_TYPE, PartitionMap, sample_uniform, wait_for_nodes
from strategies.runtime.seeded import SeededSampling
from tests.fakes import FakeGrid, record, reply_from


class PartitionGrid(FakeGrid):
    """Answers ``query.partition`` with the partition of each node (None: error)."""

    def __init__(self, partition_of: dict[int, int | None]):
        super().__init__(partition_of)
        self.partition_of = partition_of
        self.queries = 0

    def send_and_receive(self, messages, timeout=None):
        out = []
        for message in messages:
            assert message.metadata.message_type == QUERY_TYPE
            self.queries += 1
            node, pid = (
                message.metadata.dst_node_id,
                self.partition_of[message.metadata.dst_node_id],
            )
            metrics = {} if pid is None else {keys.PARTITION_ID: pid}
            sent = Message(content=RecordDict(), dst_node_id=node, message_type="query")
            out.append(Message(RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=sent))
        return out


def _grid(node_ids, seed):
    """Partitions 0..n-1 behind node ids drawn at random, as Flower does per run."""
    return PartitionGrid(dict(zip(node_ids, range(len(node_ids)), strict=True)))


def _seeded(fraction_train, fraction_evaluate, *, min_available_nodes, seed):
    return SeededSampling(
        FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1),
        fraction_train=fraction_train,
        fraction_evaluate=fraction_evaluate,
        min_train_nodes=2,
        min_evaluate_nodes=2,
        min_available_nodes=min_available_nodes,
        seed=seed,
        timeout=1.0,
    )


def test_same_seed_same_partitions_whatever_the_node_ids():
    picks = []
    for ids_seed in (1, 2):
        partitions = PartitionMap()  # a new run: its own map
        ids = np.random.default_rng(ids_seed).choice(10**9, size=20, replace=False).tolist()
        grid = _grid(ids, ids_seed)
        nodes = wait_for_nodes(grid, 20, partitions, timeout=1.0)
        sample = sample_uniform(nodes, 5, np.random.default_rng(7), partitions)
        picks.append([partitions.partition_of(n) for n in sample])
    assert picks[0] == picks[1]
    assert picks[0] == sorted(picks[0])  # returned in partition order


def test_nodes_are_asked_once_and_silent_nodes_go_last():
    grid = PartitionGrid({30: 2, 10: None, 20: 0, 40: 1})
    partitions = PartitionMap()
    assert wait_for_nodes(grid, 4, partitions, timeout=1.0) == [20, 40, 30, 10]
    wait_for_nodes(grid, 4, partitions, timeout=1.0)
    assert grid.queries == 4


def test_replies_are_summed_in_partition_order():
    partitions = PartitionMap()
    partitions.record(7, 1)
    partitions.record(3, 0)
    replies = [reply_from(7, {"w": [1.0]}, {}), reply_from(3, {"w": [2.0]}, {})]
    assert [m.metadata.src_node_id for m in partitions.sort_replies(replies)] == [3, 7]


def test_seeded_fedavg_samples_the_same_partitions_and_aggregates_identically():
    results = []
    for ids in ([101, 205, 309, 412, 515, 618], [9, 8, 7, 6, 5, 4]):
        grid = _grid(ids, 0)
        strategy = _seeded(0.5, 0.0, min_available_nodes=6, seed=3)  # a new run, a new map
        partitions = strategy.partitions
        messages = list(strategy.configure_train(1, record({"w": [0.0]}), ConfigRecord(), grid))
        sampled = sorted(partitions.partition_of(m.metadata.dst_node_id) for m in messages)
        # Float sums depend on order: (1e16 + 1) - 1e16 = 0 but (1e16 - 1e16) + 1 = 1.
        value = {p: v for p, v in zip(sampled, [1e16, 1.0, -1e16], strict=True)}
        replies = [
            reply_from(
                m.metadata.dst_node_id,
                {"w": [value[partitions.partition_of(m.metadata.dst_node_id)]]},
                {"num-examples": 1},
            )
            for m in messages
        ]
        by_partition = sorted(
            replies, key=lambda m: partitions.partition_of(m.metadata.src_node_id)
        )
        first, middle, last = by_partition
        # Partition order sums to 0; the second run's arrival order alone would give 1.
        arrival = by_partition if not results else [first, last, middle]
        arrays, _ = strategy.aggregate_train(1, arrival)
        results.append((sampled, arrays["w"].numpy().tobytes()))
        assert strategy.configure_evaluate(1, record({"w": [0.0]}), ConfigRecord(), grid) == []
    assert len(results[0][0]) == 3
    assert results[0] == results[1]


@pytest.mark.parametrize("fraction", [0.1, 0.5, 1.0])
def test_sample_size_follows_flower(fraction):
    grid = _grid(list(range(1, 11)), 0)
    strategy = _seeded(fraction, fraction, min_available_nodes=2, seed=0)
    messages = list(strategy.configure_train(1, record({"w": [0.0]}), ConfigRecord(), grid))
    assert len(messages) == max(int(10 * fraction), 2)


def test_two_nodes_with_one_partition_stop_the_run_naming_them():
    # One partition is one unit of privacy: served twice, it would be sampled (and
    # counted) twice, which no sampling probability or per-client ledger allows for.
    grid = PartitionGrid({30: 2, 10: 1, 20: 2, 40: 0})
    with pytest.raises(DuplicatePartitionError, match="nodes 20, 30 all report partition-id 2"):
        wait_for_nodes(grid, 4, PartitionMap(), timeout=1.0)
    assert issubclass(DuplicatePartitionError, StopTraining)  # the run ends cleanly
    # A node that is gone (a SuperNode that reconnected under a new id) does not count.
    partitions = PartitionMap()
    partitions.record(30, 2)
    partitions.check_unique([20, 10, 40])
    partitions.record(20, 2)
    with pytest.raises(DuplicatePartitionError):
        partitions.check_unique([20, 30])


def test_client_names_are_partitions():
    partitions = PartitionMap()
    partitions.record(77, 5)
    assert partitions.client_name(77) == "partition-5"
    assert partitions.client_name(78) == "node-78"


def test_every_run_has_its_own_map_shared_by_its_wrappers():
    from strategies.base import TrainingWrapper
    from strategies.runtime.partitions import partition_map

    class Wrapper(TrainingWrapper):
        def configure_train(self, *args):
            return self.strategy.configure_train(*args)

        def aggregate_train(self, *args):
            return self.strategy.aggregate_train(*args)

        def summary(self):
            self.strategy.summary()

    first = _seeded(0.5, 0.0, min_available_nodes=2, seed=0)
    second = _seeded(0.5, 0.0, min_available_nodes=2, seed=0)
    first.partitions.record(5, 0)
    assert second.partitions.partition_of(5) is None  # nothing shared between runs
    wrapped = Wrapper(Wrapper(first))
    assert wrapped.partitions is first.partitions is partition_map(wrapped)
    assert partition_map(FedAvg()).partition_of(5) is None  # a bare strategy: empty map


class _NodeInfo:
    def __init__(self, node_id):
        self.node_id = node_id


class _LinkState:
    def __init__(self, registered):
        self.registered = registered

    def get_node_info(self):
        return [_NodeInfo(n) for n in self.registered]


class InMemoryGrid(PartitionGrid):
    """Flower's simulation grid as the ServerApp sees it: a LinkState that lists the
    nodes in the order they were registered (named like Flower's, which is how
    strategies.runtime.partitions recognises a simulation)."""

    def __init__(self, partition_of, registered, num_partitions):
        super().__init__(partition_of)
        self.state = _LinkState(registered)
        self.num_partitions = num_partitions

    def send_and_receive(self, messages, timeout=None):
        replies = super().send_and_receive(messages, timeout)
        for reply in replies:
            reply.content[keys.METRICS][keys.NUM_PARTITIONS] = self.num_partitions
        return replies


def test_a_simulation_is_read_from_its_registration_order_and_spot_checked():
    # Prepare: 100 nodes with random ids, registered as partitions 0..99 (Flower's order)
    ids = np.random.default_rng(3).choice(10**9, size=100, replace=False).tolist()
    grid = InMemoryGrid(dict(zip(ids, range(100), strict=True)), ids, 100)
    partitions = PartitionMap()

    # Execute
    nodes = wait_for_nodes(grid, 100, partitions, timeout=1.0)

    # Assert: 8 nodes asked, not 100, and every node's partition is its registration index
    assert grid.queries == 8
    assert [partitions.partition_of(n) for n in nodes] == list(range(100))
    assert {partitions.num_partitions_of(n) for n in ids} == {100}
    wait_for_nodes(grid, 100, partitions, timeout=1.0)
    assert grid.queries == 8  # once per run


@pytest.mark.parametrize("wrong", ["shuffled", "num-partitions"])
def test_a_simulation_numbered_otherwise_is_asked_node_by_node(wrong):
    ids = np.random.default_rng(4).choice(10**9, size=40, replace=False).tolist()
    partition_of = dict(zip(ids, range(40), strict=True))
    registered = ids[::-1] if wrong == "shuffled" else ids
    grid = InMemoryGrid(partition_of, registered, 40 if wrong == "shuffled" else 41)
    partitions = PartitionMap()

    nodes = wait_for_nodes(grid, 40, partitions, timeout=1.0)

    assert grid.queries == 8 + 40  # the spot check failed: every node was asked
    assert [partitions.partition_of(n) for n in nodes] == list(range(40))
