"""DP-FedAvg wrappers with fixed and adaptive clipping (seed 002).

McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models";
Andrew et al. 2021, "Differentially Private Learning with Adaptive Clipping".

Any strategy of the registry can be wrapped. The wrapper

* samples exactly ``num_sampled_clients`` nodes per round, uniformly without
  replacement, with the run's generator, and lets the wrapped strategy configure
  only those nodes (it sees a grid holding just them);
* adds ``dpfedavg_clip_norm`` (and, with client-side noising,
  ``dpfedavg_noise_stddev`` = z·C/√m) to every node's config;
* aborts the round if any sampled client fails or replies with something unusable:
  all updates are discarded, the global model is kept, no privacy is charged;
* averages the clipped updates unweighted and, with server-side noising, perturbs
  each one as client-side noising would have (N(0, (zC)²/m) each, so the sum carries
  N(0, (zC)²));
* charges every released aggregate to the run's :class:`privacy.accounting.PrivacyLedger`
  and refuses, before sending anything, a round that would exceed the budget.

Contract with the client (``client_app.mods.privacy_mod`` implements it)::

    delta = trained - received
    delta = delta * min(1, C / ||delta||_2)            # C = config["dpfedavg_clip_norm"]
    if "dpfedavg_noise_stddev" in config:
        delta += N(0, config["dpfedavg_noise_stddev"]**2 I)
    if config.get("dpfedavg_adaptive_clip_enabled"):
        metrics["dpfedavg-norm-bit"] = float(||delta_before_clip||_2 <= C)
    reply arrays = received + delta
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
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from privacy.accounting import PrivacyLedger, Release, l2_sensitivity_factor
from privacy.certificates import spi
from privacy.mechanisms import GaussianMechanism, NonFiniteUpdateError, clip_by_l2_norm
from strategies import keys, partitions
from strategies.base import (
    GridView,
    InvalidReply,
    StopTraining,
    TrainingWrapper,
    add_to_config,
    arrays_of,
    check_reply,
    metrics_of,
    sample_uniform,
    to_record,
    unweighted,
    wait_for_nodes,
)


class DPFedAvgFixed(TrainingWrapper):
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
        The run's generator for sampling and server-side noise.
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
    secure_rng : bool
        ``rng`` draws from OS entropy: its state is never written to a checkpoint
        (whoever read it could subtract the noise); a resumed run draws fresh.
    """

    CHECKPOINT = ("rng", "clip_norm", "ledger")  # strategies.checkpoint

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
        secure_rng: bool = False,
    ) -> None:
        if clip_norm <= 0 or noise_multiplier <= 0 or num_sampled_clients < 1:
            raise ValueError("clip_norm and noise_multiplier must be > 0, m >= 1")
        if noise_site not in ("server", "client"):
            raise ValueError(f"noise_site must be 'server' or 'client', not {noise_site!r}")
        super().__init__(strategy)
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
        self.checkpoint_exclude = ("rng",) if secure_rng else ()
        self._mask: list[bool] | None = None
        self._released_dim = 0  # d of the released arrays, known from round 1
        self._round_state: tuple[ArrayRecord, set[int], int] | None = None

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

    # -- training half ----------------------------------------------------------
    def client_config(self) -> dict[str, float | bool]:
        """Keys added to every sampled client's train config."""
        config: dict[str, float | bool] = {keys.DP_CLIP_NORM: self.clip_norm}
        if self.noise_site == "client":
            mech = self._mechanism()
            config[keys.DP_NOISE_STDDEV] = mech.client_noise_std(self.num_sampled_clients)
        return config

    def _mechanism(self) -> GaussianMechanism:
        return GaussianMechanism(
            clip_norm=self.clip_norm, noise_multiplier=self.update_noise_multiplier()
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
        if self.ledger.would_exceed(self.release(server_round, len(all_nodes))):
            raise StopTraining(
                f"round {server_round} would exceed 'dp.max-epsilon' = "
                f"{self.ledger.max_epsilon} (epsilon so far {self.ledger.epsilon():.4f} at "
                f"delta {self.ledger.target_delta:g}); nothing was sent"
            )
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
        sent = {m.metadata.dst_node_id for m in messages}
        self._round_state = (arrays, sent, len(all_nodes))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average clipped (and noised) updates unweighted; abort on any failure."""
        if self._round_state is None:
            return None, None
        current, sent, population = self._round_state
        self._round_state = None
        replies = partitions.sort_replies(replies)
        try:
            deltas, metrics = self._check_round(replies, sent, current)
        except InvalidReply as err:
            log(
                WARNING,
                "DP round %d aborted (nothing released, nothing charged): %s",
                server_round,
                err,
            )
            return None, None
        mean = self._merge(self._private_mean([self._released(d) for d in deltas]), deltas)
        new_arrays = to_record(
            current, [c + d for c, d in zip(arrays_of(current), mean, strict=True)]
        )
        self.ledger.charge(self.release(server_round, population))
        aggregated = aggregate_metricrecords(metrics, keys.NUM_EXAMPLES)
        aggregated.update(self.round_metrics(replies))
        aggregated["dp-epsilon"] = self.ledger.epsilon()
        return new_arrays, aggregated

    def _check_round(self, replies, sent, current):
        """Return (deltas, unweighted metric records), or raise InvalidReply."""
        errors = [m for m in replies if m.has_error()]
        if errors:
            raise InvalidReply(f"{len(errors)} sampled client(s) failed: {errors[0].error.reason}")
        got = {m.metadata.src_node_id for m in replies}
        if got != sent:
            raise InvalidReply(f"{len(sent - got)} of {len(sent)} sampled clients did not reply")
        reference = arrays_of(current)
        deltas = []
        for message in replies:
            received, _ = check_reply(message, current)
            deltas.append([r - c for r, c in zip(received, reference, strict=True)])
        return deltas, [unweighted(m) for m in replies]

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

    def _merge(self, mean: list[np.ndarray], deltas: list[list[np.ndarray]]) -> list[np.ndarray]:
        """The released mean back among zero deltas of the frozen arrays."""
        assert self._mask is not None
        frozen = [i for i, keep in enumerate(self._mask) if not keep]
        changed = sum(any(np.any(delta[i] != 0) for i in frozen) for delta in deltas)
        if changed and self.noise_site == "server":  # client noise covers every array
            log(
                WARNING,
                "%d client(s) changed arrays outside the released (head-only) arrays; "
                "those changes were ignored",
                changed,
            )
        released = iter(mean)
        return [
            next(released) if keep else np.zeros_like(d)
            for d, keep in zip(deltas[0], self._mask, strict=True)
        ]

    def _private_mean(self, deltas: list[list[np.ndarray]]) -> list[np.ndarray]:
        """The private mean of the released arrays of the clients' deltas.

        Server-side noise is drawn once, N(0, (zC)²) on the sum of the m clipped deltas:
        the distribution of m client shares N(0, (zC)²/m) summed, at 1/m of the draws
        (drawing the noise was most of the aggregate's time, bench/privacy_cost.py). The
        sum is kept in float64; the mean is returned in the deltas' dtype.
        """
        mech, m = self._mechanism(), len(deltas)
        total: list[np.ndarray] | None = None
        for delta in deltas:
            if self.noise_site == "server":
                try:
                    delta = mech.clip(delta).arrays
                except NonFiniteUpdateError as err:  # checked already; defensive
                    raise InvalidReply(str(err)) from err
            else:
                delta = self._within_client_bound(delta, m)
            if total is None:
                total = [np.array(d, dtype=np.float64) for d in delta]  # own copies
            else:
                for t, d in zip(total, delta, strict=True):
                    t += d
        if self.noise_site == "server":
            total = mech.noise_sum(total, rng=self.rng)
        return [(t / m).astype(d.dtype, copy=False) for t, d in zip(total, deltas[0], strict=True)]

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

    def round_metrics(self, replies: list[Message]) -> dict[str, float]:
        """Extra per-round metrics (the adaptive subclass reports its clip norm)."""
        return {"dp-clip-norm": self.clip_norm}

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
        self.strategy.summary()


class DPFedAvgAdaptive(DPFedAvgFixed):
    """DP-FedAvg with adaptive clipping (Andrew et al. 2021, Algorithm 1).

    Each client reports the bit b_i = [||Δ_i|| <= C]. The server releases the noised
    fraction b̄ = (Σ b_i + N(0, σ_b²)) / m and updates C ← C·exp(−η_C (b̄ − γ)), moving C
    towards the γ-quantile of the update norms. The update noise uses
    z_Δ = (z⁻² − (2σ_b)⁻²)^(-1/2) so that updates and count together are one Gaussian
    mechanism with noise multiplier z (their Theorem 1): the ledger charges exactly
    that release, which therefore covers the count query.
    """

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

    def round_metrics(self, replies: list[Message]) -> dict[str, float]:
        """Release the noised count, update C, and report both."""
        bits = [float(metrics_of(m)[keys.DP_NORM_BIT]) for m in replies]
        noisy_fraction = (sum(bits) + self.rng.normal(0.0, self.count_stddev)) / len(bits)
        used = self.clip_norm
        self.clip_norm = used * math.exp(-self.clip_lr * (noisy_fraction - self.target_quantile))
        return {"dp-clip-norm": used, "dp-noisy-unclipped-fraction": noisy_fraction}

    def _check_round(self, replies, sent, current):
        deltas, metrics = super()._check_round(replies, sent, current)
        for message in replies:
            bit = metrics_of(message).get(keys.DP_NORM_BIT)
            if bit not in (0.0, 1.0, 0, 1):
                raise InvalidReply(
                    f"client {message.metadata.src_node_id} sent no valid "
                    f"'{keys.DP_NORM_BIT}' (got {bit!r})"
                )
        return deltas, metrics
