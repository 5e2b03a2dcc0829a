"""Subspace-DP's sum of one round's updates: each clipped in the P-norm, sketched for
PMU from the released delta, and optionally quantized with a shared dither and
re-clipped (sensitivity C whatever the decoding did)."""

from __future__ import annotations

import numpy as np

from privacy.mechanisms import NonFiniteUpdateError, make_generator
from privacy.quantization import AnisotropicQuantizer
from privacy.subspace import EllipticalGaussianMechanism, SketchAccumulator, flatten, unflatten
from protocol.records import InvalidReply

DITHER_STREAM = 0xD7  # the shared dither of each (round, client) quantization


def clipped_sum(
    deltas: list[list[np.ndarray]],
    template: list[np.ndarray],
    mech: EllipticalGaussianMechanism,
    *,
    quantizer: AnisotropicQuantizer | None,
    sketch: SketchAccumulator | None,
    seed: int,
    server_round: int,
) -> tuple[list[np.ndarray], dict[str, float]]:
    """The sum of the clipped (and quantized) ``deltas``, and the round's statistics
    (rank, code length, clip fraction, mean P-norm, quantization error)."""
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
            dither = (seed, server_round, DITHER_STREAM, index)
            arrays, error = quantized(quantizer, mech, arrays, dither)
            errors.append(error)
        for t, a in zip(total, arrays, strict=True):
            t += a
    stats = {"subspace-rank": float(mech.metric.rank)}
    if quantizer is not None:
        stats["subspace-quant-bits-per-update"] = float(quantizer.bits_per_update(mech.metric.dim))
    if deltas:  # none to average over: an empty Poisson cohort, or every client failed
        stats["subspace-clip-fraction"] = clipped / len(deltas)
        stats["subspace-mean-pnorm"] = float(np.mean(norms))
        if errors:
            stats["subspace-quant-error"] = float(np.mean(errors))
    return total, stats


def quantized(
    quantizer: AnisotropicQuantizer,
    mech: EllipticalGaussianMechanism,
    arrays: list[np.ndarray],
    dither: tuple[int, ...],
) -> tuple[list[np.ndarray], float]:
    """Encode and decode one clipped update with its shared dither (the generator of
    ``dither``'s entropy); re-clip the result. Returns it and ``‖x̂ − x‖²``."""
    x = flatten(arrays)
    codes = quantizer.encode(x, make_generator(*dither))
    decoded = quantizer.decode(codes, make_generator(*dither))
    error = float(np.sum((decoded - x) ** 2))
    return mech.clip(unflatten(decoded, arrays)).arrays, error
