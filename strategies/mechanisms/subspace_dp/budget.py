"""Subspace-DP's noise budget: the split of z between the updates and the PMU sketches,
the quantization's Gaussian top-up, and what each release's ledger note says."""

from __future__ import annotations

import math

from privacy.quantization import step_for_bits, topup_noise_multiplier
from privacy.subspace import pmu_noise_multiplier


def pmu_rounds(num_rounds: int, every: int) -> int:
    """How many of rounds 1..T run PMU (rounds 1, 1 + every, 1 + 2·every, ...)."""
    return math.ceil(num_rounds / every)


def noise_split(
    noise_multiplier: float,
    *,
    reserve: float,
    rounds: int,
    every: int,
    clip_norm: float,
    quantize_bits: int,
    num_clients: int,
) -> tuple[float, float, float]:
    """(z_train, z_pmu, z_noise) of the budget z: z/√(1 − r), the sketches' share, and
    the Gaussian noise actually added (z_train, or its top-up when quantized).

    Raises
    ------
    ValueError
        If the quantization leaves no room for a Gaussian top-up.
    """
    z_train, z_pmu = pmu_noise_multiplier(
        noise_multiplier, reserve, rounds, pmu_rounds(rounds, every)
    )
    if not quantize_bits:
        return z_train, z_pmu, z_train
    try:
        z_noise = topup_noise_multiplier(
            z_train,
            clip_norm=clip_norm,
            step=step_for_bits(clip_norm, quantize_bits),
            num_clients=num_clients,
        )
    except ValueError as err:
        raise ValueError(f"'subspace.quantize-bits' = {quantize_bits}: {err}") from None
    return z_train, z_pmu, z_noise


def release_note(
    *,
    clip_norm: float,
    tau: float,
    rank: int,
    z_train: float,
    z_noise: float,
    quantize_bits: int,
    pmu_z: tuple[float, float] | None,
) -> str:
    """The ledger note of one round's release; ``pmu_z`` = (z_pmu, combined z) in PMU
    rounds."""
    note = (
        f"P-norm clip C = {clip_norm:g}, elliptical noise N(0, z^2 C^2 P^-1) with "
        f"z = {z_noise:.4f}, metric rank {rank} (tau {tau:g}): whitened by "
        "P^1/2 a Gaussian mechanism with L2 sensitivity C"
    )
    if quantize_bits:
        note += (
            f"; updates quantized to {quantize_bits} bits and re-clipped, Gaussian "
            f"top-up z_top = {z_noise:.4f} of z_train = {z_train:.4f} (only the "
            "Gaussian part is charged)"
        )
    if pmu_z is not None:
        z_pmu, z = pmu_z
        note += (
            f"; PMU sketch (sensitivity sqrt 2, z_pmu = {z_pmu:.4f}) of the same sample, "
            f"composed with the update as one Gaussian with z = {z:.4f}; the PTR gate reads "
            "only the released sketch (post-processing)"
        )
    return note
