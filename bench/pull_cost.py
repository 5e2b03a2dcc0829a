"""What a pull for replies costs in Flower's simulation, against the clients still pending.

In a simulation the ServerApp's grid (``InMemoryGrid``) reads the engine's in-memory
LinkState in its own process. Each pull runs ``get_message_res`` over every pending
message ID, under the lock the engine's workers need to fetch messages and store
replies, so its cost grows with the clients a round still waits for.
`strategies.runtime.messaging.send_and_receive` polls at most ``SIMULATION_MAX_POLL`` (0.05 s)
apart, and waits at least ``1 / MAX_PULL_SHARE - 1`` times (9) an empty pull's CPU
time, so that pulls use at most ``MAX_PULL_SHARE`` (10 %) of a core. Alone in this
process, a pull's wall time (timed here) is its CPU time. This bench builds the LinkState and
grid as Flower's simulation does (``flwr.simulation.run_simulation._main_loop`` and
``vce_api._register_nodes``, Flower 1.41), pushes one message to each of N nodes, and
times pulls of all N while none has replied: the middle of a long round.

For each N it prints the median pull, and the share of a waiting ServerApp's time that
pulls take at a fixed interval (Flower's own 0.1 s, our cap of 0.05 s) and with
``send_and_receive``'s floor. For scale, it also times what Flower's engine does under
the same lock every 0.1 s: a sweep asking the LinkState for each node's next message,
each scanning the stored messages (once every node has taken its own):

    python bench/pull_cost.py --nodes 100 300 1000 3000 --pulls 15
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from strategies.runtime.messaging import MAX_PULL_SHARE, SIMULATION_MAX_POLL

# the interval of Flower's own InMemoryGrid.send_and_receive (0.1 s in Flower 1.41)
FLOWER_INTERVAL = inspect.signature(InMemoryGrid).parameters["pull_interval"].default


def simulation_grid(num_nodes: int) -> tuple[InMemoryGrid, list[int]]:
    """An ``InMemoryGrid`` on an in-memory LinkState with ``num_nodes`` nodes, set up
    as Flower's simulation sets it up, and the nodes' IDs. Like Flower's simulation,
    it sets this process's ``TaskIdentity`` to the ServerApp's in the new run, which
    the messages it then builds are from."""
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


def pull_seconds(num_nodes: int, pulls: int) -> tuple[float, float]:
    """The median seconds of a pull of ``num_nodes`` pending messages' replies, and of
    one sweep of Flower's engine once each node has taken its message (``vce_api``'s
    ``worker``, which asks the LinkState for each node's next message every 0.1 s
    under the same lock), the two as they stand in the middle of a long round."""
    grid, nodes = simulation_grid(num_nodes)
    messages = [Message(RecordDict(), dst_node_id=node, message_type="train") for node in nodes]
    pending = set(grid.push_messages(messages))
    if len(pending) != num_nodes:
        raise SystemExit(f"{len(pending)} of {num_nodes} messages stored")
    times = []
    for _ in range(pulls):
        started = time.perf_counter()
        replies = list(grid.pull_messages(pending))
        times.append(time.perf_counter() - started)
        if replies:
            raise SystemExit(f"{len(replies)} replies to messages no node has fetched")
    state = grid.state
    if sum(len(state.get_message_ins(node_id=node, limit=1)) for node in nodes) != num_nodes:
        raise SystemExit("a node found no message to take")
    sweeps = []
    for _ in range(max(1, pulls // 5)):  # a sweep costs about a pull per node
        started = time.perf_counter()
        taken = sum(len(state.get_message_ins(node_id=node, limit=1)) for node in nodes)
        sweeps.append(time.perf_counter() - started)
        if taken:
            raise SystemExit(f"{taken} messages taken twice")
    return statistics.median(times), statistics.median(sweeps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 300, 1000, 3000])
    parser.add_argument("--pulls", type=int, default=15, help="pulls timed per N")
    args = parser.parse_args()
    floor = 1 / MAX_PULL_SHARE - 1
    print(
        "| pending | pull, ms | per pending, µs | pulls' share at Flower's 0.1 s | "
        f"at a fixed {SIMULATION_MAX_POLL} s | ours (floor {floor:.0f} pulls) | "
        "Flower's engine: a sweep, ms |\n|---:|---:|---:|---:|---:|---:|---:|"
    )
    for n in args.nodes:
        pull, sweep = pull_seconds(n, args.pulls)
        ours = max(SIMULATION_MAX_POLL, floor * pull)
        print(
            f"| {n} | {pull * 1e3:.2f} | {pull / n * 1e6:.1f} | "
            f"{pull / (pull + FLOWER_INTERVAL):.1%} | "
            f"{pull / (pull + SIMULATION_MAX_POLL):.1%} | {pull / (pull + ours):.1%} | "
            f"{sweep * 1e3:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
