"""Message construction in flwr 1.41 reads the task identity the runtime sets."""

import pytest
from flwr.supercore.task_identity import TaskIdentity


@pytest.fixture(autouse=True)
def task_identity():
    """Pretend to be the ServerApp task of run 1 on node 0, as the runtime would."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
