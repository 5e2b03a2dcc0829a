"""The ClientApp's mods, in chain order: the preset, SecAgg+, the privacy mechanism.

Each mechanism's client mod lives in its own module beside its server wrapper
(``strategies/mechanisms/``: ``dp_fedavg_mod``, ``laplace_mod``, ``front_loaded_mod``);
the registry names the mods of each ``privacy`` value
(:func:`strategies.registry.client_mods`), as Flower's ``fixedclipping_mod`` and
``LocalDpMod`` are separate mods. A mod's module is imported only by a run that uses it.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message
from flwr.client.mod.utils import make_ffn
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
)

from config.app import PRIVACY
from protocol import presets


def preset_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Resolve ``ctxt.run_config``'s preset (idempotent), then call the next mod.

    Flower hands every ClientApp the run-config fused over the app's defaults, with the
    ``preset`` key unresolved; resolved here, first of the chain, exactly as the
    ServerApp does, the task, its data and the client mods read the preset's keys (a
    preset that sets ``vision.model`` or ``vision.partitioner`` builds the same model and
    partitions on both sides)."""
    if ctxt.run_config.get(presets.PRESET_KEY):
        ctxt.run_config = presets.resolve(ctxt.run_config)
    return call_next(msg, ctxt)


def mechanism(ctxt: Context) -> str:
    """The run's ``privacy`` value, from this client's own run-config (preset resolved)."""
    return str(PRIVACY.read(ctxt.run_config))


def secure_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """SecAgg+'s mod (:mod:`client_app.secagg_mod`) for a message that carries a stage
    of a secure round, or while the context holds a round's secrets (any other message
    makes that mod drop them); every other message passes by."""
    if (
        isinstance(msg.content.get(RECORD_KEY_CONFIGS), ConfigRecord)
        or RECORD_KEY_STATE in ctxt.state
    ):
        from client_app.secagg_mod import secagg_mod

        return secagg_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


def privacy_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Run the mods of the run's ``privacy`` mechanism (after ``preset_mod``) around the
    rest of the chain; without a mechanism, the rest of the chain alone."""
    privacy = mechanism(ctxt)
    if privacy == "none":
        return call_next(msg, ctxt)
    # On use: the registry imports every server wrapper, which a client needs only
    # under a privacy mechanism (start-up of the ClientApp, tests/test_layers.py).
    from strategies.registry import client_mods

    return make_ffn(call_next, list(client_mods(privacy)))(msg, ctxt)
