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

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.accounting import PrivacyLedger, Release, l2_sensitivity_factor
from privacy.certificates import spi
from privacy.local_view import LocalViewLedger
from privacy.mechanisms import (
    BoundedScalarRelease,
    GaussianMechanism,
    NonFiniteUpdateError,
    clip_by_l2_norm,
    gaussian_noise_like,
    is_released,
)
from protocol import keys
from protocol.records import InvalidReply, arrays_of, to_record
from protocol.replies import check_reply
from strategies.base import add_to_config
from strategies.errors import BudgetExhausted, StopTraining
from strategies.mechanisms.base import PrivacyWrapper
from strategies.mechanisms.calibrated import CalibratedNoise
from strategies.mechanisms.client import client_mod
from strategies.runtime.aggregation import weighted_metrics
from strategies.runtime.checkpoint import ledger_state, load_ledger
from strategies.runtime.nodes import GridView
from strategies.runtime.sampling import poisson_sample, sample_uniform

# z·√d/m above which the noise on the mean update drowns any client's signal.
NOISE_TO_SIGNAL_WARNING = 20.0


class SecureNoiseSite(Protocol):
    """Where the noise is added when the round runs as a secure sum
    (:class:`strategies.secure.distributed_dp.SecureNoise`, set by SecureAggregation)."""

    distributed: bool

    def release(
        self, dp, noise_multiplier: float, server_round: int, population: int, count: int
    ) -> Release: ...
    def client_config(self, dp) -> dict: ...
    def eligible(self, dp, nodes: list[int]) -> list[int]: ...
    def planned_participations(self, dp, population: int) -> int: ...


@dataclass(frozen=True)
class DivergenceRelease:
    """How sampled clients release SmartFedProx's divergence under DP-FedAvg.

    Attributes
    ----------
    bound : float
        D, the public clip of the report; 0: the round's clip norm C (the divergence
        ``||w_local - w_global||`` is the norm of the update C clips).
    noise_multiplier : float or None
        z_d: the report's noise std is z_d·D; None: the run's z (calibrated with it).
    """

    bound: float = 0.0
    noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if not self.bound >= 0:
            raise ValueError(f"bound must be >= 0 (0: the clip norm), got {self.bound!r}")
        if self.noise_multiplier is not None and not self.noise_multiplier > 0:
            raise ValueError(
                f"noise_multiplier must be > 0 or None, got {self.noise_multiplier!r}"
            )


