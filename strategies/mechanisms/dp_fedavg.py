"""DP-FedAvg with a fixed clip norm around any strategy, and its client mod.

McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models". The
wrapper samples the round's clients with the secret DP generator (Poisson, or exactly m
without replacement), lets the wrapped strategy configure only those, releases the mean
of their clipped updates with Gaussian noise added by the server or by each client, and
charges every release to the run's ledger (and, with client-side noise, each upload to
the clients' local-view ledger) before it is published. ``dp_fedavg_mod`` is the client
half: it clips the update, adds the client's noise share when asked, and reports the
adaptive-clipping bit. The contract between the halves and the rationale are in
docs/privacy.md ("The mechanisms' server and client halves").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.accounting import PrivacyLedger, Release
from privacy.certificates import spi
from privacy.mechanisms import GaussianMechanism, gaussian_noise_like
from protocol import keys
from protocol.records import InvalidReply, arrays_of, as_float, to_record
from protocol.replies import check_reply
from strategies.algorithms.smart_fedprox.private import DivergenceRelease, release_divergence
from strategies.base import add_to_config
from strategies.errors import BudgetExhausted, StopTraining
from strategies.mechanisms.base import PrivacyWrapper, ReleasedArrays, client_mod
from strategies.mechanisms.calibrated import CalibratedNoise
from strategies.mechanisms.head_only import HeadOnlyArrays
from strategies.mechanisms.noise_site import (
    SecureNoiseSite,
    ServerNoise,
    report_noise_to_signal,
    sum_release,
)
from strategies.mechanisms.noise_site import noise_site as noise_site_of
from strategies.mechanisms.upload_view import UploadView
from strategies.runtime.aggregation import weighted_metrics
from strategies.runtime.checkpoint import ledger_state, load_ledger
from strategies.runtime.partitions import dp_cohort, grid_view

__all__ = ["DPFedAvgFixed", "DivergenceRelease", "dp_fedavg_mod", "privatise_update"]


def _check_noise(
    clip_norm: float, noise_multiplier: float | None, target_epsilon: float | None, m: int
) -> None:
    """ValueError unless C > 0, m >= 1 and exactly one of z > 0 and a target ε is given."""
    if clip_norm <= 0 or m < 1:
        raise ValueError("clip_norm must be > 0, m >= 1")
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError("give exactly one of noise_multiplier and target_epsilon")
    if noise_multiplier is not None and noise_multiplier <= 0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier!r}")


class DPFedAvgFixed(CalibratedNoise, PrivacyWrapper):
    """DP-FedAvg with a fixed clip norm around any strategy.

    Parameters (keyword-only after ``strategy``)
    ----------
    strategy : Strategy
        The wrapped strategy; it configures every node it is given (the wrapper samples).
    clip_norm, noise_multiplier : float
        C, each update's L2 clip; z, the sum's noise std is z·C (None: calibrated to
        ``target_epsilon`` over ``planned_rounds`` at the first round).
    num_sampled_clients : int
        m, expected (Poisson ledger) or exact per round; the mean's denominator.
    noise_site, released_keys, divergence
        The composed pieces: :mod:`~strategies.mechanisms.noise_site` ("server" or
        "client"), :mod:`~strategies.mechanisms.head_only` (None: every array) and
        SmartFedProx's :class:`DivergenceRelease` (None: no reports).
    ledger, rng, min_available_nodes, connect_timeout, uniform_sampling
        The run's ledger and secret DP generator; nodes to wait for, and how long;
        False when the wrapped strategy selects by data (no amplification claimed).
    **kwargs
        ``client_metrics`` and ``noise_from_seed`` (:class:`PrivacyWrapper`).
    """

    RELEASED_METRICS = (*PrivacyWrapper.RELEASED_METRICS, keys.DP_EPSILON_LOCAL, "dp-clip-norm")
    LOCAL_VIEW = True  # client-side noise gives each upload a guarantee against the server

    def __init__(
        self,
        strategy: Strategy,
        *,
        clip_norm: float,
        noise_multiplier: float | None,
        num_sampled_clients: int,
        noise_site: str,
        ledger: PrivacyLedger,
        rng: np.random.Generator,
        min_available_nodes: int = 1,
        uniform_sampling: bool = True,
        connect_timeout: float = 300.0,
        released_keys: tuple[str, ...] | None = None,
        target_epsilon: float | None = None,
        planned_rounds: int = 1,
        divergence: DivergenceRelease | None = None,
        aggregate_device: str | None = None,
        secure: SecureNoiseSite | None = None,
        **kwargs,
    ) -> None:
        _check_noise(clip_norm, noise_multiplier, target_epsilon, num_sampled_clients)
        site = noise_site_of(noise_site)
        if isinstance(site, ServerNoise):  # None: NumPy; else float32 torch there (noise_site.py)
            site.device = aggregate_device
        if site.name == "client" and ledger.sampling == "poisson":
            raise ValueError("client-side noise needs fixed-size sampling (see config.py)")
        if divergence is not None:
            divergence.check(uniform_sampling, ledger.sampling)
        super().__init__(strategy, **kwargs)
        self.site, self.noise_site, self.ledger, self.rng = site, noise_site, ledger, rng
        self.clip_norm, self.noise_multiplier = clip_norm, noise_multiplier
        self.target_epsilon, self.planned_rounds = target_epsilon, planned_rounds
        self.num_sampled_clients, self.min_available_nodes = (
            num_sampled_clients,
            min_available_nodes,
        )
        self.uniform_sampling, self.connect_timeout = uniform_sampling, connect_timeout
        self.head = ReleasedArrays() if released_keys is None else HeadOnlyArrays(released_keys)
        self.divergence = divergence
        # Client-side noise: the server sees each upload on its own (under secure
        # aggregation it never sees one); ``local_view``: that per-client ledger.
        view = noise_site == "client" and self.LOCAL_VIEW and secure is None
        self.uploads = UploadView(ledger) if view else None
        self.local_view = None if self.uploads is None else self.uploads.ledger
        self.secure = secure  # the secure sum's noise site (the registry's, with SecAgg+)
        self._round_state: tuple[ArrayRecord, list[int], int] | None = None

    # -- what one round releases ------------------------------------------------
    def update_noise_multiplier(self) -> float:
        """Noise multiplier of the model-update noise (z; adaptive clipping raises it)."""
        assert self.noise_multiplier is not None  # set or calibrated before round 1
        return self.noise_multiplier

    def release(self, server_round: int, population: int) -> list[Release]:
        """The releases one aggregation makes, as the ledger accounts them."""
        assert self.noise_multiplier is not None
        return self.releases_with(self.noise_multiplier, server_round, population)

    def releases_with(
        self, noise_multiplier: float, server_round: int, population: int, count: int = 1
    ) -> list[Release]:
        """The releases of ``count`` aggregations with noise multiplier z (calibration
        plans a whole run with them before z is known)."""
        if self.secure is not None:
            return [self.secure.release(self, noise_multiplier, server_round, population, count)]
        update = sum_release(
            noise_multiplier, self.ledger, self.num_sampled_clients, population,
            server_round, count, self.uniform_sampling,
        )  # fmt: skip
        if self.divergence is None:
            return [update]
        return [update, self.divergence.release(noise_multiplier, server_round, count)]

    def calibrate(self, population: int) -> None:
        """Set z to meet ``target_epsilon`` over the planned rounds with ``population``
        clients (once: the first round's N)."""
        if self.noise_multiplier is not None:
            return
        self.noise_multiplier = self.calibrated(population)
        m = {"expected-clients": self.num_sampled_clients}
        self.record_calibration("dp.noise-multiplier", self.noise_multiplier, population, **m)
        self.after_calibration()

    def planned_releases(self, noise_multiplier: float, population: int) -> list[Release]:
        """The releases of the whole planned run with multiplier z (calibration; under
        distributed DP, the most-participating client's planned sums)."""
        count = self.planned_rounds
        if self.secure is not None and self.secure.distributed:
            count = self.secure.planned_participations(self, population)
        return self.releases_with(noise_multiplier, 1, population, count=count)

    def after_calibration(self) -> None:
        """What depends on z once it is calibrated (adaptive clipping's count noise)."""

    # -- training half ----------------------------------------------------------
    def client_config(self) -> dict[str, float | bool | list[str]]:
        """Keys added to every sampled client's train config."""
        config: dict = {keys.DP_CLIP_NORM: self.clip_norm, **self.report_config()}
        if self.secure is not None:
            return {**config, **self.secure.client_config(self)}
        config.update(self.site.client_config(self._mechanism(), self.num_sampled_clients))
        if self.divergence is not None:
            assert self.noise_multiplier is not None
            config.update(self.divergence.client_config(self.clip_norm, self.noise_multiplier))
        return config

    def _mechanism(self) -> GaussianMechanism:
        return GaussianMechanism(
            clip_norm=self.clip_norm, noise_multiplier=self.update_noise_multiplier()
        )

    def _refuse_over_budget(self, server_round: int, population: int) -> None:
        """BudgetExhausted, before anything is sent, if the round would exceed the budget
        in the ledger or (client-side noise) for some client against the server. Under
        distributed DP the sample is restricted instead (``SecureNoise.eligible``)."""
        if self.secure is not None and self.secure.distributed:
            return
        if self.ledger.would_exceed(self.release(server_round, population)):
            raise BudgetExhausted(
                f"round {server_round} would exceed 'dp.max-epsilon' = "
                f"{self.ledger.max_epsilon} (epsilon so far {self.ledger.epsilon():.4f} at "
                f"delta {self.ledger.target_delta:g}); nothing was sent"
            )
        if self.uploads is not None:
            self.uploads.refuse_over_budget(self, server_round)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample m nodes, let the wrapped strategy configure them, add DP keys."""
        all_nodes = self.nodes_for_round(
            server_round, grid, self.num_sampled_clients, self.min_available_nodes
        )
        if self.secure is not None:
            all_nodes = self.secure.eligible(self, all_nodes)
        picked, expected = dp_cohort(
            all_nodes, self.num_sampled_clients, self.rng, self.partitions,
            poisson=self.ledger.sampling == "poisson", uniform=self.uniform_sampling,
        )  # fmt: skip
        if picked is not None:
            grid = grid_view(grid, picked)
        messages = (
            list(self.strategy.configure_train(server_round, arrays, config, grid))
            if expected
            else []  # an empty Poisson cohort: the round releases the noise alone
        )
        if len(messages) != expected:
            configured = f"the wrapped strategy configured {len(messages)} clients"
            raise StopTraining(f"{configured}, DP-FedAvg sampled {expected}")
        self._fix_released(arrays)
        messages = add_to_config(messages, self.client_config())
        sent = self.partitions.order(m.metadata.dst_node_id for m in messages)
        if self.uploads is not None:  # the server will see each of them on its own
            clients = [self.partitions.client_name(n) for n in sent]
            self.uploads.charge(self, clients, server_round)
        self._round_state = (arrays, sent, len(all_nodes))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Release the private mean of the sampled clients' clipped updates (a failed
        client counts as a zero update) and charge it."""
        if self._round_state is None:
            return None, None
        current, sent, population = self._round_state
        self._round_state = None
        replies = list(replies)
        reference = arrays_of(current)
        deltas, records, failed = self._contributions(
            replies, sent, lambda _node: (current, reference)
        )
        if self.divergence is not None:  # the noised reports drive the next selection
            self.divergence.observe(self.strategy, server_round, replies, failed)
        mean = self._private_mean(list(deltas.values()), len(failed), self.head.select(reference))
        moved = self.head.merge(mean, reference)  # zero on the frozen arrays
        new_arrays = to_record(current, [c + d for c, d in zip(reference, moved, strict=True)])
        self.ledger.charge(self.release(server_round, population))
        return new_arrays, self.released_metrics(records, failed)

    def released_metrics(
        self, records: list[MetricRecord], failed: list[int], centred_bits=None, **extra: float
    ) -> MetricRecord:
        """The round's train metrics: the valid replies' (weighted 1), the mechanism's,
        ``extra``, the failed clients and the ε so far (after the round is charged)."""
        aggregated = dict(weighted_metrics(records))
        aggregated.update(self.round_metrics(records, centred_bits))
        aggregated.update(extra)
        aggregated[keys.DP_FAILED_CLIENTS] = float(len(failed))
        aggregated[keys.DP_EPSILON] = self.ledger.epsilon()
        if self.uploads is not None:
            aggregated.update(self.uploads.metrics())
        return MetricRecord(self.mark(aggregated))

    def _contributions(self, replies, sent, reference_of):
        """The released deltas, metrics and failed nodes (:func:`contributions`); each
        reply's verdict is noted for the participation record, which then need not
        check the reply again."""
        notes: dict[int, str] = {}
        out = contributions(replies, sent, reference_of, self._check, self.head.select, notes)
        for node, what in notes.items():
            self.partitions.note(node, what)
        return out

    def _check(self, message: Message, current: ArrayRecord):
        """The reply's arrays and metrics, or InvalidReply (see :func:`check_reply`)."""
        return check_reply(message, current)

    # -- which arrays are released (every floating one, or head-only: head_only.py) --
    def _fix_released(self, arrays: ArrayRecord) -> None:
        """At the first round: which arrays are released and their total size d."""
        if self.head.fix(arrays):
            report_noise_to_signal(
                self.update_noise_multiplier(), self.head.dim, self.num_sampled_clients
            )

    def _private_mean(
        self, deltas: list[list[np.ndarray]], missing: int, template: list[np.ndarray]
    ) -> list[np.ndarray]:
        """The private mean over m of the released arrays of the clients' deltas
        (``template``: the released arrays of the global model, for shapes and dtypes):
        the noise site's noisy sum, in float64, over m in the arrays' dtypes."""
        m = self.num_sampled_clients
        total = self.site.noisy_sum(deltas, missing, self._mechanism(), m, self.rng, template)
        return [(t / m).astype(a.dtype, copy=False) for t, a in zip(total, template, strict=True)]

    def spi_values(self) -> dict[int, float] | None:
        """SPI(k) of the isotropic noise on the released arrays (``kσ²``; see
        :mod:`privacy.certificates`); None before round 1."""
        z = self.update_noise_multiplier()
        return spi([], floor=1.0, dim=self.head.dim, noise_multiplier=z) if self.head.dim else None

    def round_metrics(
        self, records: list[MetricRecord], centred_bits: float | None = None
    ) -> dict[str, float]:
        """Extra per-round metrics from the valid replies' (adaptive clipping releases its
        count here; ``centred_bits``: the securely summed bits less half the survivors)."""
        return {"dp-clip-norm": self.clip_norm}

    def on_resume(self) -> None:
        """Charge every client one noisy upload (the interrupted round's sample is lost)."""
        if self.uploads is not None:
            self.uploads.on_resume(self)

    # -- checkpoint (strategies.runtime.checkpoint) --------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The secret generator (it lives only in the owner-only checkpoint), C, z, the
        calibration record and the ledgers."""
        return {
            "rng": self.rng.bit_generator.state,
            "clip-norm": self.clip_norm,
            "noise-multiplier": self.noise_multiplier,
            "calibration": self.calibration,
            "ledger": ledger_state(self.ledger),
            "local-view": ledger_state(self.local_view),
        }

    def summary(self) -> None:
        """Log the DP settings, then the wrapped strategy's summary."""
        log_summary(self)
        self.strategy.summary()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the generator and the ledgers in place)."""
        self.rng.bit_generator.state = state["rng"]
        self.clip_norm, self.noise_multiplier = state["clip-norm"], state["noise-multiplier"]
        self.calibration = state["calibration"]
        load_ledger(self.ledger, state["ledger"])
        load_ledger(self.local_view, state["local-view"])
        self.restore_plan()  # a resumed run reports its exact ε at the last round


# -- what the server reads from the replies and logs of itself ----------------------
Check = Callable[[Message, ArrayRecord], tuple[list[np.ndarray], MetricRecord]]


def contributions(
    replies: Iterable[Message],
    sent: list[int],
    reference_of: Callable[[int], tuple[ArrayRecord, list[np.ndarray]]],
    check: Check,
    select: Callable[[list[np.ndarray]], list[np.ndarray]],
    notes: dict[int, str] | None = None,
) -> tuple[dict[int, list[np.ndarray]], list[MetricRecord], list[int]]:
    """(node -> released delta of its valid reply, their metrics weighted 1, the sampled
    nodes counted as a zero update), in the order of ``sent``. ``reference_of`` gives the
    model a node was sent, as a record and as arrays; ``check`` validates a reply;
    ``select`` keeps the released arrays of a delta. With ``notes``, each node whose
    reply is not an error gets ``""`` (valid) or ``"rejected: <reason>"``."""
    by_node: dict[int, Message] = {}
    for reply in replies:
        by_node.setdefault(reply.metadata.src_node_id, reply)
    deltas, records, failed = {}, [], []
    for node in sent:
        current, reference = reference_of(node)
        message = by_node.get(node)
        try:
            if message is None:
                raise InvalidReply("no reply")
            received, metrics = check(message, current)
        except InvalidReply as err:
            failed.append(node)
            log(WARNING, "DP-FedAvg: node %d counts as a zero update: %s", node, err)
            if notes is not None and message is not None and not message.has_error():
                notes[node] = f"rejected: {err}"
            continue
        if notes is not None:
            notes[node] = ""
        deltas[node] = select([r - c for r, c in zip(received, reference, strict=True)])
        metrics[keys.NUM_EXAMPLES] = 1.0
        records.append(metrics)
    return deltas, records, failed


def log_summary(dp) -> None:
    """Log the settings of ``dp`` (a :class:`~strategies.mechanisms.dp_fedavg.DPFedAvgFixed`)."""
    log(INFO, "\t├──> DP-FedAvg (%s):", type(dp).__name__)
    log(
        INFO,
        "\t│\t├── clip norm C = %g, noise multiplier z = %s",
        dp.clip_norm,
        f"{dp.noise_multiplier:g}"
        if dp.noise_multiplier is not None
        else f"calibrated in round 1 to epsilon {dp.target_epsilon:g}",
    )
    log(
        INFO,
        "\t│\t├── m = %d clients per round (%s), noise added by the %s",
        dp.num_sampled_clients,
        "expected, Poisson" if dp.ledger.sampling == "poisson" else "exactly",
        dp.site.name,
    )
    log(
        INFO,
        "\t│\t└── accounting: %s, sampling %s, delta %g, max epsilon %s",
        dp.ledger.accountant,
        dp.ledger.sampling,
        dp.ledger.target_delta,
        dp.ledger.max_epsilon or "none",
    )
    if dp.divergence is not None:
        dp.divergence.summary()
    if dp.uploads is not None:
        dp.uploads.summary(dp)


# -- the client half ----------------------------------------------------------------
def privatise_update(
    config: ConfigRecord, delta: list[np.ndarray], metrics: MetricRecord, rng: np.random.Generator
) -> list[np.ndarray]:
    """Clip Δ to L2 norm C, add the client's noise share when it noises its own upload,
    set the adaptive-clipping bit, and release SmartFedProx's divergence when asked."""
    mechanism = GaussianMechanism(
        clip_norm=as_float(config[keys.DP_CLIP_NORM]), noise_multiplier=1.0
    )  # only its clip is used here
    clipped = mechanism.clip(delta)
    delta = clipped.arrays
    if keys.DP_NOISE_STDDEV in config:
        noise = gaussian_noise_like(delta, std=as_float(config[keys.DP_NOISE_STDDEV]), rng=rng)
        delta = [d + n for d, n in zip(delta, noise, strict=True)]
    if config.get(keys.DP_ADAPTIVE):
        metrics[keys.DP_NORM_BIT] = 0.0 if clipped.clipped else 1.0
    if keys.DIVERGENCE_CLIP in config:
        release_divergence(config, metrics, rng)
    return delta


# DP-FedAvg's client mod (fixed and adaptive clipping, under SecAgg+ too).
dp_fedavg_mod = client_mod(
    privatise_update,
    applies=lambda config: keys.DP_CLIP_NORM in config,
    client_noised=lambda config: keys.DP_NOISE_STDDEV in config,
    name="dp_fedavg_mod",
)
