"""End-to-end harness: `flwr run . local-simulation` exactly as the README says.

The session shares one private Flower home (4 virtual SuperNodes); its local
SuperLink is stopped by PID at the end, whatever happened.
"""

from __future__ import annotations

import pytest

from lab.launcher import LocalSimulation


@pytest.fixture(scope="session")
def flower():
    with LocalSimulation(num_supernodes=4) as sim:
        yield sim
