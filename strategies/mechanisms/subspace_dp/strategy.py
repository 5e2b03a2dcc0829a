"""Subspace-DP-FL around any strategy: geometry-aligned DP-FedAvg (the server wrapper).

The pieces it composes live beside it: the metric and PMU (``geometry``), the budget
split and ledger notes (``budget``), the P-norm clipped sum (``aggregate``) and the
run-config keys (``settings``). Design notes: ``docs/notes.md``,
``strategies.mechanisms.subspace_dp``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from privacy.accounting import Release
from privacy.certificates import spi
from privacy.quantization import AnisotropicQuantizer
from privacy.subspace import (
    EllipticalGaussianMechanism,
    SketchAccumulator,
    SubspaceMetric,
    combined_noise_multiplier,
)
from strategies.errors import StopTraining
from strategies.mechanisms.dp_fedavg import DPFedAvgFixed
from strategies.mechanisms.subspace_dp import geometry
from strategies.mechanisms.subspace_dp.aggregate import clipped_sum
from strategies.mechanisms.subspace_dp.budget import noise_split, release_note


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
    pmu_budget_reserve : float
        r in [0, 1): the zCDP budget's share spent on PMU (0: no PMU, P = τI).
    seed : int
        Run seed: the public sketch matrices derive from it.
    init, initial_basis : str, numpy.ndarray, optional
        "public": the app sets U (d×k, public data, free) before round 1; else P = τI until PMU.
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
        pmu_budget_reserve: float,
        seed: int,
        init: str = "isotropic",
        initial_basis: np.ndarray | None = None,
        allocation: str = "uniform",
        quantize_bits: int = 0,
        **kwargs,
    ) -> None:
        if not 1 <= rank < sketch_dim:
            raise ValueError(f"need 1 <= rank k = {rank} < sketch_dim s = {sketch_dim}")
        if allocation not in geometry.ALLOCATIONS:
            allowed = geometry.ALLOCATIONS
            raise ValueError(f"allocation must be one of {allowed}, got {allocation!r}")
        self.rank, self.tau, self.trace_budget = rank, tau, trace_budget
        self.sketch_dim, self.pmu_every, self.lambda_ptr = sketch_dim, pmu_every, lambda_ptr
        if init not in geometry.INITS:
            raise ValueError(f"init must be one of {geometry.INITS}, got {init!r}")
        self.pmu_budget_reserve, self.seed = pmu_budget_reserve, seed
        self.init, self.initial_basis = init, initial_basis
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
        """(z_train, z_pmu, z_noise) of the budget z (:func:`budget.noise_split`)."""
        return noise_split(
            noise_multiplier,
            reserve=self.pmu_budget_reserve,
            rounds=self.planned_rounds,
            every=self.pmu_every,
            clip_norm=self.clip_norm,
            quantize_bits=self.quantize_bits,
            num_clients=self.num_sampled_clients,
        )

    def after_calibration(self) -> None:
        """Split the budget z between training and PMU (and the quantization top-up)."""
        assert self.noise_multiplier is not None
        try:
            self.z_train, self.z_pmu, self.z_noise = self.noise_split(self.noise_multiplier)
        except ValueError as err:
            raise StopTraining(str(err)) from None

    def is_pmu_round(self, server_round: int) -> bool:
        """PMU runs in rounds 1, 1 + every, ... when a budget share is reserved for it."""
        return self.pmu_budget_reserve > 0 and (server_round - 1) % self.pmu_every == 0

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
        note = release_note(
            clip_norm=self.clip_norm,
            tau=self.tau,
            rank=rank,
            z_train=self.z_train,
            z_noise=self.z_noise,
            quantize_bits=self.quantize_bits,
            pmu_z=(self.z_pmu, z) if pmu else None,
        )
        if not pmu:
            return [Release(**{**update.__dict__, "note": note})]
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
            if self.is_pmu_round(1):
                geometry.check_sketch_size(dim, self.sketch_dim)
            self.metric = self._initial_metric(dim)
            self._spectra.append(self.metric.tau + self.metric.lam)
        self._round = server_round
        return super().configure_train(server_round, arrays, config, grid)

    def _initial_metric(self, dim: int) -> SubspaceMetric:
        if self.initial_basis is None:
            return SubspaceMetric.isotropic(dim, self.tau)
        geometry.check_initial_basis(self.initial_basis, dim, self.rank)
        return self._metric_on(self.initial_basis)

    def _metric_on(self, basis: np.ndarray) -> SubspaceMetric:
        """The metric on U = ``basis`` with this run's trace allocation."""
        lam = geometry.trace_allocation(
            self.allocation,
            basis,
            rank=self.rank,
            tau=self.tau,
            budget=self.trace_budget,
            public_samples=self.public_samples,
        )
        return SubspaceMetric(basis=basis, lam=lam, tau=self.tau)

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
        sketch = (
            geometry.pmu_sketch(self.metric.dim, self.sketch_dim, self.seed, self._round)
            if self.is_pmu_round(self._round)
            else None
        )
        total, self._stats = clipped_sum(
            deltas,
            template,
            mech,
            quantizer=quantizer,
            sketch=sketch,
            seed=self.seed,
            server_round=self._round,
        )
        noised = mech.noise_sum(total, rng=self.rng)
        if sketch is not None:
            self._metric_update(sketch)
        return [n / m for n in noised]

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
        estimate = geometry.pmu_estimate(
            sketch,
            noise_multiplier=self.z_pmu,
            rng=self.rng,
            rank=self.rank,
            lambda_ptr=self.lambda_ptr,
            server_round=self._round,
        )
        if estimate is None:
            self._stats["subspace-pmu-adopted"] = 0.0
            return
        if estimate.adopt:
            self.metric = self._metric_on(estimate.basis)
            self._spectra.append(self.metric.tau + self.metric.lam)
        self._stats.update(geometry.pmu_report(estimate, self._round))

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
            self.pmu_budget_reserve,
            self.z_pmu,
            self.lambda_ptr,
            self.z_train,
            self.allocation,
            f"{self.quantize_bits} bits (z_top {self.z_noise:.4g})"
            if self.quantize_bits
            else "off",
        )
        super().summary()
