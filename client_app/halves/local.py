"""Local training (``strategy = local``), client half: each client keeps its own model.

The server's ``local-only`` flag makes the client train and evaluate the model it
kept in ``context.state`` instead of the one received (there is no global model).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context

from client_app.halves import ClientHalf, Round
from protocol import keys


class LocalHalf(ClientHalf):
    """Loads the client's own model, once it has one; keeps the trained one."""

    def weights(self, arrays: ArrayRecord, config: ConfigRecord, context: Context):
        return context.state.get(keys.LOCAL_MODEL, arrays)

    def trained(self, r: Round, metrics: dict[str, float]) -> dict[str, float]:
        r.context.state[keys.LOCAL_MODEL] = ArrayRecord(r.model.state_dict())
        return {}