class DPFedAvgFixed(CalibratedNoise, PrivacyWrapper):
    """DP-FedAvg with a fixed clip norm around any strategy.

    Parameters
    ----------
    strategy : Strategy
        The wrapped strategy; it must sample every node of the grid it is given
        (``fraction_train = 1``), since the wrapper does the sampling.
    clip_norm : float
        L2 clip norm C of each client's update.
    noise_multiplier : float or None
        z: the noise on the sum of clipped updates has std z·C. None: calibrated to
        ``target_epsilon`` over ``planned_rounds`` at the first round.
    num_sampled_clients : int
        m: the expected (Poisson) or exact (fixed) number of clients per round, and the
        denominator of the mean. The ledger's sampling says which.
    noise_site : {"server", "client"}
        Who adds the noise.
    ledger : PrivacyLedger
        The run's ledger; every release is charged to it.
    rng : numpy.random.Generator
        The secret DP generator for sampling and server-side noise
        (:func:`privacy.mechanisms.noise_generator`).
    min_available_nodes : int
        Nodes to wait for before sampling (at least m).
    uniform_sampling : bool
        False when the wrapped strategy selects clients by their data (e.g.
        SmartFedProx): then no amplification by subsampling is claimed.
    connect_timeout : float
        Seconds to wait for enough nodes before ending the run.
    divergence : DivergenceRelease, optional
        The wrapped strategy selects clients by their model divergence (SmartFedProx):
        clients release it clipped and noised, and each round charges it. Needs a ledger
        without sampling (``uniform_sampling = False``).
    released_keys : tuple of str, optional
        Head-only training: only these arrays are clipped, noised and updated; the
        others keep the global values whatever a client sends. None: every array.
    target_epsilon : float, optional
        The ε at the ledger's δ the whole run meets when z is calibrated.
    planned_rounds : int
        T, the rounds the run plans (calibration).
    **kwargs
        ``client_metrics`` and ``noise_from_seed`` (:class:`PrivacyWrapper`).
    """

    RELEASED_METRICS = (
        *PrivacyWrapper.RELEASED_METRICS,
        keys.DP_EPSILON_LOCAL,
        "dp-clip-norm",
    )
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
        **kwargs,
    ) -> None:
        if clip_norm <= 0 or num_sampled_clients < 1:
            raise ValueError("clip_norm must be > 0, m >= 1")
        if (noise_multiplier is None) == (target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier and target_epsilon")
        if noise_multiplier is not None and noise_multiplier <= 0:
            raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier!r}")
        if noise_site not in ("server", "client"):
            raise ValueError(f"noise_site must be 'server' or 'client', not {noise_site!r}")
        if noise_site == "client" and ledger.sampling == "poisson":
            raise ValueError("client-side noise needs fixed-size sampling (see config.py)")
        if divergence is not None and (uniform_sampling or ledger.sampling != "none"):
            raise ValueError(
                "divergence reports drive a data-dependent selection: they need "
                "uniform_sampling = False and a ledger without sampling"
            )
        super().__init__(strategy, **kwargs)
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.target_epsilon, self.planned_rounds = target_epsilon, planned_rounds
        self.num_sampled_clients = num_sampled_clients
        self.noise_site = noise_site
        self.ledger = ledger
        self.rng = rng
        self.min_available_nodes = min_available_nodes
        self.uniform_sampling = uniform_sampling
        self.connect_timeout = connect_timeout
        self.released_keys = released_keys
        self.divergence = divergence
        self.local_view = (
            LocalViewLedger(
                accountant=ledger.accountant,
                target_delta=ledger.target_delta,
                neighboring=ledger.neighboring,
                max_epsilon=ledger.max_epsilon,
            )
            if noise_site == "client" and self.LOCAL_VIEW
            else None
        )
        self.secure: SecureNoiseSite | None = None  # set by SecureAggregation
        self._mask: list[bool] | None = None
        self._released_dim = 0  # d of the released arrays, known from round 1
        self._round_state: tuple[ArrayRecord, list[int], int] | None = None

    # -- what one round releases ------------------------------------------------
    def update_noise_multiplier(self) -> float:
        """Noise multiplier of the model-update noise (z; adaptive clipping raises it)."""
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
        factor = l2_sensitivity_factor(self.ledger.neighboring)
        note = (
            ""
            if self.uniform_sampling
            else (
                "clients selected by the wrapped strategy from their data: "
                "no amplification by subsampling claimed"
            )
        )
        update = Release(
            server_round=server_round,
            kind="model-update",
            mechanism="gaussian",
            noise_multiplier=noise_multiplier / factor,
            laplace_epsilon=None,
            sampling=self.ledger.sampling,
            sample_size=self.num_sampled_clients,
            population=population,
            count=count,
            note=note,
        )
        if self.divergence is None:
            return [update]
        return [update, self._divergence_release(noise_multiplier, server_round, count)]

    def divergence_mechanism(self, noise_multiplier: float | None = None) -> BoundedScalarRelease:
        """The divergence report's mechanism this round (bound D, multiplier z_d), with
        the run's z, or ``noise_multiplier`` while calibration tries one."""
        assert self.divergence is not None
        z = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        assert z is not None
        return BoundedScalarRelease(
            bound=self.divergence.bound or self.clip_norm,
            noise_multiplier=self.divergence.noise_multiplier or z,
        )

    def _divergence_release(self, noise_multiplier: float, server_round: int, count: int = 1):
        """Every sampled client's noised divergence: one Gaussian release with
        multiplier z_d per round for the client it concerns (each report depends on its
        own client's data only), charged as if every client reported every round."""
        z_d = self.divergence_mechanism(noise_multiplier).noise_multiplier
        return Release(
            server_round=server_round,
            kind="divergence-report",
            mechanism="gaussian",
            noise_multiplier=z_d,
            sampling="none",
            sample_size=1,
            population=1,
            count=count,
            note=(
                "each selected client's model divergence, clipped to a public bound and "
                "noised on the client; selection and adaptive mu read only these. No "
                "amplification: the server knows whom it asked, and selection depends on "
                "the reports"
            ),
        )

    def calibrate(self, population: int) -> None:
        """Set z to meet ``target_epsilon`` over the planned rounds with ``population``
        clients (once: the first round's N)."""
        if self.noise_multiplier is not None:
            return
        self.noise_multiplier = self.calibrated(population)
        self.record_calibration(
            "dp.noise-multiplier",
            self.noise_multiplier,
            population,
            **{"expected-clients": self.num_sampled_clients},
        )
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

    def local_release(self, server_round: int) -> Release:
        """One client's noisy upload as the server sees it: its clipped update plus its
        own share N(0, (z_Δ C)²/m), no amplification (the server knows whom it asked)."""
        factor = l2_sensitivity_factor(self.ledger.neighboring)
        z = self.update_noise_multiplier() / math.sqrt(self.num_sampled_clients) / factor
        return Release(
            server_round=server_round,
            kind="noisy-upload",
            mechanism="gaussian",
            noise_multiplier=z,
            sampling="none",
            sample_size=1,
            population=1,
            note="one client's clipped update and its own noise share, seen by the server",
        )

    def local_releases(self, server_round: int) -> list[Release]:
        """What the server sees of one sampled client in one round: its noisy upload,
        and its noised divergence when the wrapped strategy asks for one."""
        releases = [self.local_release(server_round)]
        if self.divergence is not None:
            assert self.noise_multiplier is not None
            releases.append(self._divergence_release(self.noise_multiplier, server_round))
        return releases

    # -- training half ----------------------------------------------------------
    def client_config(self) -> dict[str, float | bool | list[str]]:
        """Keys added to every sampled client's train config."""
        config: dict = {keys.DP_CLIP_NORM: self.clip_norm, **self.report_config()}
        if self.secure is not None:
            return {**config, **self.secure.client_config(self)}
        if self.noise_site == "client":
            mech = self._mechanism()
            config[keys.DP_NOISE_STDDEV] = mech.client_noise_std(self.num_sampled_clients)
        if self.divergence is not None:
            report = self.divergence_mechanism()
            config[keys.DIVERGENCE_CLIP] = report.bound
            config[keys.DIVERGENCE_NOISE_STDDEV] = report.noise_std
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
        if self.local_view is not None and self.local_view.would_exceed(
            *self.local_releases(server_round)
        ):
            raise BudgetExhausted(
                f"round {server_round} would take the epsilon against the server of a "
                f"client asked in every round above 'dp.max-epsilon' = "
                f"{self.ledger.max_epsilon} (so far {self.local_view.bound():.4f}); "
                "nothing was sent"
            )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample m nodes, let the wrapped strategy configure them, add DP keys."""
        all_nodes = self.nodes_for_round(
            server_round, grid, self.num_sampled_clients, self.min_available_nodes
        )
        expected = self.num_sampled_clients
        if self.secure is not None:
            all_nodes = self.secure.eligible(self, all_nodes)
        if self.ledger.sampling == "poisson":
            nodes = poisson_sample(all_nodes, expected / len(all_nodes), self.rng, self.partitions)
            grid, expected = GridView(grid, nodes), len(nodes)
        elif self.uniform_sampling:
            grid = GridView(grid, sample_uniform(all_nodes, expected, self.rng, self.partitions))
        messages = (
            list(self.strategy.configure_train(server_round, arrays, config, grid))
            if expected
            else []  # an empty Poisson cohort: the round releases the noise alone
        )
        if len(messages) != expected:
            raise StopTraining(
                f"the wrapped strategy configured {len(messages)} clients, DP-FedAvg "
                f"sampled {expected}"
            )
        self._fix_released(arrays)
        messages = add_to_config(messages, self.client_config())
        sent = self.partitions.order(m.metadata.dst_node_id for m in messages)
        if self.local_view is not None:  # the server will see each of them on its own
            clients = [self.partitions.client_name(n) for n in sent]
            for release in self.local_releases(server_round):
                self.local_view.charge(clients, release)
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
            accepted = [m for m in replies if m.metadata.src_node_id not in failed]
            self.strategy.observe_train(server_round, accepted, arrays_checked=True)
        mean = self._private_mean(list(deltas.values()), len(failed), self._released(reference))
        new_arrays = to_record(
            current, [c + d for c, d in zip(reference, self._merge(mean, reference), strict=True)]
        )
        self.ledger.charge(self.release(server_round, population))
        return new_arrays, self.released_metrics(records, failed)

    def released_metrics(
        self,
        records: list[MetricRecord],
        failed: list[int],
        centred_bits: float | None = None,
        **extra: float,
    ) -> MetricRecord:
        """The round's train metrics: the valid replies' (weighted 1), the mechanism's,
        ``extra``, the failed clients and the ε so far (after the round is charged)."""
        aggregated = dict(weighted_metrics(records))
        aggregated.update(self.round_metrics(records, centred_bits))
        aggregated.update(extra)
        aggregated[keys.DP_FAILED_CLIENTS] = float(len(failed))
        aggregated[keys.DP_EPSILON] = self.ledger.epsilon()
        if self.local_view is not None:  # published: the sample-independent bound
            aggregated[keys.DP_EPSILON_LOCAL] = self.local_view.bound()
            aggregated[keys.DP_EPSILON_LOCAL_WORST] = self.local_view.worst()[1]
        return MetricRecord(self.mark(aggregated))

    def _contributions(
        self,
        replies: Iterable[Message],
        sent: list[int],
        reference_of: Callable[[int], tuple[ArrayRecord, list[np.ndarray]]],
    ) -> tuple[dict[int, list[np.ndarray]], list[MetricRecord], list[int]]:
        """(node -> released delta of its valid reply, their metrics weighted 1, the
        sampled nodes counted as a zero update), in partition order. ``reference_of``
        gives the model a node was sent, as a record and as arrays."""
        by_node: dict[int, Message] = {}
        for message in replies:
            by_node.setdefault(message.metadata.src_node_id, message)
        deltas, records, failed = {}, [], []
        for node in sent:
            current, reference = reference_of(node)
            message = by_node.get(node)
            try:
                if message is None:
                    raise InvalidReply("no reply")
                received, metrics = self._check(message, current)
            except InvalidReply as err:
                failed.append(node)
                log(WARNING, "DP-FedAvg: node %d counts as a zero update: %s", node, err)
                continue
            deltas[node] = self._released(
                [r - c for r, c in zip(received, reference, strict=True)]
            )
            metrics[keys.NUM_EXAMPLES] = 1.0
            records.append(metrics)
        return deltas, records, failed

    def _check(self, message: Message, current: ArrayRecord):
        """The reply's arrays and metrics, or InvalidReply (see :func:`check_reply`)."""
        return check_reply(message, current)

    # -- head-only: which arrays are released ------------------------------------
    def _fix_released(self, arrays: ArrayRecord) -> None:
        """At the first round: which arrays are released (mask) and their total size d."""
        if self._mask is None:
            self._mask = self._released_mask(arrays)
            kept = zip(arrays_of(arrays), self._mask, strict=True)
            self._released_dim = sum(a.size for a, keep in kept if keep)
            self._report_noise_to_signal()

    def _report_noise_to_signal(self) -> None:
        """Log the noise on the mean update against the most any client can move it.

        The mean's noise has expected L2 norm about z·C·√d / m over the d released
        weights, while the clipped signal is at most C: above ``NOISE_TO_SIGNAL_WARNING``
        a model learns little (digits: the peer workload's MLP learns at ratios 5 and 10,
        LeNet on the default federation of 10 nodes, at 40, does not), so the run says so
        before it spends its budget.
        """
        ratio = (
            self.update_noise_multiplier()
            * math.sqrt(self._released_dim)
            / self.num_sampled_clients
        )
        level = WARNING if ratio > NOISE_TO_SIGNAL_WARNING else INFO
        log(
            level,
            "DP-FedAvg: the noise on the mean update has norm about %.1f x C (z %.3f, "
            "d = %d released weights, m = %g clients per round) against at most C of "
            "signal%s",
            ratio,
            self.update_noise_multiplier(),
            self._released_dim,
            self.num_sampled_clients,
            (
                ": expect the model to learn little. The noise shrinks as sqrt(d)/m: more "
                "clients per round ('dp.num-sampled-clients' with more nodes), a smaller "
                "model ('model.name' = 'mlp' for digits), or a larger epsilon; on digits, "
                "preset='digits-dp-eps8' on 100 SuperNodes learns (README)"
                if level == WARNING
                else ""
            ),
        )

    def _released_mask(self, arrays: ArrayRecord) -> list[bool]:
        """Which arrays are released: floating arrays (of the head, head-only); integer
        arrays keep the server's value (:func:`privacy.mechanisms.is_released`)."""
        keys_ = list(arrays.keys())
        floating = [is_released(a) for a in arrays_of(arrays)]
        if self.released_keys is None:
            return floating
        missing = sorted(set(self.released_keys) - set(keys_))
        if missing:
            raise StopTraining(f"head-only arrays {missing} are not in the global model")
        return [key in self.released_keys and f for key, f in zip(keys_, floating, strict=True)]

    def _released(self, delta: list[np.ndarray]) -> list[np.ndarray]:
        assert self._mask is not None
        return [d for d, keep in zip(delta, self._mask, strict=True) if keep]

    def _merge(self, mean: list[np.ndarray], reference: list[np.ndarray]) -> list[np.ndarray]:
        """The released mean back among zero deltas of the frozen (head-only) arrays:
        whatever a client sent for those is ignored."""
        assert self._mask is not None
        released = iter(mean)
        return [
            next(released) if keep else np.zeros_like(c)
            for c, keep in zip(reference, self._mask, strict=True)
        ]

    def _private_mean(
        self, deltas: list[list[np.ndarray]], missing: int, template: list[np.ndarray]
    ) -> list[np.ndarray]:
        """The private mean over m of the released arrays of the clients' deltas
        (``template``: the released arrays of the global model, for shapes and dtypes).

        Server-side noise is drawn once, N(0, (zC)²) on the sum of the clipped deltas:
        the distribution of m client shares N(0, (zC)²/m) summed, at 1/m of the draws
        (drawing the noise was most of the aggregate's time, bench/privacy_cost.py).
        Client-side noise: the ``missing`` clients' shares are drawn here, so the sum
        carries N(0, (zC)²) whoever failed. The sum is kept in float64; the mean is
        returned in the arrays' dtypes.
        """
        mech, m = self._mechanism(), self.num_sampled_clients
        total = [np.zeros(a.shape) for a in template]
        for delta in deltas:
            if self.noise_site == "server":
                try:
                    delta = mech.clip(delta).arrays
                except NonFiniteUpdateError as err:  # checked already; defensive
                    raise InvalidReply(str(err)) from err
            else:
                delta = self._within_client_bound(delta, m)
            for t, d in zip(total, delta, strict=True):
                t += d
        if self.noise_site == "server":
            total = mech.noise_sum(total, rng=self.rng)
        elif missing:
            share = mech.client_noise_std(m) * math.sqrt(missing)
            total = [t + self.rng.normal(0.0, share, size=t.shape) for t in total]
        return [(t / m).astype(a.dtype, copy=False) for t, a in zip(total, template, strict=True)]

    def _within_client_bound(self, delta: list[np.ndarray], m: int) -> list[np.ndarray]:
        """With client-side noise the server cannot check the clip, only the norm an honest
        noisy update has: ``‖Δ + ξ‖ <= C + σ(√d + 8)`` for ξ ~ N(0, σ²I), σ = zC/√m, except
        with probability e^(−32) (Gaussian norm concentration). A larger update, which no
        honest client sends, is scaled back to that radius and logged."""
        d = sum(a.size for a in delta)
        sigma = self.update_noise_multiplier() * self.clip_norm / math.sqrt(m)
        radius = self.clip_norm + sigma * (math.sqrt(d) + 8.0)
        result = clip_by_l2_norm(delta, clip_norm=radius)
        if result.clipped:
            log(
                WARNING,
                "DP-FedAvg: a client-noised update of norm %.4g exceeds the bound %.4g an "
                "honest client meets; scaled back to it",
                result.norm,
                radius,
            )
        return result.arrays

    def spi_values(self) -> dict[int, float] | None:
        """SPI(k) of the isotropic noise on the released arrays (``kσ²``; see
        :mod:`privacy.certificates`); None before round 1."""
        if not self._released_dim:
            return None
        return spi(
            [], floor=1.0, dim=self._released_dim, noise_multiplier=self.update_noise_multiplier()
        )

    def round_metrics(
        self, records: list[MetricRecord], centred_bits: float | None = None
    ) -> dict[str, float]:
        """Extra per-round metrics from the valid replies' metrics (the adaptive subclass
        releases its noised count and moves its clip norm here; ``centred_bits``: the
        securely summed bits minus half the survivors, instead of the replies')."""
        return {"dp-clip-norm": self.clip_norm}

    def on_resume(self) -> None:
        """Every client may have sent a noisy upload in the round under way when the
        server stopped (its sample was lost with it): charge one to each (local view)."""
        if self.local_view is not None:
            for release in self.local_releases(0):
                self.local_view.charge_all(release)
            log(
                INFO,
                "resume: one noisy upload (and divergence report) charged to every client "
                "against the server (the "
                "interrupted round's sample is unknown)",
            )

    # -- evaluation and summary: the wrapped strategy's ---------------------------
    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
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

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the generator and the ledgers in place)."""
        self.rng.bit_generator.state = state["rng"]
        self.clip_norm, self.noise_multiplier = state["clip-norm"], state["noise-multiplier"]
        self.calibration = state["calibration"]
        load_ledger(self.ledger, state["ledger"])
        load_ledger(self.local_view, state["local-view"])

    def summary(self) -> None:
        """Log the DP settings, then the wrapped strategy's summary."""
        log(INFO, "\t├──> DP-FedAvg (%s):", type(self).__name__)
        log(
            INFO,
            "\t│\t├── clip norm C = %g, noise multiplier z = %s",
            self.clip_norm,
            f"{self.noise_multiplier:g}"
            if self.noise_multiplier is not None
            else f"calibrated in round 1 to epsilon {self.target_epsilon:g}",
        )
        log(
            INFO,
            "\t│\t├── m = %d clients per round (%s), noise added by the %s",
            self.num_sampled_clients,
            "expected, Poisson" if self.ledger.sampling == "poisson" else "exactly",
            self.noise_site,
        )
        log(
            INFO,
            "\t│\t└── accounting: %s, sampling %s, delta %g, max epsilon %s",
            self.ledger.accountant,
            self.ledger.sampling,
            self.ledger.target_delta,
            self.ledger.max_epsilon or "none",
        )
        if self.divergence is not None:
            log(
                INFO,
                "\t│\t└── divergence reports: clipped to %s, noise multiplier %s, "
                "charged every round without amplification (selection reads only them)",
                f"{self.divergence.bound:g}" if self.divergence.bound else "the clip norm C",
                f"{self.divergence.noise_multiplier:g}"
                if self.divergence.noise_multiplier
                else "z (the run's)",
            )
        if self.local_view is not None:
            log(
                INFO,
                "\t│\t└── against the server: each client's noisy upload, multiplier %.4g, "
                "composed over its own rounds (no amplification)",
                self.local_release(0).noise_multiplier,
            )
        self.strategy.summary()


