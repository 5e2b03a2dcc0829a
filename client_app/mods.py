"""Client mods: the client half of the privacy wrappers, usable with every task.

``privacy_mod`` post-processes a train reply when the server's config asks for it:

* DP-FedAvg (``dpfedavg_clip_norm`` present): clip the update Δ = trained − received
  to L2 norm C, add N(0, ``dpfedavg_noise_stddev``²) when client-side noising is on,
  report the indicator bit ‖Δ‖ ≤ C when adaptive clipping is on;
* Laplace (``laplace-sensitivity`` present): clip Δ to L1 norm S, add Laplace noise of
  scale ``laplace-scale`` to every coordinate;
* SmartFedProx under DP (``divergence-clip`` present): clip the reported divergence to
  [0, ``divergence-clip``] and add N(0, ``divergence-noise-stddev``²)
  (:class:`privacy.mechanisms.BoundedScalarRelease`); a client whose training failed
  reports 0 plus that noise;
* every privacy mechanism (``report-metrics`` present, train and query replies): keep
  only the metric keys the server needs; ``num-examples``, when not among them, is sent
  as 1.

Noise comes from a generator seeded from the OS's entropy for every message: it never
leaves the client, and nobody can recompute it from the run seed (only under
``dp.reproducible-noise`` does it derive from the seed, the round and the partition).

Failures. With server-side noise (trusted server) a failed precondition (non-finite
update, missing arrays) becomes an error reply, never an exception and never an update
the server could average; the server counts it as a zero update. When the client adds
the noise itself (``dpfedavg_noise_stddev``, Laplace, CP-NP), the server is not trusted
with anything but noised uploads, and whether a client's training failed can depend on
its data (a diverging loss): the client then sends the noised zero update instead, a
reply like any other, and logs the failure only locally.
"""

from __future__ import annotations

from logging import WARNING

import numpy as np
from flwr.app import (
    ArrayRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from privacy.mechanisms import (
    BoundedScalarRelease,
    GaussianMechanism,
    LaplaceMechanism,
    NonFiniteUpdateError,
    gaussian_noise_like,
    noise_generator,
)
from protocol import keys
from protocol.records import InvalidReply, arrays_of, to_record

_NOISE_STREAM = 0xD9  # separates client noise from other streams of the same seed


def _error(msg: Message, reason: str) -> Message:
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)


def _generator(msg: Message, ctxt: Context) -> np.random.Generator:
    """The client's noise generator for this message: secret unless reproducible."""
    config = msg.content[keys.CONFIG]
    return noise_generator(
        seed=int(ctxt.run_config.get("seed", 0)),
        streams=(
            int(config.get(keys.SERVER_ROUND, 0)),
            int(ctxt.node_config.get("partition-id", 0)),
            _NOISE_STREAM,
        ),
        reproducible=bool(ctxt.run_config.get("dp.reproducible-noise", False)),
    )


def _client_noised(config) -> bool:
    """Whether this client noises its own upload (the server sees it on its own)."""
    return (
        keys.DP_NOISE_STDDEV in config
        or keys.LAPLACE_SENSITIVITY in config
        or config.get(keys.FRONT_LOADED_MODE) == "cp-np"
    )


def _privatise(
    msg: Message, delta: list[np.ndarray], metrics: MetricRecord, rng: np.random.Generator
) -> list[np.ndarray]:
    """Clip (and noise) ``delta`` as the config says; set the adaptive bit."""
    config = msg.content[keys.CONFIG]
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
    if keys.DIVERGENCE_CLIP in config:
        _release_divergence(config, metrics, rng)
    return delta


def _release_divergence(config, metrics: MetricRecord, rng: np.random.Generator) -> None:
    """Replace the raw divergence by its clipped, noised release (0 when none was
    computed: a failed client's zero update)."""
    bound = float(config[keys.DIVERGENCE_CLIP])
    std = float(config[keys.DIVERGENCE_NOISE_STDDEV])
    raw = metrics.get(keys.DIVERGENCE, 0.0)
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise InvalidReply(f"'{keys.DIVERGENCE}' = {raw!r} is not a number")
    release = BoundedScalarRelease(bound=bound, noise_multiplier=std / bound)
    metrics[keys.DIVERGENCE] = release.release(float(raw), rng=rng)


