"""What every privacy mechanism shares, both halves: the server wrapper's base (what it
releases, what clients may report, what it does on resume) and the client mod.

Under a privacy mechanism the run directory separates what the ε covers from what it
does not (``curator/``, :mod:`server_app.results`): a wrapper names the metric keys it
releases (``RELEASED_METRICS``, computed from released quantities only: ε, clip norms
moved by noised counts, gates on noised sketches); every other key of its train metrics
(aggregated client reports, raw diagnostics such as clipping fractions) is curator-only.

Clients send only what the mechanism and the wrapped strategy need (``report-metrics``
in the train config, applied by :func:`client_mod`) unless the run sets
``dp.client-metrics = true``. Federated evaluation (each client's accuracy on its own
test split) is a release no mechanism covers: under DP it runs only when the user asks
for per-client metrics, and its results then go to ``curator/``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from logging import INFO, WARNING
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
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.mechanisms import (
    NonFiniteUpdateError,
    client_noise_generator,
    is_released,
    noise_generator,
)
from privacy.settings import (  # noqa: F401 (declared without Flower: the ClientApp reads them)
    ADAPTIVE_INITIAL_CLIP,
    DATA_DEPENDENT_SELECTION,
    DEFAULT_CLIP,
    NOISE_PARAMETER,
    DPSettings,
)
from protocol import keys
from protocol.records import InvalidReply, arrays_of, as_int, new_record, to_record
from strategies.base import TrainingWrapper
from strategies.errors import StopTraining
from strategies.runtime.partitions import wait_for_nodes


class PrivacyWrapper(TrainingWrapper):
    """A privacy mechanism around ``self.strategy`` (see the module docstring).

    Parameters
    ----------
    strategy : Strategy
        The wrapped strategy.
    client_metrics : bool
        ``dp.client-metrics``: clients report all their metrics and take part in
        federated evaluation (everything goes to ``curator/``).
    noise_from_seed : bool
        ``dp.reproducible-noise``: the DP randomness derives from the run seed; the
        wrapper marks its rows (``dp-noise-from-seed`` = 1).
    """

    # Metric keys (exact, or prefixes ending in "-") of train metrics that are released.
    RELEASED_METRICS: tuple[str, ...] = (keys.DP_EPSILON, keys.DP_NOISE_FROM_SEED)
    # Keys a client reports under this mechanism besides those the strategy needs.
    CLIENT_REPORTS: tuple[str, ...] = ()

    def __init__(
        self, strategy: Strategy, *, client_metrics: bool = False, noise_from_seed: bool = False
    ) -> None:
        super().__init__(strategy)
        self.client_metrics = client_metrics
        self.noise_from_seed = noise_from_seed
        self._said_no_evaluation = False

    # -- what is released ------------------------------------------------------------
    def releases_metric(self, key: str) -> bool:
        """Whether the train metric ``key`` is computed from released quantities only."""
        return any(
            key == name or (name.endswith("-") and key.startswith(name))
            for name in self.RELEASED_METRICS
        )

    def mark(self, metrics: dict) -> dict:
        """``metrics`` with ``dp-noise-from-seed`` (1 under dp.reproducible-noise)."""
        metrics[keys.DP_NOISE_FROM_SEED] = 1.0 if self.noise_from_seed else 0.0
        return metrics

    # -- what clients send -------------------------------------------------------------
    def reported_metrics(self) -> list[str]:
        """The metric keys a client keeps in its train reply: this mechanism's, and
        those the wrapped strategy declares it needs (``REPORTED_METRICS``)."""
        needed = getattr(self.strategy, "REPORTED_METRICS", ())
        return sorted({*self.CLIENT_REPORTS, *needed})

    def report_config(self) -> dict:
        """The train-config entry restricting what clients report (none when
        ``dp.client-metrics`` is on)."""
        if self.client_metrics:
            return {}
        return {keys.REPORT_METRICS: self.reported_metrics()}

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's federated evaluation, only with ``dp.client-metrics``."""
        if self.client_metrics:
            return self.strategy.configure_evaluate(server_round, arrays, config, grid)
        if not self._said_no_evaluation:
            self._said_no_evaluation = True
            log(
                INFO,
                "Federated evaluation is off under DP: each client's metrics on its own "
                "test split are a release no epsilon covers. Set dp.client-metrics = true to "
                "collect them (written under curator/); central evaluation is unaffected.",
            )
        return []

    # -- the round's population ----------------------------------------------------------
    connect_timeout: float  # seconds to wait for the round's nodes (the wrapper's)

    def calibrate(self, population: int) -> None:
        """Set the noise for ``population`` clients (a wrapper with a target ε)."""

    def _refuse_over_budget(self, server_round: int, population: int) -> None:
        """StopTraining if the round would exceed the budget (a wrapper with a ledger)."""

    def nodes_for_round(
        self, server_round: int, grid: Grid, expected_clients: int, min_available_nodes: int
    ) -> list[int]:
        """The connected nodes once there are enough for ``expected_clients``; the noise
        is calibrated to their number and the round checked against the budget before
        anything is sent.

        Raises
        ------
        StopTraining
            Too few nodes within ``connect_timeout``, or the round would exceed the budget.
        """
        needed = max(expected_clients, min_available_nodes)
        nodes = wait_for_nodes(grid, needed, self.partitions, timeout=self.connect_timeout)
        if len(nodes) < expected_clients:
            raise StopTraining(
                f"'dp.num-sampled-clients' = {expected_clients} but only {len(nodes)} "
                f"nodes connected within {self.connect_timeout:g} s"
            )
        self.calibrate(len(nodes))
        self._refuse_over_budget(server_round, len(nodes))
        return nodes

    # -- resume --------------------------------------------------------------------------
    def on_resume(self) -> None:
        """Charge what the round under way when the server stopped may have released.

        The server releases a round only after its checkpoint commits it, so nothing the
        trusted server releases is lost; what clients sent in that round (client-side
        noise, seen by the server) is charged here by the wrappers that have a local
        view. Called once when a run resumes, before its first round."""