# -- the client half ----------------------------------------------------------------
def privatise_update(
    config: ConfigRecord, delta: list[np.ndarray], metrics: MetricRecord, rng: np.random.Generator
) -> list[np.ndarray]:
    """Clip Δ to L2 norm C, add the client's noise share when it noises its own upload,
    set the adaptive-clipping bit, and release SmartFedProx's divergence when asked."""
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
    if keys.DIVERGENCE_CLIP in config:
        release_divergence(config, metrics, rng)
    return delta


def release_divergence(config: ConfigRecord, metrics: MetricRecord, rng) -> None:
    """Replace the raw divergence by its clipped, noised release (0 when none was
    computed: a failed client's zero update)."""
    bound = float(config[keys.DIVERGENCE_CLIP])
    std = float(config[keys.DIVERGENCE_NOISE_STDDEV])
    raw = metrics.get(keys.DIVERGENCE, 0.0)
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise InvalidReply(f"'{keys.DIVERGENCE}' = {raw!r} is not a number")
    release = BoundedScalarRelease(bound=bound, noise_multiplier=std / bound)
    metrics[keys.DIVERGENCE] = release.release(float(raw), rng=rng)


# DP-FedAvg's client mod (fixed and adaptive clipping, under SecAgg+ too).
dp_fedavg_mod = client_mod(
    privatise_update,
    applies=lambda config: keys.DP_CLIP_NORM in config,
    client_noised=lambda config: keys.DP_NOISE_STDDEV in config,
    name="dp_fedavg_mod",
)
