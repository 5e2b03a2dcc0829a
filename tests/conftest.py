"""Shared test set-up."""

import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity

torch.set_num_threads(1)  # the CI machine has 2 cores; keep tests predictable


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(items):
    """Under ``pytest -n 2 --dist loadgroup`` (the README's command) the end-to-end
    tests that share the local SuperLink (``tests/e2e/conftest.py``) go to one worker,
    in order. The deployment tests start their own SuperLink on free ports and spend
    most of their time waiting (round timeouts, heartbeats), so they are a group of
    their own that the other worker takes between single-threaded unit tests."""
    for item in items:
        if item.get_closest_marker("e2e"):
            group = "e2e-deployment" if item.module.__name__.endswith("test_deployment") else "e2e"
            item.add_marker(pytest.mark.xdist_group(group))


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
