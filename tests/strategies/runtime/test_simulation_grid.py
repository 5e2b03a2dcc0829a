"""`strategies.runtime.messaging` against Flower's own simulation grid, built as Flower's
simulation builds it (``run_simulation._main_loop`` and ``vce_api._register_nodes``,
Flower 1.41): it must recognise the grid to poll it at the simulation's cap."""

from __future__ import annotations

from typing import cast

from flwr.app import Message, RecordDict
from flwr.common.constant import RUN_ID_NUM_BYTES, SUPERLINK_NODE_ID, TASK_ID_NUM_BYTES
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import InMemoryLinkState, LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.server.superlink.linkstate.utils import generate_rand_int_from_bytes
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

from strategies.runtime import messaging


def simulation_grid(num_nodes: int) -> tuple[InMemoryGrid, list[int]]:
    """An ``InMemoryGrid`` on an in-memory LinkState with ``num_nodes`` nodes, and the
    nodes' IDs; this process's ``TaskIdentity`` is the ServerApp's, as in a simulation."""
    factory = LinkStateFactory(
        FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory()
    )
    run = Run.create_empty(run_id=generate_rand_int_from_bytes(RUN_ID_NUM_BYTES))
    run.primary_task_id = generate_rand_int_from_bytes(TASK_ID_NUM_BYTES)
    run.federation_id = NOOP_FEDERATION_ID
    state = cast(InMemoryLinkState, factory.state())
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[run.primary_task_id] = Task(task_id=run.primary_task_id, run_id=run.run_id)
    nodes = list(_register_nodes(num_nodes, factory))
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    TaskIdentity.task_id, TaskIdentity.run_id = 1, run.run_id  # run_simulation's
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    return grid, nodes


def test_messaging_recognises_flowers_simulation_grid():
    grid, nodes = simulation_grid(5)
    assert len(set(nodes)) == 5
    assert set(grid.get_node_ids()) == set(nodes)
    # Flower's class, not a double named like it: if Flower renames or moves it, the
    # simulation's polls would silently fall back to the deployed 0.5 s cap
    assert type(grid).__module__.startswith("flwr.")
    assert messaging.is_simulation_grid(grid)


def test_pending_messages_stay_pending_across_pulls_and_each_node_takes_one():
    grid, nodes = simulation_grid(20)
    messages = [Message(RecordDict(), dst_node_id=node, message_type="train") for node in nodes]
    pending = set(grid.push_messages(messages))
    assert len(pending) == 20
    for _ in range(3):
        assert list(grid.pull_messages(pending)) == []
    state = grid.state
    assert sum(len(state.get_message_ins(node_id=node, limit=1)) for node in nodes) == 20
    assert sum(len(state.get_message_ins(node_id=node, limit=1)) for node in nodes) == 0


def test_send_and_receive_on_flowers_grid_returns_by_its_timeout_when_nobody_replies():
    grid, nodes = simulation_grid(3)
    messages = [Message(RecordDict(), dst_node_id=node, message_type="train") for node in nodes]
    assert messaging.send_and_receive(grid, messages, timeout=0.2) == []