class ReleasedArrays:
    """Which arrays of the model a DP wrapper releases: every floating array (integer
    arrays, e.g. BatchNorm's step counter, keep the server's value); the mask and their
    total size d are fixed at the first round. Head-only training composes
    :class:`strategies.mechanisms.head_only.HeadOnlyArrays` instead."""

    def __init__(self) -> None:
        self.mask: list[bool] | None = None
        self.dim = 0  # d of the released arrays, known from round 1

    def released(self, arrays: ArrayRecord) -> list[bool]:
        """Whether each array of the global model is released."""
        return [is_released(a) for a in arrays_of(arrays)]

    def fix(self, arrays: ArrayRecord) -> bool:
        """Fix the mask and d from the global model; True the first time only."""
        if self.mask is not None:
            return False
        self.mask = self.released(arrays)
        kept = zip(arrays_of(arrays), self.mask, strict=True)
        self.dim = sum(a.size for a, keep in kept if keep)
        return True

    def select(self, delta: list[np.ndarray]) -> list[np.ndarray]:
        """The released arrays of ``delta``."""
        assert self.mask is not None
        return [d for d, keep in zip(delta, self.mask, strict=True) if keep]

    def merge(self, mean: list[np.ndarray], reference: list[np.ndarray]) -> list[np.ndarray]:
        """The released mean back among zero deltas of the frozen arrays: whatever a
        client sent for those is ignored."""
        assert self.mask is not None
        released = iter(mean)
        return [
            next(released) if keep else np.zeros_like(c)
            for c, keep in zip(reference, self.mask, strict=True)
        ]


_SERVER_STREAM = 0x5E  # the server's generator: DP sampling and server-side noise


def dp_generator(s) -> np.random.Generator:
    """The generator of the randomness a guarantee rests on (noise, DP sampling) for the
    run settings ``s``: secret, from OS entropy, unless ``dp.reproducible-noise`` derives
    it from the run seed."""
    return noise_generator(
        seed=s.seed,
        streams=(_SERVER_STREAM,),
        reproducible=s.part(DPSettings).reproducible_noise,
    )


# -- the client half: a Flower mod around the training ------------------------------
# client_mod makes a mechanism's mod from its own step, ``privatise`` (clip and noise the
# update Δ = trained − received, as the server's train config says). The mod also keeps
# only the metric keys the server may see (``report-metrics``, train and query replies;
# ``num-examples``, when not among them, is sent as 1).
#
# Noise comes from a generator seeded from the OS's entropy for every message: it never
# leaves the client, and nobody can recompute it from the run seed (only under
# ``dp.reproducible-noise`` does it derive from the seed, the round and the partition).
#
# Failures: with server-side noise a failed precondition (non-finite update, missing
# arrays) becomes an error reply, which the server counts as a zero update. When the
# client noises its own upload, whether its training failed can depend on its data, so
# it sends the noised zero update instead and logs the failure only locally.
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
        metrics = new_record(MetricRecord, cast(MetricRecord, reply.content[keys.METRICS]))
        delta = privatise(
            cast(ConfigRecord, msg.content[keys.CONFIG]), delta, metrics, _generator(msg, ctxt)
        )
        new = to_record(received, [r + d for r, d in zip(reference, delta, strict=True)])
        content = new_record(RecordDict, {keys.ARRAYS: new, keys.METRICS: metrics})
        return Message(content, reply_to=msg)

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
    content: dict[str, MetricRecord | ArrayRecord] = {keys.METRICS: new_record(MetricRecord, kept)}
    arrays = reply.content.get(keys.ARRAYS)
    if isinstance(arrays, ArrayRecord):
        content[keys.ARRAYS] = arrays
    return Message(new_record(RecordDict, content), reply_to=msg)


# What the client sends under a mechanism whose update the task releases (DP-SGD):
# only the metrics the server may see.
report_metrics_mod = client_mod(name="report_metrics_mod")
