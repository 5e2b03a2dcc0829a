"""The ClientApp's half of the ``preset`` run-config key (:mod:`protocol.presets`).

Flower hands every ClientApp the run-config fused over the app's defaults, with the
``preset`` key unresolved; this mod, first of the chain, resolves it in the context
exactly as the ServerApp does, so that the task, its data and the client mods read the
preset's keys (a preset that sets ``model.name`` or ``data.partitioner`` builds the
same model and partitions on both sides).
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from protocol import presets


def preset_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Resolve ``ctxt.run_config``'s preset (idempotent), then call the next mod."""
    if ctxt.run_config.get(presets.PRESET_KEY):
        ctxt.run_config = presets.resolve(ctxt.run_config)
    return call_next(msg, ctxt)
