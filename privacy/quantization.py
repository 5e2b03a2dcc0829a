"""Anisotropic quantization with a Gaussian top-up (Subspace-DP-FL).

Subspace-DP-FL's ``mechanisms/quantization.py`` is "anisotropic quantization + Gaussian
top-up". The metric ``P = U diag(λ) Uᵀ + τ I`` and the mechanism it serves (clip each update to
``‖x‖_P ≤ C``, add ``N(0, σ²C² P⁻¹)`` to the sum) are in ``privacy.subspace``.

**Quantizing along the metric.** A clipped update x is whitened, ``y = P^½ x``, so
``‖y‖₂ = ‖x‖_P ≤ C`` and every coordinate ``|y_j| ≤ C``. The whitened vector is
quantized on the grid ``Δ·ℤ`` with *subtractive dither*: ``u ~ Uniform[−Δ/2, Δ/2)^d``
comes from a Generator that both sides rebuild from a shared seed, the client sends
the integer codes ``q = round((y + u)/Δ)`` and the server decodes

    ŷ = Δ·q − u,        x̂ = P^(-½) ŷ.

Design notes: ``docs/notes.md``, ``privacy.quantization``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from privacy.subspace import SubspaceMetric

MIN_BITS = 2
"""b = 1 cannot hold the three codes −1, 0, 1 that every step produces."""
MAX_BITS = 32
"""Codes are stored in at most int32."""

# Relative slack for ``ceil``: C/Δ at Δ = step_for_bits is M − 1/2 up to rounding. Safe,
# since codes overflow only when t + 1/2 exceeds L by 1/2 (a margin ≫ L·1e-12 for L < 2³¹).
_CEIL_SLACK = 1e-12
# Relative tolerance on ‖x‖_P ≤ C (float error of clipping); within it, x is scaled to C.
_NORM_TOL = 1e-9


def _check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return float(value)


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or int(bits) != bits or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(
            f"bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {bits!r} (every step "
            "produces the three codes -1, 0, 1, which need 2 bits)"
        )
    return int(bits)


def max_code(clip_norm: float, step: float) -> int:
    """L = ceil(C/Δ + 1/2): the largest |code| of any input with ‖x‖_P ≤ C."""
    t = _check_positive("clip_norm", clip_norm) / _check_positive("step", step)
    return math.ceil((t + 0.5) * (1.0 - _CEIL_SLACK))


def bits_for_step(clip_norm: float, step: float) -> int:
    """ceil(log2(2L + 1)): the bits per coordinate that the codes of step Δ need."""
    return (2 * max_code(clip_norm, step)).bit_length()  # = ceil(log2(2L + 1)), 2L+1 odd


def step_for_bits(clip_norm: float, bits: int) -> float:
    """Δ = 2C/(2^b − 3): the smallest step whose codes fit in b bits (module doc)."""
    return 2.0 * _check_positive("clip_norm", clip_norm) / (2.0 ** _check_bits(bits) - 3.0)


def code_dtype(bits: int) -> np.dtype:
    """The smallest numpy signed integer dtype that holds b-bit codes."""
    bits = _check_bits(bits)
    return np.dtype(np.int8 if bits <= 8 else np.int16 if bits <= 16 else np.int32)


def draw_dither(shape: tuple[int, ...], step: float, rng: np.random.Generator) -> np.ndarray:
    """u ~ Uniform[−Δ/2, Δ/2) of the given shape (float64), from a shared-seed Generator."""
    half = 0.5 * _check_positive("step", step)
    return rng.uniform(-half, half, size=shape)


def quantize(white: np.ndarray, dither: np.ndarray, step: float, bits: int) -> np.ndarray:
    """Codes ``round((y + u)/Δ)`` in ``code_dtype``; raises if one overflows b bits.

    The check cannot fire for ``‖y‖₂ ≤ C`` with ``Δ ≥ step_for_bits(C, b)``: it guards
    the invariant, not the caller's input.
    """
    codes = np.rint((np.asarray(white, np.float64) + dither) / step)
    limit = 2 ** (_check_bits(bits) - 1) - 1
    peak = float(np.max(np.abs(codes))) if codes.size else 0.0
    if not peak <= limit:
        raise AssertionError(f"code {peak:.0f} overflows {bits} bits (|code| <= {limit})")
    return codes.astype(code_dtype(bits))


def dequantize(codes: np.ndarray, dither: np.ndarray, step: float) -> np.ndarray:
    """ŷ = Δ·q − u (float64)."""
    return step * np.asarray(codes, dtype=np.float64) - dither


def topup_noise_multiplier(
    noise_multiplier: float, *, clip_norm: float, step: float, num_clients: int
) -> float:
    """z_top = √(σ² − mΔ²/(12C²)): the Gaussian top-up's noise multiplier.

    The server adds ``N(0, (C·z_top)²·P⁻¹)`` to the sum of m decoded updates; with the m
    quantization errors the total covariance is ``σ²C²·P⁻¹``. Charge only z_top.

    Raises
    ------
    ValueError
        If ``σ²C² ≤ mΔ²/12``: the quantization noise alone reaches the mechanism's.
    """
    sigma = _check_positive("noise_multiplier", noise_multiplier)
    clip = _check_positive("clip_norm", clip_norm)
    step = _check_positive("step", step)
    if isinstance(num_clients, bool) or int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    target = (sigma * clip) ** 2
    quantization = num_clients * step**2 / 12.0
    if not target > quantization:
        raise ValueError(
            f"no valid Gaussian top-up: the quantization noise of {num_clients} clients, "
            f"m*step^2/12 = {quantization:.6g} (step {step:.6g} = "
            f"{bits_for_step(clip, step)} bits at clip_norm {clip:.6g}), reaches the "
            f"mechanism's sigma^2 C^2 = {target:.6g} (sigma {sigma:.6g}); use more bits, "
            "fewer clients per sum or a larger noise_multiplier"
        )
    return math.sqrt(sigma**2 - quantization / clip**2)


@dataclass(frozen=True)
class AnisotropicQuantizer:
    """b-bit subtractive-dither quantizer of P-norm-clipped updates, in whitened coordinates.

    ``encode`` and ``decode`` take Generators rebuilt from the same seed (e.g.
    ``make_generator(seed, round, client)``) so that both draw the same dither. Both accept
    one update (d,) or a batch of n updates as columns (d, n).
    """

    metric: SubspaceMetric
    """P, shared by clients and server."""
    clip_norm: float
    """C, the P-norm bound of the updates to encode."""
    bits: int
    """b, bits per coordinate (2..32)."""

    def __post_init__(self) -> None:
        if not isinstance(self.metric, SubspaceMetric):
            raise ValueError(f"metric must be a SubspaceMetric, got {type(self.metric).__name__}")
        object.__setattr__(self, "clip_norm", _check_positive("clip_norm", self.clip_norm))
        object.__setattr__(self, "bits", _check_bits(self.bits))

    @property
    def step(self) -> float:
        """Δ = step_for_bits(C, b) (derived)."""
        return step_for_bits(self.clip_norm, self.bits)

    @property
    def error_variance(self) -> float:
        """Δ²/12, the variance of the whitened error per coordinate (derived)."""
        return self.step**2 / 12.0

    def bits_per_update(self, d: int) -> int:
        """d·b bits per update of dimension d (the shared-seed dither costs none)."""
        if isinstance(d, bool) or int(d) != d or d < 1:
            raise ValueError(f"d must be an integer >= 1, got {d!r}")
        return int(d) * self.bits

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Codes of x (``‖x‖_P ≤ C`` per column), same shape, in ``code_dtype``."""
        values = self._check_shape("x", np.asarray(x, dtype=np.float64))
        if not np.all(np.isfinite(values)):
            raise ValueError("x must be finite")
        white = self.metric.power(values, 0.5)
        norms = np.linalg.norm(white, axis=0)
        worst = float(np.max(norms)) if norms.size else 0.0
        if worst > self.clip_norm * (1.0 + _NORM_TOL):
            raise ValueError(
                f"x has P-norm {worst:.6g} > clip_norm {self.clip_norm:.6g}: clip it first"
            )
        # Within the tolerance, put the update back on the ball (|y_j| <= C exactly).
        white = white * np.minimum(1.0, self.clip_norm / np.maximum(norms, 1e-300))
        dither = draw_dither(white.shape, self.step, rng)
        return quantize(white, dither, self.step, self.bits)

    def decode(self, codes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """x̂ = P^(-½)(Δ·q − u) (float64), u redrawn from ``rng`` (same seed as encode)."""
        values = self._check_shape("codes", np.asarray(codes))
        if not np.issubdtype(values.dtype, np.integer):
            raise ValueError(f"codes must be integers, got dtype {values.dtype}")
        limit = 2 ** (self.bits - 1) - 1
        if values.size and int(np.max(np.abs(values.astype(np.int64)))) > limit:
            raise ValueError(f"codes must lie in [-{limit}, {limit}] for {self.bits} bits")
        dither = draw_dither(values.shape, self.step, rng)
        return self.metric.power(dequantize(values, dither, self.step), -0.5)

    def topup_noise_multiplier(self, noise_multiplier: float, *, num_clients: int) -> float:
        """``topup_noise_multiplier`` at this quantizer's C and Δ."""
        return topup_noise_multiplier(
            noise_multiplier, clip_norm=self.clip_norm, step=self.step, num_clients=num_clients
        )

    def _check_shape(self, name: str, values: np.ndarray) -> np.ndarray:
        if values.ndim not in (1, 2) or values.shape[0] != self.metric.dim:
            raise ValueError(
                f"{name} must have shape (d,) or (d, n) with d = {self.metric.dim}, "
                f"got {values.shape}"
            )
        return values
