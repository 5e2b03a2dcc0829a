"""The ClientApp's privacy mod: the client half of the run's privacy mechanism.

Each mechanism's client mod lives in its own module beside its server wrapper
(``strategies/mechanisms/``: ``dp_fedavg_mod``, ``laplace_mod``, ``front_loaded_mod``);
the registry names the mods of each ``privacy`` value
(:func:`strategies.registry.client_mods`), as Flower's ``fixedclipping_mod`` and
``LocalDpMod`` are separate mods.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.client.mod.utils import make_ffn
from flwr.clientapp.typing import ClientAppCallable

from config.app import PRIVACY


def privacy_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Run the mods of the run's ``privacy`` mechanism (after ``preset_mod``) around the
    rest of the chain; without a mechanism, the rest of the chain alone."""
    privacy = str(PRIVACY.read(ctxt.run_config))
    if privacy == "none":
        return call_next(msg, ctxt)
    # On use: the registry imports every server wrapper, which a client needs only
    # under a privacy mechanism (start-up of the ClientApp, tests/test_layers.py).
    from strategies.registry import client_mods

    return make_ffn(call_next, list(client_mods(privacy)))(msg, ctxt)
