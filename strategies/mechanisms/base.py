"""What every privacy wrapper shares: what it releases, what clients may report, and
what it does on resume.

Under a privacy mechanism the run directory separates what the ε covers from what it
does not (``curator/``, :mod:`server_app.results`): a wrapper names the metric keys it
releases (``RELEASED_METRICS``, computed from released quantities only: ε, clip norms
moved by noised counts, gates on noised sketches); every other key of its train metrics
(aggregated client reports, raw diagnostics such as clipping fractions) is curator-only.

Clients send only what the mechanism and the wrapped strategy need (``report-metrics``
in the train config, applied by each mechanism's client mod) unless the run sets
``dp.client-metrics = true``. Federated evaluation (each client's accuracy on its own
test split) is a release no mechanism covers: under DP it runs only when the user asks
for per-client metrics, and its results then go to ``curator/``.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.mechanisms import is_released, noise_generator
from privacy.settings import (  # noqa: F401 (declared without Flower: the ClientApp reads them)
    ADAPTIVE_INITIAL_CLIP,
    DATA_DEPENDENT_SELECTION,
    DEFAULT_CLIP,
    NOISE_PARAMETER,
    DPSettings,
)
from protocol import keys
from protocol.records import arrays_of
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
