"""Shared test set-up."""

import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity

torch.set_num_threads(1)  # the CI machine has 2 cores; keep tests predictable


# Modules not named here are in group "e2e" (privacy runs, flwr run, movielens).
E2E_GROUPS = {
    "test_deployment": "e2e-deployment",
    "test_hierarchical": "e2e-b",
    "test_lunar_lander": "e2e-b",
    "test_finance": "e2e-b",
    "test_reproducibility": "e2e-b",
}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the node ids
def pytest_collection_modifyitems(items):
    """Under ``pytest -n 2 --dist loadgroup`` (the README's command) the end-to-end tests
    go to three groups, each run in order on one worker: a group's modules share that
    worker's local SuperLink (``tests/e2e/conftest.py``; each on its own port), and
    the deployment tests start their own SuperLink. Both cores are busy (95 % over a
    whole local run on 2026-11-27): what shortens the suite is less work, such as the
    variants made in process (``tests.inprocess.run_like_flwr``), not more workers."""
    for item in items:
        if item.get_closest_marker("e2e"):
            module = item.module.__name__.rsplit(".", 1)[-1]
            item.add_marker(pytest.mark.xdist_group(E2E_GROUPS.get(module, "e2e")))


@pytest.fixture(autouse=True)
def task_identity():
    """Message construction in flwr 1.41 reads the task identity the runtime sets:
    pretend to be task 1 of run 1 on node 0."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
