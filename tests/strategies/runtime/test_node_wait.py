"""The wait for ``min-available-nodes`` after a SuperNode is lost for good: only the
first wait runs out ``round-timeout``; later waits with no new node go on at once,
and a node that joins (a restarted SuperNode) makes the next wait count again.
Time is a fake clock: nothing sleeps."""

from __future__ import annotations

import logging

import pytest

from strategies.errors import StopTraining
from strategies.runtime import partitions as nodes_module
from strategies.runtime.partitions import PartitionMap, nodes_for_round, wait_for_nodes

TIMEOUT = 30.0


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Grid:
    def __init__(self, node_ids: list[int]) -> None:
        self.node_ids = list(node_ids)

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)


@pytest.fixture
def clock(monkeypatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(nodes_module, "time", fake)
    return fake


def _waited(clock: FakeTime, grid: Grid, partitions: PartitionMap, needed: int = 4) -> float:
    started = clock.now
    wait_for_nodes(grid, needed, partitions, timeout=TIMEOUT, discover=False)
    return clock.now - started


def test_a_permanent_loss_costs_one_wait_not_one_per_round(clock, caplog):
    caplog.set_level(logging.INFO)
    grid, partitions = Grid([1, 2, 3]), PartitionMap()  # node 4 is gone for good
    assert _waited(clock, grid, partitions) == TIMEOUT  # the first round waits for it
    assert [_waited(clock, grid, partitions) for _ in range(5)] == [0.0] * 5
    assert "no node joined since a wait of 'round-timeout' ended with these" in caplog.text


def test_a_second_loss_does_not_wait_again_either(clock):
    grid, partitions = Grid([1, 2, 3]), PartitionMap()
    _waited(clock, grid, partitions)
    grid.node_ids = [1, 2]  # fewer, none new
    assert _waited(clock, grid, partitions) == 0.0


def test_a_node_that_joins_makes_the_wait_count_again(clock):
    grid, partitions = Grid([1, 2, 3]), PartitionMap()
    _waited(clock, grid, partitions)
    grid.node_ids = [1, 2, 5]  # a new node (a restarted SuperNode), still one short
    assert _waited(clock, grid, partitions) == TIMEOUT
    grid.node_ids = [1, 2, 5, 6]  # enough: no wait, and the memory is cleared
    assert _waited(clock, grid, partitions) == 0.0
    grid.node_ids = [1, 2, 5]
    assert _waited(clock, grid, partitions) == TIMEOUT


def test_each_run_keeps_its_own_memory(clock):
    grid = Grid([1, 2, 3])
    _waited(clock, grid, PartitionMap())
    assert _waited(clock, grid, PartitionMap()) == TIMEOUT  # a new run waits


def test_the_round_still_warns_and_stops_below_its_sample(clock, caplog):
    caplog.set_level(logging.WARNING)
    grid, partitions = Grid([1, 2, 3]), PartitionMap()
    for _ in range(2):
        got = nodes_for_round(
            grid, partitions, min_available=4, min_sample=2, timeout=TIMEOUT, discover=False
        )
        assert sorted(got) == [1, 2, 3]
    assert clock.now == TIMEOUT
    assert caplog.text.count("fewer than 'min-available-nodes' = 4") == 2
    grid.node_ids = [1]
    with pytest.raises(StopTraining, match="the round needs at least 2"):
        nodes_for_round(
            grid, partitions, min_available=4, min_sample=2, timeout=TIMEOUT, discover=False
        )
    assert clock.now == TIMEOUT  # no node joined: that stop did not wait either


def test_a_wait_shorter_than_the_poll_interval_ends_at_its_timeout(clock):
    # A round-timeout of 0.3 s waits 0.3 s, not a whole 1 s poll interval.
    started = clock.now
    wait_for_nodes(Grid([1, 2, 3]), 4, PartitionMap(), timeout=0.3, discover=False)
    assert clock.now - started == pytest.approx(0.3)
