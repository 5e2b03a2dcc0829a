"""Subspace-DP's metric P = U diag(λ) U^T + τI: its first basis, the split of the trace
B over U, and the Private Metric Update (PMU) that may replace U from a noised sketch."""

from __future__ import annotations

from logging import INFO, WARNING

import numpy as np
from flwr.common.logger import log

from privacy.allocation import allocate
from privacy.mechanisms import make_generator
from privacy.subspace import (
    SketchAccumulator,
    SubspaceEstimate,
    estimate_subspace,
    release_sketch,
    sketch_matrix,
    uniform_allocation,
)
from strategies.errors import StopTraining

ALLOCATIONS = ("uniform", "water-filling", "fairness")
INITS = ("isotropic", "public")  # the metric before the first adopted PMU
POOLED = "all"  # the key of the pooled public samples in SubspaceDP.public_samples
_SKETCH_STREAM = 0x5C  # the public JL matrix of each PMU round
# Largest PMU sketch (d x s float64) the server builds: 4 GiB.
MAX_SKETCH_BYTES = 4 * 2**30


def check_sketch_size(dim: int, sketch_dim: int) -> None:
    """Stop before any work when the d x s PMU sketch would exceed MAX_SKETCH_BYTES."""
    if dim * sketch_dim * 8 > MAX_SKETCH_BYTES:
        raise StopTraining(
            f"the PMU sketch would hold d x s = {dim} x {sketch_dim} float64 "
            f"values (> {MAX_SKETCH_BYTES / 2**30:g} GiB); lower 'subspace.sketch-dim', "
            "train the head only ('subspace.head-only' = true) or set "
            "'subspace.pmu-budget-reserve' = 0"
        )


def check_initial_basis(basis: np.ndarray, dim: int, rank: int) -> None:
    """The public basis must be d x k for the released arrays."""
    if basis.shape != (dim, rank):
        raise StopTraining(
            f"the public initial basis has shape {basis.shape}, the released "
            f"arrays need ({dim}, {rank})"
        )


def trace_allocation(
    allocation: str,
    basis: np.ndarray,
    *,
    rank: int,
    tau: float,
    budget: float,
    public_samples: dict[str, np.ndarray] | None,
) -> np.ndarray:
    """λ over U's directions: uniform, water-filling or the fairness program (the last
    two from the public samples, POOLED and per group)."""
    if allocation == "uniform":
        return uniform_allocation(rank, budget)
    if not public_samples or POOLED not in public_samples:
        raise StopTraining(
            f"'subspace.allocation' = {allocation!r} needs the public samples, "
            "which the app did not provide"
        )
    groups = {g: x for g, x in public_samples.items() if g != POOLED}
    lam, fair = allocate(allocation, basis, public_samples[POOLED], groups, tau=tau, budget=budget)
    if fair is not None:
        log(
            INFO,
            "subspace-dp: fairness allocation, group distortions %s (max %.4g, gap %.2g)",
            ", ".join(f"{g} {d:.4g}" for g, d in zip(groups, fair.distortions, strict=True)),
            fair.max_distortion,
            fair.gap,
        )
    return lam


def pmu_sketch(dim: int, sketch_dim: int, seed: int, server_round: int) -> SketchAccumulator:
    """An empty sketch on this round's public d x s JL matrix (from the run seed)."""
    rng = make_generator(seed, server_round, _SKETCH_STREAM)
    return SketchAccumulator(sketch_matrix(dim, sketch_dim, rng))


def pmu_estimate(
    sketch: SketchAccumulator,
    *,
    noise_multiplier: float,
    rng: np.random.Generator,
    rank: int,
    lambda_ptr: float,
    server_round: int,
) -> SubspaceEstimate | None:
    """Release the sketch with noise and estimate U from it; None when the estimate is
    unusable (e.g. a numerically rank-deficient lift: nothing to adopt)."""
    release = release_sketch(sketch, noise_multiplier=noise_multiplier, rng=rng)
    try:
        return estimate_subspace(release, rank, lambda_ptr)
    except ValueError as err:
        log(WARNING, "subspace-dp round %d: PMU kept the metric: %s", server_round, err)
        return None


def pmu_report(estimate: SubspaceEstimate, server_round: int) -> dict[str, float]:
    """Log the PTR gate's decision; its numbers as round metrics."""
    log(
        INFO,
        "subspace-dp round %d: PMU %s (gap %.3g vs %.3g, theta_k %.3g vs %.3g)",
        server_round,
        "adopted a new subspace" if estimate.adopt else "kept the metric",
        estimate.gap,
        estimate.gap_threshold,
        estimate.kth_eigenvalue,
        estimate.lift_threshold,
    )
    return {
        "subspace-pmu-adopted": float(estimate.adopt),
        "subspace-pmu-gap": estimate.gap,
        "subspace-pmu-gap-threshold": estimate.gap_threshold,
        "subspace-pmu-kth-eigenvalue": estimate.kth_eigenvalue,
        "subspace-pmu-lift-threshold": estimate.lift_threshold,
    }
