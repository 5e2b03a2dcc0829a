"""``bench/pull_cost.py``: it pulls from Flower's own simulation grid, the one
`strategies.runtime.messaging` must recognise to poll it at the simulation's cap."""

from __future__ import annotations

from flwr.app import Message, RecordDict

from bench import pull_cost
from strategies.runtime import messaging


def test_the_bench_builds_flowers_simulation_grid_which_messaging_recognises():
    grid, nodes = pull_cost.simulation_grid(5)
    assert len(set(nodes)) == 5
    assert set(grid.get_node_ids()) == set(nodes)
    # Flower's class, not a double named like it: if Flower renames or moves it, the
    # simulation's polls would silently fall back to the deployed 0.5 s cap
    assert type(grid).__module__.startswith("flwr.")
    assert messaging.is_simulation_grid(grid)


def test_pending_messages_stay_pending_across_pulls_and_each_node_takes_one():
    # pull_seconds stops with SystemExit if a push is refused, a pull returns a reply,
    # or the engine's sweep finds a node without its message or one taken twice
    pull, sweep = pull_cost.pull_seconds(50, pulls=5)
    assert pull > 0 and sweep > 0


def test_send_and_receive_on_flowers_grid_returns_by_its_timeout_when_nobody_replies():
    grid, nodes = pull_cost.simulation_grid(3)
    messages = [Message(RecordDict(), dst_node_id=node, message_type="train") for node in nodes]
    assert messaging.send_and_receive(grid, messages, timeout=0.2) == []
