"""The client half every privacy mechanism shares: a Flower mod around the training.

:func:`client_mod` makes a mechanism's mod from its own step, ``privatise`` (clip and
noise the update Δ = trained − received, as the server's train config says). The mod
also keeps only the metric keys the server may see (``report-metrics``, train and query
replies; ``num-examples``, when not among them, is sent as 1).

Noise comes from a generator seeded from the OS's entropy for every message: it never
leaves the client, and nobody can recompute it from the run seed (only under
``dp.reproducible-noise`` does it derive from the seed, the round and the partition).

Failures: with server-side noise a failed precondition (non-finite update, missing
arrays) becomes an error reply, which the server counts as a zero update. When the
client noises its own upload, whether its training failed can depend on its data, so
it sends the noised zero update instead and logs the failure only locally.
"""

from __future__ import annotations

from collections.abc import Callable
from logging import WARNING
from typing import cast

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp.typing import ClientAppCallable, Mod
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from privacy.mechanisms import NonFiniteUpdateError, client_noise_generator
from protocol import keys
from protocol.records import InvalidReply, arrays_of, as_int, to_record

# (config, delta, metrics, generator) -> the released delta; it may set metrics.
Privatise = Callable[[ConfigRecord, list[np.ndarray], MetricRecord, np.random.Generator], list]
# (config, reference arrays, generator) -> the noised delta a failed client sends.
NoisedZero = Callable[[ConfigRecord, list[np.ndarray], np.random.Generator], list]


def client_mod(
    privatise: Privatise | None = None,
    *,
    applies: Callable[[ConfigRecord], bool] = lambda _config: False,
    client_noised: Callable[[ConfigRecord], bool] = lambda _config: False,
    noised_zero: NoisedZero | None = None,
    name: str = "privacy_mod",
) -> Mod:
    """A mechanism's client mod.

    Parameters
    ----------
    privatise : Privatise, optional
        The mechanism's step on a train reply's update; None: the task releases the
        update itself (DP-SGD, front-loaded CP-NP) and the mod only filters metrics.
    applies : callable
        Whether a train config asks for ``privatise`` (its keys are present).
    client_noised : callable
        Whether the client noises its own upload (the server sees it on its own): a
        failed training then sends the noised zero update.
    noised_zero : NoisedZero, optional
        The noised zero delta when ``privatise`` does not make it (CP-NP).
    """

    def mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        config = cast(ConfigRecord | None, msg.content.get(keys.CONFIG))
        kind = msg.metadata.message_type
        if config is None:
            return call_next(msg, ctxt)
        clipped = privatise is not None and applies(config)
        if kind == MessageType.TRAIN and (clipped or client_noised(config)):
            return _filtered(msg, _train(msg, ctxt, call_next, clipped, client_noised(config)))
        if kind == MessageType.TRAIN or kind.startswith(MessageType.QUERY):
            return _filtered(msg, call_next(msg, ctxt))
        return call_next(msg, ctxt)

    def _train(msg, ctxt, call_next, clipped: bool, local: bool) -> Message:
        try:
            reply = call_next(msg, ctxt)
        except Exception as err:  # the ClientApp's own failure, before any upload exists
            if not local:
                raise
            return _noised_zero(msg, ctxt, f"training failed ({err!r})")
        if reply.has_error():
            if not local:
                return reply
            return _noised_zero(msg, ctxt, f"training failed ({reply.error.reason})")
        if not clipped:  # the task already clipped and noised the delta
            try:
                arrays_of(reply.content.get(keys.ARRAYS), msg.content[keys.ARRAYS])
            except InvalidReply as err:
                return _noised_zero(msg, ctxt, f"update rejected before release ({err})")
            return reply
        try:
            return _process(msg, reply, ctxt)
        except (InvalidReply, NonFiniteUpdateError) as err:
            if local:
                return _noised_zero(msg, ctxt, f"update rejected before release ({err})")
            return _error(msg, f"{name}: update rejected before release: {err}")

    def _process(msg: Message, reply: Message, ctxt: Context) -> Message:
        """The reply with the privatised update (received + processed Δ)."""
        assert privatise is not None
        received = cast(ArrayRecord, msg.content[keys.ARRAYS])
        reference = arrays_of(received)
        trained = arrays_of(reply.content.get(keys.ARRAYS), received)
        delta = [t - r for t, r in zip(trained, reference, strict=True)]
        metrics = MetricRecord(dict(cast(MetricRecord, reply.content[keys.METRICS])))
        delta = privatise(
            cast(ConfigRecord, msg.content[keys.CONFIG]), delta, metrics, _generator(msg, ctxt)
        )
        new = to_record(received, [r + d for r, d in zip(reference, delta, strict=True)])
        return Message(RecordDict({keys.ARRAYS: new, keys.METRICS: metrics}), reply_to=msg)

    def _noised_zero(msg: Message, ctxt: Context, why: str) -> Message:
        """The upload of a zero update, noised as the config says."""
        log(WARNING, "%s: %s; sending the noised zero update instead", name, why)
        config = cast(ConfigRecord, msg.content[keys.CONFIG])
        received = cast(ArrayRecord, msg.content[keys.ARRAYS])
        reference = arrays_of(received)
        rng = _generator(msg, ctxt)
        metrics = MetricRecord({keys.NUM_EXAMPLES: 0})
        if noised_zero is not None:  # the reply is the noisy delta itself
            arrays = to_record(received, noised_zero(config, reference, rng))
            return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)
        assert privatise is not None
        zero = [np.zeros_like(a, dtype=np.float64) for a in reference]
        delta = privatise(config, zero, metrics, rng)
        arrays = to_record(received, [r + d for r, d in zip(reference, delta, strict=True)])
        return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)

    mod.__name__ = mod.__qualname__ = name
    return mod


def _error(msg: Message, reason: str) -> Message:
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


def _generator(msg: Message, ctxt: Context) -> np.random.Generator:
    """The client's noise generator for this message: secret unless reproducible."""
    server_round = as_int(msg.content[keys.CONFIG].get(keys.SERVER_ROUND, 0))
    return client_noise_generator(ctxt.run_config, ctxt.node_config, server_round)


def _filtered(msg: Message, reply: Message) -> Message:
    """The reply with only the metric keys the config's ``report-metrics`` allows."""
    config = cast(ConfigRecord | None, msg.content.get(keys.CONFIG))
    allowed = None if config is None else cast(list[str] | None, config.get(keys.REPORT_METRICS))
    if allowed is None or reply.has_error():
        return reply
    metrics = cast(MetricRecord | None, reply.content.get(keys.METRICS))
    kept = {k: v for k, v in (metrics or {}).items() if k in allowed}
    if keys.NUM_EXAMPLES not in allowed:
        kept[keys.NUM_EXAMPLES] = 1
    content = RecordDict({keys.METRICS: MetricRecord(kept)})
    arrays = reply.content.get(keys.ARRAYS)
    if isinstance(arrays, ArrayRecord):
        content[keys.ARRAYS] = arrays
    return Message(content, reply_to=msg)


# What the client sends under a mechanism whose update the task releases (DP-SGD):
# only the metrics the server may see.
report_metrics_mod = client_mod(name="report_metrics_mod")
