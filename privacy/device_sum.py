"""DP-FedAvg's server aggregate on the training device: clip each update to L2 norm C,
sum, add N(0, (zC)²), in float32 torch on ``device`` (a GPU when clients train on one).

The same mechanism as the NumPy path (``GaussianMechanism.clip`` and ``noise_sum``): the
noise is drawn from the same secret generator, the same draws in the same order
(``gaussian_noise_like``), so the accounting is unchanged; only the arithmetic moves to
float32 on the device. Each clipped update's norm is checked in float64 after rounding
to float32 and the scale shrunk until it is <= C, as the NumPy path checks its own, so
the sensitivity the ledger charges holds. Why and the measurements: docs/engine.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from privacy.mechanisms import (
    GaussianMechanism,
    NonFiniteUpdateError,
    gaussian_noise_like,
    is_released,
)

_CLIP_SLACK = 1e-6  # relative: float32 rounding of the scaled values (2**-24 each) and more
_MAX_SHRINK_STEPS = 64


def _norm64(tensors: Sequence[torch.Tensor]) -> float:
    """The global L2 norm, accumulated in float64 (float32 squares cannot overflow it)."""
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device if tensors else None)
    return float(torch.sqrt(sum((t.double().square().sum() for t in tensors), total)))


def clip_on_device(
    update: Sequence[np.ndarray], clip_norm: float, device: torch.device
) -> tuple[list[torch.Tensor], float]:
    """One update as float32 tensors on ``device`` scaled by min(1, C/‖update‖₂) (integer
    arrays, not released, as zeros), with its norm before clipping; the float32 result's
    float64 norm is <= C."""
    tensors = [
        torch.as_tensor(np.asarray(a), device=device).to(torch.float32)
        if is_released(a)
        else torch.zeros(np.shape(a), dtype=torch.float32, device=device)
        for a in update
    ]
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise NonFiniteUpdateError("the update holds NaN or Inf")
    norm = _norm64(tensors)
    if norm <= clip_norm:
        return tensors, norm
    scale, shrink = clip_norm / norm * (1 - _CLIP_SLACK), _CLIP_SLACK
    for _ in range(_MAX_SHRINK_STEPS):
        scaled = [t * scale for t in tensors]
        if _norm64(scaled) <= clip_norm:
            return scaled, norm
        scale, shrink = scale * (1 - shrink), shrink * 2
    raise ArithmeticError("could not scale the update within the clip norm")  # unreachable


def noisy_sum_on_device(
    deltas: Sequence[Sequence[np.ndarray]],
    mech: GaussianMechanism,
    rng: np.random.Generator,
    template: Sequence[np.ndarray],
    device: str | torch.device,
) -> list[np.ndarray]:
    """Σ clip(Δ) + N(0, (zC)²) computed in float32 on ``device``; float64 NumPy arrays
    shaped like ``template`` (what ``ServerNoise.noisy_sum`` returns)."""
    device = torch.device(device)
    total = [torch.zeros(np.shape(a), dtype=torch.float32, device=device) for a in template]
    for delta in deltas:
        clipped, _ = clip_on_device(delta, mech.clip_norm, device)
        for t, c in zip(total, clipped, strict=True):
            t += c
    noise = gaussian_noise_like(template, std=mech.sum_noise_std, rng=rng)
    for t, n in zip(total, noise, strict=True):
        t += torch.from_numpy(n).to(device=device, dtype=torch.float32)
    return [t.cpu().numpy().astype(np.float64) for t in total]
