"""Shared test set-up."""

import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity

torch.set_num_threads(1)  # the CI machine has 2 cores; keep tests predictable


@pytest.fixture(autouse=True)
def task_identity():
    """Message construction in flwr 1.41 reads the task identity the runtime sets:
    pretend to be task 1 of run 1 on node 0."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield


@pytest.fixture(autouse=True)
def fresh_partition_map():
    """The node -> partition map lives for a ServerApp process; each test starts empty."""
    from strategies import partitions

    partitions.reset()
    yield
    partitions.reset()
