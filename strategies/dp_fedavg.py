"""DP-FedAvg wrappers with fixed and adaptive clipping (seed 002).

McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models";
Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping".

Any strategy of the registry can be wrapped. The wrapper

* samples exactly ``num_sampled_clients`` nodes per round, uniformly without
  replacement, with the secret DP generator (OS entropy; the run seed only under
  ``dp.reproducible-noise``), and lets the wrapped strategy configure only those nodes
  (it sees a grid holding just them);
* adds ``dpfedavg_clip_norm`` (and, with client-side noising,
  ``dpfedavg_noise_stddev`` = z·C/√m) to every node's config, and what the clients may
  report (``report-metrics``);
* never aborts a round: a sampled client that fails, times out or replies with
  something unusable contributes a zero update (a value an honest client may send, so
  the sensitivity is unchanged), and the round is released and charged like any other.
  With client-side noising the server adds that client's missing noise share itself;
* averages the clipped updates over the fixed m and, with server-side noising, adds
  N(0, (zC)²) once to their sum;
* charges every released aggregate to the run's :class:`privacy.accounting.PrivacyLedger`
  and, with client-side noising, each sampled client's own noisy upload to a
  :class:`privacy.local_view.LocalViewLedger` (what the server itself sees, without
  amplification); refuses, before sending anything, a round that would exceed the
  budget in either.

Contract with the client (``client_app.mods.privacy_mod`` implements it)::

    delta = trained - received
    delta = delta * min(1, C / ||delta||_2)            # C = config["dpfedavg_clip_norm"]
    if "dpfedavg_noise_stddev" in config:
        delta += N(0, config["dpfedavg_noise_stddev"]**2 I)   # from a secret generator
    if config.get("dpfedavg_adaptive_clip_enabled"):
        metrics["dpfedavg-norm-bit"] = float(||delta_before_clip||_2 <= C)
    reply arrays = received + delta
    reply metrics = only config["report-metrics"] (num-examples sent as 1)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.accounting import PrivacyLedger, Release, l2_sensitivity_factor
from privacy.certificates import spi
from privacy.local_view import LocalViewLedger
from privacy.mechanisms import GaussianMechanism, NonFiniteUpdateError, clip_by_l2_norm
from strategies import keys, partitions
from strategies.base import (
    GridView,
    InvalidReply,
    StopTraining,
    add_to_config,
    arrays_of,
    check_reply,
    sample_uniform,
    to_record,
    wait_for_nodes,
    weighted_metrics,
)
from strategies.private import PrivacyWrapper


class DPFedAvgFixed(PrivacyWrapper):
    """DP-FedAvg with a fixed clip norm around any strategy.

    Parameters
    ----------
    strategy : Strategy
        The wrapped strategy; it must sample every node of the grid it is given
        (``fraction_train = 1``), since the wrapper does the sampling.
    clip_norm : float
        L2 clip norm C of each client's update.
    noise_multiplier : float
        z: the noise on the sum of clipped updates has std z·C.
    num_sampled_clients : int
        m, the fixed number of clients per round.
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
    released_keys : tuple of str, optional
        Head-only training: only these arrays are clipped, noised and updated; the
        others keep the global values whatever a client sends. None: every array.
    **kwargs
        ``client_metrics`` and ``noise_from_seed`` (:class:`PrivacyWrapper`).
    """

    # The generator's state is secret: it lives only in the owner-only checkpoint.
    CHECKPOINT = ("rng", "clip_norm", "ledger", "local_view")  # strategies.checkpoint
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
        noise_multiplier: float,
        num_sampled_clients: int,
        noise_site: str,
        ledger: PrivacyLedger,
        rng: np.random.Generator,
        min_available_nodes: int = 1,
        uniform_sampling: bool = True,
        connect_timeout: float = 300.0,
        released_keys: tuple[str, ...] | None = None,
        **kwargs,
    ) -> None:
        if clip_norm <= 0 or noise_multiplier <= 0 or num_sampled_clients < 1:
            raise ValueError("clip_norm and noise_multiplier must be > 0, m >= 1")
        if noise_site not in ("server", "client"):
            raise ValueError(f"noise_site must be 'server' or 'client', not {noise_site!r}")
        super().__init__(strategy, **kwargs)
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.num_sampled_clients = num_sampled_clients
        self.noise_site = noise_site
        self.ledger = ledger
        self.rng = rng
        self.min_available_nodes = min_available_nodes
        self.uniform_sampling = uniform_sampling
        self.connect_timeout = connect_timeout
        self.released_keys = released_keys
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
        self._mask: list[bool] | None = None
        self._released_dim = 0  # d of the released arrays, known from round 1
        self._round_state: tuple[ArrayRecord, list[int], int] | None = None

    # -- what one round releases ------------------------------------------------
    def update_noise_multiplier(self) -> float:
        """Noise multiplier of the model-update noise (z; adaptive clipping raises it)."""
        return self.noise_multiplier

    def release(self, server_round: int, population: int) -> list[Release]:
        """The releases one aggregation makes, as the ledger accounts them."""
        factor = l2_sensitivity_factor(self.ledger.neighboring)
        sampling = "without-replacement" if self.uniform_sampling else "none"
        note = (
            ""
            if self.uniform_sampling
            else (
                "clients selected by the wrapped strategy from their data: "
                "no amplification by subsampling claimed"
            )
        )
        return [
            Release(
                server_round=server_round,
                kind="model-update",
                mechanism="gaussian",
                noise_multiplier=self.noise_multiplier / factor,
                laplace_epsilon=None,
                sampling=sampling,
                sample_size=self.num_sampled_clients,
                population=population,
                note=note,
            )
        ]

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

    # -- training half ----------------------------------------------------------
    def client_config(self) -> dict[str, float | bool | list[str]]:
        """Keys added to every sampled client's train config."""
        config: dict = {keys.DP_CLIP_NORM: self.clip_norm, **self.report_config()}
        if self.noise_site == "client":
            mech = self._mechanism()
            config[keys.DP_NOISE_STDDEV] = mech.client_noise_std(self.num_sampled_clients)
        return config

    def _mechanism(self) -> GaussianMechanism:
        return GaussianMechanism(
            clip_norm=self.clip_norm, noise_multiplier=self.update_noise_multiplier()
        )

    def _refuse_over_budget(self, server_round: int, population: int) -> None:
        """StopTraining, before anything is sent, if the round would exceed the budget
        in the ledger or (client-side noise) for some client against the server."""
        if self.ledger.would_exceed(self.release(server_round, population)):
            raise StopTraining(
                f"round {server_round} would exceed 'dp.max-epsilon' = "
                f"{self.ledger.max_epsilon} (epsilon so far {self.ledger.epsilon():.4f} at "
                f"delta {self.ledger.target_delta:g}); nothing was sent"
            )
        if self.local_view is not None and self.local_view.would_exceed(
            self.local_release(server_round)
        ):
            _, worst = self.local_view.worst()
            raise StopTraining(
                f"round {server_round} would take a client's epsilon against the server "
                f"above 'dp.max-epsilon' = {self.ledger.max_epsilon} (worst so far "
                f"{worst:.4f}); nothing was sent"
            )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample m nodes, let the wrapped strategy configure them, add DP keys."""
        all_nodes = wait_for_nodes(
            grid,
            max(self.num_sampled_clients, self.min_available_nodes),
            timeout=self.connect_timeout,
        )
        if len(all_nodes) < self.num_sampled_clients:
            raise StopTraining(
                f"'dp.num-sampled-clients' = {self.num_sampled_clients} but only "
                f"{len(all_nodes)} nodes connected within {self.connect_timeout:g} s"
            )
        self._refuse_over_budget(server_round, len(all_nodes))
        if self.uniform_sampling:
            nodes = sample_uniform(all_nodes, self.num_sampled_clients, self.rng)
            grid = GridView(grid, nodes)
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        if len(messages) != self.num_sampled_clients:
            raise StopTraining(
                f"the wrapped strategy configured {len(messages)} clients, DP-FedAvg needs "
                f"exactly 'dp.num-sampled-clients' = {self.num_sampled_clients}"
            )
        messages = add_to_config(messages, self.client_config())
        self._fix_released(arrays)
        sent = partitions.order(m.metadata.dst_node_id for m in messages)
        if self.local_view is not None:  # the server will see each of them on its own
            clients = [partitions.client_name(n) for n in sent]
            self.local_view.charge(clients, self.local_release(server_round))
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
        reference = arrays_of(current)
        deltas, records, failed = self._contributions(replies, sent, current, reference)
        mean = self._private_mean(deltas, len(failed), self._released(reference))
        new_arrays = to_record(
            current, [c + d for c, d in zip(reference, self._merge(mean, reference), strict=True)]
        )
        self.ledger.charge(self.release(server_round, population))
        aggregated = dict(weighted_metrics(records))
        aggregated.update(self.round_metrics(records))
        aggregated[keys.DP_FAILED_CLIENTS] = float(len(failed))
        aggregated[keys.DP_EPSILON] = self.ledger.epsilon()
        if self.local_view is not None:
            aggregated[keys.DP_EPSILON_LOCAL] = self.local_view.worst()[1]
        return new_arrays, MetricRecord(self.mark(aggregated))

    def _contributions(
        self,
        replies: Iterable[Message],
        sent: list[int],
        current: ArrayRecord,
        reference: list[np.ndarray],
    ) -> tuple[list[list[np.ndarray]], list[MetricRecord], list[int]]:
        """(released deltas of the valid replies, their metrics weighted 1, the sampled
        nodes counted as a zero update), in partition order."""
        by_node: dict[int, Message] = {}
        for message in replies:
            by_node.setdefault(message.metadata.src_node_id, message)
        deltas, records, failed = [], [], []
        for node in sent:
            message = by_node.get(node)
            try:
                if message is None:
                    raise InvalidReply("no reply")
                received, metrics = self._check(message, current)
            except InvalidReply as err:
                failed.append(node)
                log(WARNING, "DP-FedAvg: node %d counts as a zero update: %s", node, err)
                continue
            delta = [r - c for r, c in zip(received, reference, strict=True)]
            deltas.append(self._released(delta))
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

    def _released_mask(self, arrays: ArrayRecord) -> list[bool]:
        keys_ = list(arrays.keys())
        if self.released_keys is None:
            return [True] * len(keys_)
        missing = sorted(set(self.released_keys) - set(keys_))
        if missing:
            raise StopTraining(f"head-only arrays {missing} are not in the global model")
        return [key in self.released_keys for key in keys_]

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

    def round_metrics(self, records: list[MetricRecord]) -> dict[str, float]:
        """Extra per-round metrics from the valid replies' metrics (the adaptive subclass
        releases its noised count and moves its clip norm here)."""
        return {"dp-clip-norm": self.clip_norm}

    def on_resume(self) -> None:
        """Every client may have sent a noisy upload in the round under way when the
        server stopped (its sample was lost with it): charge one to each (local view)."""
        if self.local_view is not None:
            release = self.local_release(0)
            self.local_view.charge_all(release)
            log(
                INFO,
                "resume: one noisy upload charged to every client against the server (the "
                "interrupted round's sample is unknown)",
            )

    # -- evaluation and summary: the wrapped strategy's ---------------------------
    def summary(self) -> None:
        """Log the DP settings, then the wrapped strategy's summary."""
        log(INFO, "\t├──> DP-FedAvg (%s):", type(self).__name__)
        log(
            INFO,
            "\t│\t├── clip norm C = %g, noise multiplier z = %g",
            self.clip_norm,
            self.noise_multiplier,
        )
        log(
            INFO,
            "\t│\t├── m = %d clients per round, noise added by the %s",
            self.num_sampled_clients,
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
        if self.local_view is not None:
            log(
                INFO,
                "\t│\t└── against the server: each client's noisy upload, multiplier %.4g, "
                "composed over its own rounds (no amplification)",
                self.local_release(0).noise_multiplier,
            )
        self.strategy.summary()


class DPFedAvgAdaptive(DPFedAvgFixed):
    """DP-FedAvg with adaptive clipping (Andrew et al. 2021, Algorithm 1).

    Each client reports the bit b_i = [||Δ_i|| <= C]. The server releases the noised
    fraction b̄ = (Σ b_i + N(0, σ_b²)) / m and updates C ← C·exp(−η_C (b̄ − γ)), moving C
    towards the γ-quantile of the update norms. The update noise uses
    z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2) so that updates and count together are one Gaussian
    mechanism with noise multiplier z (their Theorem 1): the ledger charges exactly
    that release, which therefore covers the count query.

    With client-side noise the bit reaches the server in the clear: no guarantee holds
    against the server itself (no local view), only against observers of the model.
    """

    RELEASED_METRICS = (*DPFedAvgFixed.RELEASED_METRICS, "dp-noisy-unclipped-fraction")
    CLIENT_REPORTS = (keys.DP_NORM_BIT,)
    LOCAL_VIEW = False

    def __init__(
        self,
        strategy: Strategy,
        *,
        target_quantile: float,
        clip_lr: float,
        count_stddev: float,
        **kwargs,
    ) -> None:
        super().__init__(strategy, **kwargs)
        if not 0 < target_quantile < 1 or clip_lr <= 0:
            raise ValueError("target_quantile must be in (0, 1), clip_lr > 0")
        if count_stddev <= self.noise_multiplier / 2:
            raise ValueError(
                f"the count noise sigma_b = {count_stddev:g} must exceed z/2 = "
                f"{self.noise_multiplier / 2:g} (z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2)"
            )
        self.target_quantile = target_quantile
        self.clip_lr = clip_lr
        self.count_stddev = count_stddev

    def update_noise_multiplier(self) -> float:
        """z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2), the update share of the combined noise."""
        z, sigma_b = self.noise_multiplier, self.count_stddev
        return (z**-2 - (2 * sigma_b) ** -2) ** -0.5

    def client_config(self) -> dict[str, float | bool]:
        """Fixed clipping's keys plus the request for the norm indicator bit."""
        return {**super().client_config(), keys.DP_ADAPTIVE: True}

    def release(self, server_round: int, population: int) -> list[Release]:
        """One Gaussian release with multiplier z covers updates and count together."""
        (update,) = super().release(server_round, population)
        note = (
            f"updates (z_delta = {self.update_noise_multiplier():.4f}) and the "
            f"clipped-count query (sigma_b = {self.count_stddev:g}) as one Gaussian "
            f"mechanism with z = {self.noise_multiplier:g} (Andrew et al. 2021, Thm 1)"
        )
        return [
            Release(
                **{
                    **update.__dict__,
                    "kind": "model-update+clip-count",
                    "note": "; ".join(n for n in (update.note, note) if n),
                }
            )
        ]

    def round_metrics(self, records: list[MetricRecord]) -> dict[str, float]:
        """Release the noised count (a failed client's bit counts 0), update C, and
        report both."""
        bits = [float(r[keys.DP_NORM_BIT]) for r in records]
        m = self.num_sampled_clients
        noisy_fraction = (sum(bits) + self.rng.normal(0.0, self.count_stddev)) / m
        used = self.clip_norm
        self.clip_norm = used * math.exp(-self.clip_lr * (noisy_fraction - self.target_quantile))
        return {"dp-clip-norm": used, "dp-noisy-unclipped-fraction": noisy_fraction}

    def _check(self, message: Message, current: ArrayRecord):
        received, metrics = super()._check(message, current)
        bit = metrics.get(keys.DP_NORM_BIT)
        if bit not in (0.0, 1.0, 0, 1):
            raise InvalidReply(f"no valid '{keys.DP_NORM_BIT}' (got {bit!r})")
        return received, metrics
