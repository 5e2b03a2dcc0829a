"""The app's own top-level keys that the ServerApp, the ClientApp and the tasks read.

Each is declared once here and read typed with ``Option.read``.
``task``, ``strategy`` and ``privacy`` take their valid values from the registries,
which the ServerApp adds (``server_app.config.TOP_LEVEL``); the other top-level keys
are the ServerApp's alone and declared there.
"""

from __future__ import annotations

from config.options import Option

TASK = Option("task", "digits", "Learning task.")
STRATEGY = Option("strategy", "fedavg", "Federated strategy.")
PRIVACY = Option("privacy", "none", "Privacy mechanism.")
NUM_SERVER_ROUNDS = Option("num-server-rounds", 10, "Number of federated rounds.", low=1)
SEED = Option("seed", 42, "Run seed: partitioning, model init, sampling, local shuffling.", low=0)