def _process(msg: Message, reply: Message, ctxt: Context) -> Message:
    """The reply with the privatised update (received + processed Δ)."""
    received = msg.content[keys.ARRAYS]
    reference = arrays_of(received)
    trained = arrays_of(reply.content.get(keys.ARRAYS), received)
    delta = [t - r for t, r in zip(trained, reference, strict=True)]
    metrics = MetricRecord(dict(reply.content[keys.METRICS]))
    delta = _privatise(msg, delta, metrics, _generator(msg, ctxt))
    new = to_record(received, [r + d for r, d in zip(reference, delta, strict=True)])
    return Message(RecordDict({keys.ARRAYS: new, keys.METRICS: metrics}), reply_to=msg)


def _noised_zero(msg: Message, ctxt: Context, why: str) -> Message:
    """The upload of a zero update, noised as the config says: what a client that
    noises its own upload sends when its training failed (see the module docstring)."""
    log(WARNING, "privacy_mod: %s; sending the noised zero update instead", why)
    config = msg.content[keys.CONFIG]
    received = msg.content[keys.ARRAYS]
    reference = arrays_of(received)
    rng = _generator(msg, ctxt)
    metrics = MetricRecord({keys.NUM_EXAMPLES: 0})
    if config.get(keys.FRONT_LOADED_MODE) == "cp-np":  # the reply is the noisy delta itself
        sigma = float(config[keys.FRONT_LOADED_SIGMA])
        delta = [
            rng.normal(0.0, sigma, size=a.shape)
            if np.issubdtype(a.dtype, np.floating)
            else np.zeros(a.shape)
            for a in reference
        ]
        arrays = to_record(received, delta)
        return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)
    zero = [np.zeros_like(a, dtype=np.float64) for a in reference]
    delta = _privatise(msg, zero, metrics, rng)
    arrays = to_record(received, [r + d for r, d in zip(reference, delta, strict=True)])
    return Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=msg)


def _filtered(msg: Message, reply: Message) -> Message:
    """The reply with only the metric keys the config's ``report-metrics`` allows."""
    config = msg.content.get(keys.CONFIG)
    allowed = None if config is None else config.get(keys.REPORT_METRICS)
    if allowed is None or reply.has_error():
        return reply
    metrics = reply.content.get(keys.METRICS)
    kept = {k: v for k, v in (metrics or {}).items() if k in allowed}
    if keys.NUM_EXAMPLES not in allowed:
        kept[keys.NUM_EXAMPLES] = 1
    content = RecordDict({keys.METRICS: MetricRecord(kept)})
    arrays = reply.content.get(keys.ARRAYS)
    if isinstance(arrays, ArrayRecord):
        content[keys.ARRAYS] = arrays
    return Message(content, reply_to=msg)


def _train(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    config = msg.content[keys.CONFIG]
    clipped = keys.DP_CLIP_NORM in config or keys.LAPLACE_SENSITIVITY in config
    local = _client_noised(config)
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
    if not clipped:  # CP-NP: the task already clipped and noised the delta
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
        return _error(msg, f"privacy_mod: update rejected before release: {err}")


def privacy_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Clip and noise the train reply, and keep only the metrics the server may see, as
    the server's config says (see the module docstring)."""
    config = msg.content.get(keys.CONFIG)
    kind = msg.metadata.message_type
    if config is None:
        return call_next(msg, ctxt)
    mechanism = keys.DP_CLIP_NORM in config or keys.LAPLACE_SENSITIVITY in config
    if kind == MessageType.TRAIN and (mechanism or _client_noised(config)):
        return _filtered(msg, _train(msg, ctxt, call_next))
    if kind == MessageType.TRAIN or kind.startswith(MessageType.QUERY):
        return _filtered(msg, call_next(msg, ctxt))
    return call_next(msg, ctxt)
