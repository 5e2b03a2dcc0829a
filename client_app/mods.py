"""Client mods: the client half of the privacy wrappers, usable with every task.

``privacy_mod`` post-processes a train reply when the server's config asks for it:

* DP-FedAvg (``dpfedavg_clip_norm`` present): clip the update Δ = trained − received
  to L2 norm C, add N(0, ``dpfedavg_noise_stddev``²) when client-side noising is on,
  report the indicator bit ‖Δ‖ ≤ C when adaptive clipping is on;
* Laplace (``laplace-sensitivity`` present): clip Δ to L1 norm S, add Laplace noise of
  scale ``laplace-scale`` to every coordinate.

The reply then carries received + processed Δ. A failed precondition (non-finite
update, missing arrays) becomes an error reply, never an exception and never an
update the server could average. Noise is drawn from a generator derived from the run
seed, the round and the partition id, or from the OS when ``dp.secure-rng`` is true.
"""

from __future__ import annotations

from flwr.app import Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode

from privacy.mechanisms import (
    GaussianMechanism,
    LaplaceMechanism,
    NonFiniteUpdateError,
    gaussian_noise_like,
    noise_generator,
)
from strategies import keys
from strategies.base import InvalidReply, arrays_of, to_record

_NOISE_STREAM = 0xD9  # separates client noise from other streams of the same seed


def _error(msg: Message, reason: str) -> Message:
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


def _generator(msg: Message, ctxt: Context):
    config = msg.content[keys.CONFIG]
    return noise_generator(
        seed=int(ctxt.run_config.get("seed", 0)),
        streams=(
            int(config.get(keys.SERVER_ROUND, 0)),
            int(ctxt.node_config.get("partition-id", 0)),
            _NOISE_STREAM,
        ),
        secure=bool(ctxt.run_config.get("dp.secure-rng", False)),
    )


def _process(msg: Message, reply: Message, ctxt: Context) -> Message:
    config = msg.content[keys.CONFIG]
    received = msg.content[keys.ARRAYS]
    reference = arrays_of(received)
    trained = arrays_of(reply.content.get(keys.ARRAYS), received)
    delta = [t - r for t, r in zip(trained, reference, strict=True)]
    metrics = MetricRecord(dict(reply.content[keys.METRICS]))
    rng = _generator(msg, ctxt)
    if keys.DP_CLIP_NORM in config:
        mechanism = GaussianMechanism(
            clip_norm=float(config[keys.DP_CLIP_NORM]), noise_multiplier=1.0
        )  # only its clip is used here
        clipped = mechanism.clip(delta)
        delta = clipped.arrays
        if keys.DP_NOISE_STDDEV in config:
            noise = gaussian_noise_like(delta, std=float(config[keys.DP_NOISE_STDDEV]), rng=rng)
            delta = [d + n for d, n in zip(delta, noise, strict=True)]
        if config.get(keys.DP_ADAPTIVE):
            metrics[keys.DP_NORM_BIT] = 0.0 if clipped.clipped else 1.0
    if keys.LAPLACE_SENSITIVITY in config:
        sensitivity = float(config[keys.LAPLACE_SENSITIVITY])
        scale = float(config[keys.LAPLACE_SCALE])
        mechanism = LaplaceMechanism(sensitivity=sensitivity, epsilon=sensitivity / scale)
        delta = mechanism.noise(mechanism.clip(delta).arrays, rng=rng)
    new = to_record(received, [r + d for r, d in zip(reference, delta, strict=True)])
    return Message(RecordDict({keys.ARRAYS: new, keys.METRICS: metrics}), reply_to=msg)


def privacy_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Clip and noise the train reply as the server's config says (see module doc)."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    config = msg.content.get(keys.CONFIG)
    if config is None or not (keys.DP_CLIP_NORM in config or keys.LAPLACE_SENSITIVITY in config):
        return call_next(msg, ctxt)
    reply = call_next(msg, ctxt)
    if reply.has_error():
        return reply
    try:
        return _process(msg, reply, ctxt)
    except (InvalidReply, NonFiniteUpdateError) as err:
        return _error(msg, f"privacy_mod: update rejected before release: {err}")
