"""FedBN, client half: the layers a task keeps local (e.g. BatchNorm) stay on the client.

The task names them (:meth:`tasks.base.Task.local_state_keys`); the client overwrites
the received values with its own copies after loading and keeps the trained ones.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from flwr.app import ArrayRecord, RecordDict

from client_app.halves import ClientHalf, Round

LOCAL_LAYERS = "local-layers"  # context.state ArrayRecord: FedBN's client-only entries


def restore_local_layers(model: torch.nn.Module, names: tuple[str, ...], state: RecordDict):
    """Overwrite ``names`` in ``model`` with the client's own copies, once it has some."""
    saved = state.get(LOCAL_LAYERS)
    if names and saved is not None:
        model.load_state_dict(saved.to_torch_state_dict(), strict=False)


def keep_local_layers(model: torch.nn.Module, names: tuple[str, ...], state: RecordDict):
    """Store ``names`` of the trained ``model`` as the client's own copies."""
    if names:
        weights = model.state_dict()
        state[LOCAL_LAYERS] = ArrayRecord(OrderedDict((name, weights[name]) for name in names))


class FedBNHalf(ClientHalf):
    """Restores the client's own local layers and keeps the trained ones."""

    def loaded(self, r: Round) -> None:
        restore_local_layers(r.model, r.task.local_state_keys(), r.context.state)

    def trained(self, r: Round, metrics: dict[str, float]) -> dict[str, float]:
        keep_local_layers(r.model, r.task.local_state_keys(), r.context.state)
        return {}
