"""Subspace-DP-FL around any strategy: geometry-aligned DP-FedAvg.

Design notes: ``docs/notes.md``, ``strategies.mechanisms.subspace_dp``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from config.settings import Choice, Settings, SettingsError, setting
from privacy.accounting import Release
from privacy.allocation import allocate
from privacy.certificates import spi
from privacy.mechanisms import NonFiniteUpdateError, make_generator
from privacy.quantization import AnisotropicQuantizer, step_for_bits, topup_noise_multiplier
from privacy.subspace import (
    EllipticalGaussianMechanism,
    SketchAccumulator,
    SubspaceMetric,
    combined_noise_multiplier,
    estimate_subspace,
    flatten,
    pmu_noise_multiplier,
    release_sketch,
    sketch_matrix,
    unflatten,
    uniform_allocation,
)
from protocol.records import InvalidReply
from strategies.errors import StopTraining
from strategies.mechanisms.base import DPSettings
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed

_SKETCH_STREAM = 0x5C  # the public JL matrix of each PMU round
_DITHER_STREAM = 0xD7  # the shared dither of each (round, client) quantization
ALLOCATIONS = ("uniform", "water-filling", "fairness")
POOLED = "all"  # the key of the pooled public samples in SubspaceDP.public_samples
# Largest PMU sketch (d x s float64) the server builds: 4 GiB.
MAX_SKETCH_BYTES = 4 * 2**30


def pmu_rounds(num_rounds: int, every: int) -> int:
    """How many of rounds 1..T run PMU (rounds 1, 1 + every, 1 + 2·every, ...)."""
    return math.ceil(num_rounds / every)


class SubspaceDP(DPFedAvgFixed):
    """Geometry-aligned DP-FedAvg with Private Metric Updates (see the module doc).

    Parameters
    ----------
    strategy, clip_norm, noise_multiplier, num_sampled_clients
        As for :class:`DPFedAvgFixed`; C bounds the P-norm of an update, and z is the
        run's noise budget, split with the PMU sketches.
    rank, tau, trace_budget : int, float, float
        k directions of U; τ, the metric's floor off U; B = Tr(Λ), split over U.
    sketch_dim, pmu_every, lambda_ptr : int, int, float
        s > k, the JL sketch dimension; rounds between PMU releases; the PTR gate's
        threshold factor.
    pmu_reserve : float
        r in [0, 1): the zCDP budget's share spent on PMU (0: no PMU, P = τI).
    seed : int
        Run seed: the public sketch matrices derive from it.
    initial_basis : numpy.ndarray, optional
        A d×k orthonormal U from public data (no privacy cost); None: P = τI until PMU.
    allocation, quantize_bits
        How B is split over U ("uniform", "water-filling", "fairness"); 0, or b >= 2
        bits per whitened coordinate (both: the module's design notes).
    **kwargs
        As for :class:`DPFedAvgFixed` (``target_epsilon`` calibrates z for the whole
        run, PMU sketches included; ``planned_rounds`` also sets the budget split).
    """

    # The gate reads only the noised sketch, and the rank and code length are public;
    # the P-norm clipping statistics and quantization error come from raw updates.
    RELEASED_METRICS = (
        *DPFedAvgFixed.RELEASED_METRICS,
        "subspace-rank",
        "subspace-pmu-",
        "subspace-quant-bits-per-update",
    )

    def __init__(
        self,
        strategy: Strategy,
        *,
        clip_norm: float,
        noise_multiplier: float,
        num_sampled_clients: int,
        rank: int,
        tau: float,
        trace_budget: float,
        sketch_dim: int,
        pmu_every: int,
        lambda_ptr: float,
        pmu_reserve: float,
        seed: int,
        initial_basis: np.ndarray | None = None,
        allocation: str = "uniform",
        quantize_bits: int = 0,
        **kwargs,
    ) -> None:
        if not 1 <= rank < sketch_dim:
            raise ValueError(f"need 1 <= rank k = {rank} < sketch_dim s = {sketch_dim}")
        if allocation not in ALLOCATIONS:
            raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
        self.rank, self.tau, self.trace_budget = rank, tau, trace_budget
        self.sketch_dim, self.pmu_every, self.lambda_ptr = sketch_dim, pmu_every, lambda_ptr
        self.pmu_reserve, self.seed = pmu_reserve, seed
        self.initial_basis = initial_basis
        self.allocation = allocation
        # Group name -> public samples (n x d, e.g. per-example gradients); POOLED holds
        # all of them. Set by the app before round 1 when allocation is not uniform.
        self.public_samples: dict[str, np.ndarray] | None = None
        self.quantize_bits = quantize_bits
        self.z_train = self.z_pmu = self.z_noise = math.nan  # set with z
        super().__init__(
            strategy,
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            num_sampled_clients=num_sampled_clients,
            noise_site="server",
            **kwargs,
        )
        if self.noise_multiplier is not None:
            try:
                self.after_calibration()
            except StopTraining as err:
                raise ValueError(str(err)) from None
        self._spectra: list[np.ndarray] = []  # τ + λ of every metric used, for SPI
        self.metric: SubspaceMetric | None = None
        self._round = 0
        self._stats: dict[str, float] = {}

    # -- schedule and accounting ----------------------------------------------------
    def noise_split(self, noise_multiplier: float) -> tuple[float, float, float]:
        """(z_train, z_pmu, z_noise) of the budget z: z/√(1 − r), the sketches' share,
        and the Gaussian noise actually added (z_train, or its top-up when quantized).

        Raises
        ------
        ValueError
            If the quantization leaves no room for a Gaussian top-up.
        """
        rounds = self.planned_rounds
        z_train, z_pmu = pmu_noise_multiplier(
            noise_multiplier, self.pmu_reserve, rounds, pmu_rounds(rounds, self.pmu_every)
        )
        if not self.quantize_bits:
            return z_train, z_pmu, z_train
        try:
            z_noise = topup_noise_multiplier(
                z_train,
                clip_norm=self.clip_norm,
                step=step_for_bits(self.clip_norm, self.quantize_bits),
                num_clients=self.num_sampled_clients,
            )
        except ValueError as err:
            raise ValueError(f"'subspace.quantize-bits' = {self.quantize_bits}: {err}") from None
        return z_train, z_pmu, z_noise

    def after_calibration(self) -> None:
        """Split the budget z between training and PMU (and the quantization top-up)."""
        assert self.noise_multiplier is not None
        try:
            self.z_train, self.z_pmu, self.z_noise = self.noise_split(self.noise_multiplier)
        except ValueError as err:
            raise StopTraining(str(err)) from None

    def is_pmu_round(self, server_round: int) -> bool:
        """PMU runs in rounds 1, 1 + every, ... when a budget share is reserved for it."""
        return self.pmu_reserve > 0 and (server_round - 1) % self.pmu_every == 0

    def update_noise_multiplier(self) -> float:
        """The Gaussian noise multiplier of the update: z_train = z/√(1 − r), or its top-up
        z_top when updates are quantized."""
        return self.z_noise

    def planned_releases(self, noise_multiplier: float, population: int) -> list[Release]:
        """The releases of the whole planned run with budget z (calibration)."""
        _, z_pmu, z_noise = self.noise_split(noise_multiplier)
        pmu = sum(self.is_pmu_round(r) for r in range(1, self.planned_rounds + 1))
        plain = self.planned_rounds - pmu
        out = []
        for count, z in ((plain, z_noise), (pmu, combined_noise_multiplier(z_noise, z_pmu))):
            if count:
                out += self.releases_with(z, 1, population, count=count)
        return out

    def release(self, server_round: int, population: int) -> list[Release]:
        """One Gaussian release: the update, joined by the sketch in PMU rounds."""
        pmu = self.is_pmu_round(server_round)
        z = combined_noise_multiplier(self.z_noise, self.z_pmu) if pmu else self.z_noise
        (update,) = self.releases_with(z, server_round, population)
        # The rank that clipped this round (PMU may already have replaced the metric).
        rank = int(self._stats.get("subspace-rank", self.metric.rank if self.metric else 0))
        note = (
            f"P-norm clip C = {self.clip_norm:g}, elliptical noise N(0, z^2 C^2 P^-1) with "
            f"z = {self.z_noise:.4f}, metric rank {rank} (tau {self.tau:g}): whitened by "
            "P^1/2 a Gaussian mechanism with L2 sensitivity C"
        )
        if self.quantize_bits:
            note += (
                f"; updates quantized to {self.quantize_bits} bits and re-clipped, Gaussian "
                f"top-up z_top = {self.z_noise:.4f} of z_train = {self.z_train:.4f} (only the "
                "Gaussian part is charged)"
            )
        if not pmu:
            return [Release(**{**update.__dict__, "note": note})]
        note += (
            f"; PMU sketch (sensitivity sqrt 2, z_pmu = {self.z_pmu:.4f}) of the same sample, "
            f"composed with the update as one Gaussian with z = {z:.4f}; the PTR gate reads "
            "only the released sketch (post-processing)"
        )
        return [Release(**{**update.__dict__, "kind": "model-update+pmu-sketch", "note": note})]

    # -- training half --------------------------------------------------------------
    def client_config(self) -> dict:
        """Only what clients may report: they send raw updates, the server clips in the
        P-norm."""
        return self.report_config()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ):
        """Set up the metric (isotropic at first) over the released arrays, then sample."""
        if self.metric is None:
            self._fix_released(arrays)  # DPFedAvgFixed keeps the mask and d
            dim = self.head.dim
            if self.is_pmu_round(1) and dim * self.sketch_dim * 8 > MAX_SKETCH_BYTES:
                raise StopTraining(
                    f"the PMU sketch would hold d x s = {dim} x {self.sketch_dim} float64 "
                    f"values (> {MAX_SKETCH_BYTES / 2**30:g} GiB); lower 'subspace.sketch-dim', "
                    "train the head only ('subspace.head-only' = true) or set "
                    "'subspace.pmu-budget-reserve' = 0"
                )
            self.metric = self._initial_metric(dim)
            self._spectra.append(self.metric.tau + self.metric.lam)
        self._round = server_round
        return super().configure_train(server_round, arrays, config, grid)

    def _initial_metric(self, dim: int) -> SubspaceMetric:
        if self.initial_basis is None:
            return SubspaceMetric.isotropic(dim, self.tau)
        if self.initial_basis.shape != (dim, self.rank):
            raise StopTraining(
                f"the public initial basis has shape {self.initial_basis.shape}, the released "
                f"arrays need ({dim}, {self.rank})"
            )
        return self._metric_on(self.initial_basis)

    def _metric_on(self, basis: np.ndarray) -> SubspaceMetric:
        """The metric on U = ``basis`` with this run's trace allocation."""
        return SubspaceMetric(basis=basis, lam=self._allocate(basis), tau=self.tau)

    def _allocate(self, basis: np.ndarray) -> np.ndarray:
        """λ over U's directions: uniform, water-filling or the fairness program."""
        if self.allocation == "uniform":
            return uniform_allocation(self.rank, self.trace_budget)
        if not self.public_samples or POOLED not in self.public_samples:
            raise StopTraining(
                f"'subspace.allocation' = {self.allocation!r} needs the public samples, "
                "which the app did not provide"
            )
        groups = {g: x for g, x in self.public_samples.items() if g != POOLED}
        lam, fair = allocate(
            self.allocation,
            basis,
            self.public_samples[POOLED],
            groups,
            tau=self.tau,
            budget=self.trace_budget,
        )
        if fair is not None:
            log(
                INFO,
                "subspace-dp: fairness allocation, group distortions %s (max %.4g, gap %.2g)",
                ", ".join(f"{g} {d:.4g}" for g, d in zip(groups, fair.distortions, strict=True)),
                fair.max_distortion,
                fair.gap,
            )
        return lam

    def _private_mean(
        self, deltas: list[list[np.ndarray]], missing: int, template: list[np.ndarray]
    ) -> list[np.ndarray]:
        """Clip each released delta in the P-norm, add elliptical noise, average over m
        (the ``missing`` clients count as zero updates: nothing to sketch or add); run PMU."""
        assert self.metric is not None
        m = self.num_sampled_clients
        mech = EllipticalGaussianMechanism(self.metric, self.clip_norm, self.z_noise)
        quantizer = (
            AnisotropicQuantizer(self.metric, self.clip_norm, self.quantize_bits)
            if self.quantize_bits
            else None
        )
        pmu = self.is_pmu_round(self._round)
        sketch = (
            SketchAccumulator(
                sketch_matrix(
                    self.metric.dim,
                    self.sketch_dim,
                    make_generator(self.seed, self._round, _SKETCH_STREAM),
                )
            )
            if pmu
            else None
        )
        total = [np.zeros(a.shape) for a in template]
        norms, clipped, errors = [], 0, []
        for index, released in enumerate(deltas):
            try:
                result = mech.clip(released)
            except NonFiniteUpdateError as err:  # checked already; defensive
                raise InvalidReply(str(err)) from err
            norms.append(result.norm)
            clipped += result.clipped
            if sketch is not None:
                sketch.add(flatten(released))
            arrays = result.arrays
            if quantizer is not None:
                arrays, error = self._quantized(quantizer, mech, arrays, index)
                errors.append(error)
            for t, a in zip(total, arrays, strict=True):
                t += a
        noised = mech.noise_sum(total, rng=self.rng)
        self._stats = {"subspace-rank": float(self.metric.rank)}
        if quantizer is not None:
            self._stats["subspace-quant-bits-per-update"] = float(
                quantizer.bits_per_update(self.metric.dim)
            )
        if deltas:  # none to average over: an empty Poisson cohort, or every client failed
            self._stats["subspace-clip-fraction"] = clipped / len(deltas)
            self._stats["subspace-mean-pnorm"] = float(np.mean(norms))
            if errors:
                self._stats["subspace-quant-error"] = float(np.mean(errors))
        if sketch is not None:
            self._metric_update(sketch)
        return [n / m for n in noised]

    def _quantized(
        self,
        quantizer: AnisotropicQuantizer,
        mech: EllipticalGaussianMechanism,
        arrays: list[np.ndarray],
        index: int,
    ) -> tuple[list[np.ndarray], float]:
        """Encode and decode one clipped update with its shared dither; re-clip the result
        (sensitivity C whatever the decoding did). Returns it and ``‖x̂ − x‖²``."""
        x = flatten(arrays)
        codes = quantizer.encode(x, make_generator(self.seed, self._round, _DITHER_STREAM, index))
        decoded = quantizer.decode(
            codes, make_generator(self.seed, self._round, _DITHER_STREAM, index)
        )
        error = float(np.sum((decoded - x) ** 2))
        return mech.clip(unflatten(decoded, arrays)).arrays, error

    def spi_values(self) -> dict[int, float] | None:
        """SPI(k) of the most exposed metric the run used (total noise z_train; see
        :mod:`privacy.certificates`); None before round 1."""
        if not self._spectra:
            return None
        per_metric = [
            spi(top, floor=self.tau, dim=self.head.dim, noise_multiplier=self.z_train)
            for top in self._spectra
        ]
        return {k: min(values[k] for values in per_metric) for k in per_metric[0]}

    def _metric_update(self, sketch: SketchAccumulator) -> None:
        """Release the sketch, estimate U, and adopt it if the PTR gate passes."""
        release = release_sketch(sketch, noise_multiplier=self.z_pmu, rng=self.rng)
        try:
            estimate = estimate_subspace(release, self.rank, self.lambda_ptr)
        except ValueError as err:  # e.g. a numerically rank-deficient lift: nothing to adopt
            log(WARNING, "subspace-dp round %d: PMU kept the metric: %s", self._round, err)
            self._stats["subspace-pmu-adopted"] = 0.0
            return
        if estimate.adopt:
            self.metric = self._metric_on(estimate.basis)
            self._spectra.append(self.metric.tau + self.metric.lam)
        self._stats.update(
            {
                "subspace-pmu-adopted": float(estimate.adopt),
                "subspace-pmu-gap": estimate.gap,
                "subspace-pmu-gap-threshold": estimate.gap_threshold,
                "subspace-pmu-kth-eigenvalue": estimate.kth_eigenvalue,
                "subspace-pmu-lift-threshold": estimate.lift_threshold,
            }
        )
        log(
            INFO,
            "subspace-dp round %d: PMU %s (gap %.3g vs %.3g, theta_k %.3g vs %.3g)",
            self._round,
            "adopted a new subspace" if estimate.adopt else "kept the metric",
            estimate.gap,
            estimate.gap_threshold,
            estimate.kth_eigenvalue,
            estimate.lift_threshold,
        )

    def round_metrics(self, records: list, centred_bits: float | None = None) -> dict[str, float]:
        """The clip norm, P-norm statistics and, in PMU rounds, the gate's numbers."""
        stats, self._stats = self._stats, {}
        return {"dp-clip-norm": self.clip_norm, **stats}

    # -- checkpoint (strategies.runtime.checkpoint) ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """DP-FedAvg's state, the split of z, the metric in use and the spectra of every
        metric used (SPI); the public samples are rebuilt by the app."""
        return {
            **super().state_dict(),
            "z-train": self.z_train,
            "z-pmu": self.z_pmu,
            "z-noise": self.z_noise,
            "metric": self.metric,
            "spectra": self._spectra,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self.z_train, self.z_pmu, self.z_noise = state["z-train"], state["z-pmu"], state["z-noise"]
        self.metric, self._spectra = state["metric"], state["spectra"]

    def summary(self) -> None:
        """Log the subspace settings, then DP-FedAvg's summary."""
        log(
            INFO,
            "\t├──> Subspace-DP: k = %d, tau = %g, trace B = %g, sketch s = %d, PMU every %d "
            "rounds (reserve %g, z_pmu %.4g), lambda_ptr %g, z_train %.4g, allocation %s, "
            "quantization %s",
            self.rank,
            self.tau,
            self.trace_budget,
            self.sketch_dim,
            self.pmu_every,
            self.pmu_reserve,
            self.z_pmu,
            self.lambda_ptr,
            self.z_train,
            self.allocation,
            f"{self.quantize_bits} bits (z_top {self.z_noise:.4g})"
            if self.quantize_bits
            else "off",
        )
        super().summary()


@dataclass(frozen=True)
class SubspaceSettings(Settings):
    """Geometry-aligned subspace DP's run-config keys (``subspace.*``; the task's
    ``subspace.warm-start`` and ``subspace.head-only`` are the task's own)."""

    PREFIX: ClassVar[str] = "subspace"
    rank: int = setting(
        32,
        "Subspace-DP: k, directions of the metric P = U diag(lambda) U^T + tau I.",
        low=1,
    )
    tau: float = setting(
        0.8,
        "Subspace-DP: tau, the metric's floor (its eigenvalue off U).",
        low=0.0,
        low_open=True,
    )
    trace_budget: float = setting(
        25.0,
        "Subspace-DP: B = Tr(diag(lambda)), split evenly over the k directions.",
        low=0.0,
    )
    sketch_dim: int = setting(
        256,
        "Subspace-DP: s > k, JL sketch dimension of Private Metric Updates (the "
        "server holds a d x s sketch).",
        low=2,
    )
    pmu_every: int = setting(
        40,
        "Subspace-DP: rounds between Private Metric Updates (rounds 1, 1 + every, ...).",
        low=1,
    )
    lambda_ptr: float = setting(
        1.0,
        "Subspace-DP: PTR gate factor; a new subspace is adopted when its eigengap "
        "and k-th eigenvalue exceed this many noise spectral norms.",
        low=0.0,
    )
    init: str = setting(
        "isotropic",
        "Subspace-DP: the metric before the first adopted PMU: `isotropic` (P = tau I) "
        "or `public` (top-k subspace of per-example gradients on the public warm-start "
        "split; no privacy cost).",
        choices=("isotropic", "public"),
    )
    pmu_budget_reserve: float = setting(
        0.15,
        "Subspace-DP: share of the noise budget (zCDP rho) spent on PMU sketches (0: "
        "no PMU, P = tau I).",
        low=0.0,
        high=1.0,
        high_open=True,
    )
    allocation: str = setting(
        "uniform",
        "Subspace-DP: how the trace budget is split over U's directions: `uniform` "
        "(B/k), `water-filling` (Theorem 5, from the public split's gradient "
        "energies) or `fairness` (Theorem 9: minimise the largest group distortion; "
        "needs `data.groups`).",
        choices=("uniform", "water-filling", "fairness"),
    )
    quantize_bits: int = setting(
        0,
        "Subspace-DP: quantize each clipped update to this many bits per coordinate "
        "in the metric's whitened coordinates, with a Gaussian top-up (0: off; "
        "2..16).",
        low=0,
        high=16,
    )

    @staticmethod
    def check(choice: Choice) -> None:
        """What subspace-dp needs: s > k, public data for a public basis or allocation,
        codes of at least 2 bits that a top-up can make Gaussian, server-side noise."""
        if choice.privacy != "subspace-dp":
            return
        sub, dp = choice.part(SubspaceSettings), choice.part(DPSettings)
        rank, sketch = sub.rank, sub.sketch_dim
        if rank >= sketch:
            raise SettingsError(
                f"'subspace.rank' = {rank} must be below 'subspace.sketch-dim' = {sketch} "
                "(PMU takes the top-k eigenpairs of an s x s sketch and tests the gap to the "
                "next)"
            )
        for name, default in (("init", "isotropic"), ("allocation", "uniform")):
            key, value = SubspaceSettings.key(name), getattr(sub, name)
            if value != default and choice.warm_start == 0:
                raise SettingsError(
                    f"{key!r} = {value!r} needs public data: set 'subspace.warm-start' > 0 "
                    "(a vision task's public split of the held-out set), or "
                    f"{key!r} = {default!r}"
                )
        bits = sub.quantize_bits
        if bits == 1:
            raise SettingsError(
                "'subspace.quantize-bits' = 1 cannot code a coordinate of a clipped update "
                "(the dithered codes take at least three values); valid values: 0 (off) or "
                "2..16"
            )
        if bits and dp.noise_multiplier:  # calibrated z: checked when calibrated
            rounds, every = choice.num_rounds, sub.pmu_every
            z_train, _ = pmu_noise_multiplier(
                dp.noise_multiplier,
                sub.pmu_budget_reserve,
                rounds,
                pmu_rounds(rounds, every),
            )
            clip = dp.clip_norm
            try:
                topup_noise_multiplier(
                    z_train,
                    clip_norm=clip,
                    step=step_for_bits(clip, bits),
                    num_clients=dp.num_sampled_clients,
                )
            except ValueError as err:
                raise SettingsError(f"'subspace.quantize-bits' = {bits}: {err}") from None
        if dp.noise_site != "server":
            raise SettingsError(
                "'privacy' = 'subspace-dp' clips in the P-norm and adds elliptical noise on "
                "the server (clients would need U, d x k, every round); set 'dp.noise-site' "
                "= 'server'"
            )
