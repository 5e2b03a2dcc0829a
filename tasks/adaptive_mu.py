"""Adaptive proximal coefficient of SmartFedProx (the SmartFedProx study, sections 2.3 and 3).

Pure functions, no Flower: the client computes its effective mu from the base mu
the server sends, its historical divergence and the server's average divergence
(``compute_adaptive_mu``, section 3.2); after training it measures how far its
weights drifted from the global ones (``compute_model_divergence``, section 2.3)
and folds that into its history with an exponential moving average (section 3.3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

DIVERGENCE_DAMPING = 0.5  # divergence_factor = 1 + 0.5 * (ratio - 1)
DIVERGENCE_FACTOR_RANGE = (0.5, 2.0)  # the factor is clamped to this interval
EPOCH_SLOPE = 0.1  # epoch_factor = 1 + 0.1 * (local_epochs - 1)
RATIO_EPSILON = 1e-8  # ratio = historical / (global + 1e-8)
EMA_ALPHA = 0.3  # the SmartFedProx study's smoothing factor of the historical divergence


def clamp(value: float, low: float, high: float) -> float:
    """``value`` limited to ``[low, high]`` (the study's ``max(low, min(high, value))``)."""
    return max(low, min(high, value))


def divergence_factor(historical_divergence: float, global_avg_divergence: float) -> float:
    """Factor 1 of section 3.2: the dampened ratio of a client's to the average divergence.

    ``clamp(1 + 0.5 * (h / (g + 1e-8) - 1), 0.5, 2.0)`` when both ``h`` and ``g`` are
    positive, else 1.0 (no history yet: no adaptation).
    """
    if global_avg_divergence > 0 and historical_divergence > 0:
        ratio = historical_divergence / (global_avg_divergence + RATIO_EPSILON)
        return clamp(1.0 + DIVERGENCE_DAMPING * (ratio - 1.0), *DIVERGENCE_FACTOR_RANGE)
    return 1.0


def epoch_factor(local_epochs: int) -> float:
    """Factor 2 of section 3.2: ``1 + 0.1 * (local_epochs - 1)`` (more epochs, more drift)."""
    return 1.0 + EPOCH_SLOPE * (local_epochs - 1)


def adaptive_mu(
    *,
    base_mu: float,
    historical_divergence: float,
    global_avg_divergence: float,
    local_epochs: int,
    mu_min: float,
    mu_max: float,
) -> float:
    """The client's effective proximal coefficient (``compute_adaptive_mu``).

    ``clamp(base_mu * divergence_factor * epoch_factor, mu_min, mu_max)``.

    Parameters
    ----------
    base_mu : float
        The server's proximal coefficient (``proximal-mu``).
    historical_divergence : float
        The client's EMA of its past divergences (0.0 before its first round).
    global_avg_divergence : float
        The average historical divergence over the clients the server has heard from.
    local_epochs : int
        Local epochs of this round (at least 1).
    mu_min, mu_max : float
        Bounds of the result, ``mu_min <= mu_max``.

    Raises
    ------
    ValueError
        If ``mu_min > mu_max`` or ``local_epochs < 1``.
    """
    if mu_min > mu_max:
        raise ValueError(f"mu_min = {mu_min} must not exceed mu_max = {mu_max}")
    if local_epochs < 1:
        raise ValueError(f"local_epochs = {local_epochs} must be at least 1")
    factor = divergence_factor(historical_divergence, global_avg_divergence)
    return clamp(base_mu * factor * epoch_factor(local_epochs), mu_min, mu_max)


def ema(previous: float, value: float, alpha: float = EMA_ALPHA) -> float:
    """One step of the SmartFedProx study's historical-divergence EMA (section 3.3).

    ``alpha * value + (1 - alpha) * previous``; the history starts at 0.0.

    Raises
    ------
    ValueError
        If ``alpha`` is outside ``[0, 1]``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha = {alpha} must lie in [0, 1]")
    return alpha * value + (1.0 - alpha) * previous


def _squared_distance(
    local: np.ndarray | torch.Tensor, global_: np.ndarray | torch.Tensor
) -> float:
    if isinstance(local, torch.Tensor):
        with torch.no_grad():  # no autograd record of a parameter's copies
            other = torch.as_tensor(global_, device=local.device)
            diff = local.to(torch.float64) - other.to(torch.float64)
            return diff.square_().sum().item()
    diff = np.asarray(local, dtype=np.float64) - np.asarray(global_, dtype=np.float64)
    return float(np.dot(diff.ravel(), diff.ravel()))


def model_divergence(
    local: Sequence[np.ndarray | torch.Tensor], global_: Sequence[np.ndarray | torch.Tensor]
) -> float:
    """L2 distance of the local from the global weights (the SmartFedProx study, section 2.3).

    ``sqrt(sum_i ||w_local_i - w_global_i||^2)`` over paired tensors or arrays,
    accumulated in float64 (the study's ``compute_model_divergence``).

    Raises
    ------
    ValueError
        If the sequences differ in length or a pair differs in shape.
    """
    if len(local) != len(global_):
        raise ValueError(f"{len(local)} local tensors but {len(global_)} global tensors")
    total = 0.0
    for i, (w, g) in enumerate(zip(local, global_, strict=True)):
        if tuple(w.shape) != tuple(g.shape):
            raise ValueError(
                f"tensor {i}: local shape {tuple(w.shape)} != global {tuple(g.shape)}"
            )
        total += _squared_distance(w, g)
    return math.sqrt(total)
