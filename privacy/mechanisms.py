"""Two-phase privacy mechanisms on model updates (DP-FedAvg, McMahan et al. 2018).

A model update is a list of numpy arrays; clipping and norms act on the whole update
at once (all arrays together), as in McMahan et al. 2018, "Learning Differentially
Private Recurrent Language Models". As in pfl-research, a mechanism has two phases:
``clip`` bounds one client's contribution (its sensitivity) and ``noise_*`` perturbs
what is released. The same ``GaussianMechanism`` serves server-side noising
(N(0, (zC)²) once on the sum) and client-side noising (each of m clients adds
N(0, (zC)²/m), so the sum carries the same N(0, (zC)²)).

Design notes: ``docs/notes.md``, ``privacy.mechanisms``.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import dp_accounting

ArrayList = list[np.ndarray]

# Front-loaded DP for hierarchical FL (frontloaded-dp-hfl): the client modes, i.e. the ``privacy``
# values that run under ``strategy = hierarchical`` (privacy.frontloaded trains them,
# strategies.mechanisms.frontloaded_clients asks for them and keeps their ledger).
FRONT_LOADED_MODES = ("cg-ng", "cg-np", "cp-np")

# Relative slack applied when scaling an update down: float64 summation error of a
# norm is far below 1e-12 for any realistic model size, so every reasonable way of
# computing the clipped norm stays <= C. Casting to a narrower dtype is checked after.
_CLIP_SLACK = 1e-12
_MAX_SHRINK_STEPS = 64


class NonFiniteUpdateError(ValueError):
    """An update holds NaN/Inf, or its norm overflows float64."""


@dataclass(frozen=True)
class ClipResult:
    """The output of clipping one update.

    Attributes
    ----------
    arrays : list of numpy.ndarray
        The (possibly scaled) update, each array in its original floating dtype.
    norm : float
        The update's global norm before clipping.
    scale : float
        The factor applied (1.0 when the update was within the bound).
    clipped : bool
        Whether the norm exceeded the bound (``norm > clip_norm``).
    """

    arrays: ArrayList
    norm: float
    scale: float
    clipped: bool


# -- norms ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Float64Update:
    """One update in float64: its arrays, views of one buffer, and its largest |value|
    (``peak``, checked finite)."""

    arrays: ArrayList
    peak: float


def _float64_update(arrays: Sequence[np.ndarray]) -> _Float64Update:
    """``arrays`` copied once into one float64 buffer, after checking every value is
    finite. One buffer, not one array each: a small model's norm is mostly per-call
    overhead, and the peak and the finiteness check are then two calls, not four per
    array; the values, and each array's sum in the norms below, are unchanged."""
    arrays = [np.asarray(a) for a in arrays]
    flat = np.empty(sum(a.size for a in arrays), dtype=np.float64)
    views, start = [], 0
    for array in arrays:
        view = flat[start : start + array.size].reshape(array.shape)
        np.copyto(view, array, casting="unsafe")
        views.append(view)
        start += array.size
    high, low = (float(flat.max()), float(flat.min())) if flat.size else (0.0, 0.0)
    if not (math.isfinite(high) and math.isfinite(low)):  # NaN reaches both max and min
        _raise_non_finite(views)
    return _Float64Update(views, max(high, -low))


def _raise_non_finite(arrays64: Sequence[np.ndarray]) -> None:
    for index, values in enumerate(arrays64):
        finite = np.isfinite(values)
        if not finite.all():
            raise NonFiniteUpdateError(
                f"update array {index} (shape {values.shape}) holds "
                f"{int(finite.size - np.count_nonzero(finite))} non-finite value(s) "
                "(NaN or Inf); refusing to clip or release it"
            )


def _checked_norm(norm: float, kind: str, peak: float) -> float:
    if not math.isfinite(norm):
        raise NonFiniteUpdateError(
            f"the update's global {kind} norm overflows float64 (largest |value| = "
            f"{peak:g}); refusing to clip or release it"
        )
    return norm


def _scaled_sums(ufunc: np.ufunc, update: _Float64Update) -> Iterator[float]:
    """``sum(ufunc(a / peak))`` of each array ``a`` of ``update``, in one scratch buffer
    the size of the largest array: no d-sized temporary per norm (~25 % of DP-FedAvg's
    aggregate on large models), the same values and summation order as array by array."""
    scratch = np.empty(max((a.size for a in update.arrays), default=0), dtype=np.float64)
    for array in update.arrays:
        part = np.divide(array, update.peak, out=scratch[: array.size].reshape(array.shape))
        yield float(np.sum(ufunc(part, out=part)))


def _l2_norm64(update: _Float64Update) -> float:
    # Scaled by the largest |value| so that squaring cannot overflow (1e200 is finite).
    if update.peak == 0.0:
        return 0.0
    total = math.fsum(_scaled_sums(np.square, update))
    return _checked_norm(update.peak * math.sqrt(total), "L2", update.peak)


def _l1_norm64(update: _Float64Update) -> float:
    if update.peak == 0.0:
        return 0.0
    total = math.fsum(_scaled_sums(np.abs, update))
    return _checked_norm(update.peak * total, "L1", update.peak)


def _l2_norm64_plain(update: _Float64Update) -> float:
    """The textbook float64 norm (sqrt of the sum of squares), for the bound check."""
    with np.errstate(over="ignore"):
        return math.sqrt(math.fsum(float(np.sum(np.square(a))) for a in update.arrays))


def _l1_norm64_plain(update: _Float64Update) -> float:
    with np.errstate(over="ignore"):
        return math.fsum(float(np.sum(np.abs(a))) for a in update.arrays)


def global_l2_norm(arrays: Sequence[np.ndarray]) -> float:
    """L2 norm of a whole update (all arrays together), computed in float64.

    Raises
    ------
    NonFiniteUpdateError
        If a value is NaN/Inf or the norm overflows float64.
    """
    return _l2_norm64(_float64_update(arrays))


def global_l1_norm(arrays: Sequence[np.ndarray]) -> float:
    """L1 norm of a whole update (all arrays together), computed in float64.

    Raises
    ------
    NonFiniteUpdateError
        If a value is NaN/Inf or the norm overflows float64.
    """
    return _l1_norm64(_float64_update(arrays))


# -- clipping ---------------------------------------------------------------------
def _out_dtype(array: np.ndarray) -> np.dtype:
    return np.asarray(array).dtype


def is_released(array: np.ndarray) -> bool:
    """Whether an array of an update is released (clipped, noised): floating arrays
    only; integer (and boolean) arrays are not (module docstring)."""
    return bool(np.issubdtype(np.asarray(array).dtype, np.floating))


def _unreleased_zeroed(arrays: Sequence[np.ndarray]) -> ArrayList:
    """``arrays`` with every integer array replaced by zeros of its shape and dtype."""
    return [a if is_released(a) else np.zeros_like(np.asarray(a)) for a in arrays]


def _within(update: _Float64Update, clip_norm, norm64, plain64) -> bool:
    """Both the overflow-safe norm and the textbook one (unless it overflows) are <= C."""
    norm = norm64(update)
    plain = norm if plain64 is norm64 else plain64(update)
    return norm <= clip_norm and (plain <= clip_norm or math.isinf(plain))


def _scale_within(arrays, update, scale, clip_norm, norms) -> tuple[ArrayList, float]:
    """Scale and cast back; shrink the scale until every norm check is <= clip_norm."""
    dtypes = [_out_dtype(a) for a in arrays]
    eps = [float(np.finfo(d).eps) for d in dtypes if np.issubdtype(d, np.floating)]
    shrink = 4 * max(eps, default=1e-16)
    for _ in range(_MAX_SHRINK_STEPS):
        out = [(a * scale).astype(d) for a, d in zip(update.arrays, dtypes, strict=True)]
        if _within(_float64_update(out), clip_norm, *norms):
            return out, scale
        scale *= 1.0 - shrink
        shrink *= 2
    raise ArithmeticError("could not scale the update within the clip norm")  # unreachable


def _clip(arrays, clip_norm, norm64, plain64) -> ClipResult:
    if not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip_norm must be positive and finite, got {clip_norm!r}")
    arrays = _unreleased_zeroed(arrays)
    update = _float64_update(arrays)
    norm = norm64(update)
    if norm <= clip_norm:
        out = [np.array(a, dtype=_out_dtype(a), copy=True) for a in arrays]
        return ClipResult(arrays=out, norm=norm, scale=1.0, clipped=False)
    scale = (clip_norm / norm) * (1.0 - _CLIP_SLACK)
    out, scale = _scale_within(arrays, update, scale, clip_norm, (norm64, plain64))
    return ClipResult(arrays=out, norm=norm, scale=scale, clipped=True)


def clip_by_l2_norm(arrays: Sequence[np.ndarray], *, clip_norm: float) -> ClipResult:
    """Scale the whole update by min(1, C/‖update‖₂).

    Parameters
    ----------
    arrays : sequence of numpy.ndarray
        One update. Floating arrays keep their dtype; integer arrays come back as
        zeros of theirs (not released, outside the norm).
    clip_norm : float
        C > 0.

    Returns
    -------
    ClipResult
        The clipped arrays, whose global L2 norm is <= C in floating point.

    Raises
    ------
    NonFiniteUpdateError
        If the update holds NaN/Inf or its norm overflows float64.
    """
    return _clip(arrays, clip_norm, _l2_norm64, _l2_norm64_plain)


def clip_by_l1_norm(arrays: Sequence[np.ndarray], *, clip_norm: float) -> ClipResult:
    """Scale the whole update by min(1, C/‖update‖₁); see ``clip_by_l2_norm``."""
    return _clip(arrays, clip_norm, _l1_norm64, _l1_norm64_plain)


def clip_by_norm(
    arrays: Sequence[np.ndarray],
    *,
    clip_norm: float,
    norm: Callable[[Sequence[np.ndarray]], float],
) -> ClipResult:
    """Scale the whole update by min(1, C/norm(update)) for any norm (e.g. a P-norm).

    ``norm`` receives the update as float64 arrays (already checked finite) and must be
    a norm (absolutely homogeneous). The returned arrays satisfy ``norm(...) <= C`` after
    casting back to their dtypes, as for ``clip_by_l2_norm``.
    """

    def norm_of(update: _Float64Update) -> float:
        return norm(update.arrays)

    return _clip(arrays, clip_norm, norm_of, norm_of)


def clip_metrics(results: Sequence[ClipResult]) -> dict[str, float]:
    """Fraction of clipped updates and their mean norm before clipping."""
    if not results:
        return {"clip-fraction": 0.0, "mean-update-norm": 0.0}
    return {
        "clip-fraction": sum(r.clipped for r in results) / len(results),
        "mean-update-norm": math.fsum(r.norm for r in results) / len(results),
    }


# -- noise ------------------------------------------------------------------------
def _check_noise_parameter(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")


def gaussian_noise_like(
    arrays: Sequence[np.ndarray], *, std: float, rng: np.random.Generator
) -> ArrayList:
    """Float64 N(0, std²) noise with the shapes of ``arrays``."""
    _check_noise_parameter("std", std)
    return [rng.normal(0.0, std, size=np.shape(a)) for a in arrays]


def laplace_noise_like(
    arrays: Sequence[np.ndarray], *, scale: float, rng: np.random.Generator
) -> ArrayList:
    """Float64 Laplace(0, scale) noise (density e^(-|x|/b)/(2b)) shaped like ``arrays``."""
    _check_noise_parameter("scale", scale)
    return [rng.laplace(0.0, scale, size=np.shape(a)) for a in arrays]


def add_noise(arrays: Sequence[np.ndarray], noise: Sequence[np.ndarray]) -> ArrayList:
    """``arrays + noise``, summed in float64 and returned in each array's dtype;
    integer arrays (not released) are returned as they are, without noise."""
    arrays64 = _float64_update(arrays).arrays
    if len(arrays64) != len(noise):
        raise ValueError(f"{len(arrays64)} arrays but {len(noise)} noise arrays")
    out = []
    for array, a64, n in zip(arrays, arrays64, noise, strict=True):
        if a64.shape != np.shape(n):
            raise ValueError(f"noise shape {np.shape(n)} != array shape {a64.shape}")
        if not is_released(array):
            out.append(np.array(array, copy=True))
            continue
        out.append((a64 + n).astype(_out_dtype(array)))
    return out


# -- mechanisms -------------------------------------------------------------------
def _check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")


@dataclass(frozen=True)
class GaussianMechanism:
    """Clip to L2 norm C, add Gaussian noise of std z·C to the sum.

    Noise N(0, (zC)²) on the sum of updates clipped to C is the Gaussian mechanism with
    L2 sensitivity C under add/remove-one neighbouring and noise multiplier z; the
    average (sum/m) divides both the noise and the sensitivity by m, so the multiplier
    is unchanged. Under replace-one neighbouring the sensitivity of the sum is 2C:
    account such releases with multiplier z/2 (``accounting.l2_sensitivity_factor``).
    """

    clip_norm: float
    """C, the L2 bound of one client's update."""
    noise_multiplier: float
    """z, noise std on the sum divided by C."""

    def __post_init__(self) -> None:
        _check_positive("clip_norm", self.clip_norm)
        _check_positive("noise_multiplier", self.noise_multiplier)

    def clip(self, update: Sequence[np.ndarray]) -> ClipResult:
        """Clip one update to L2 norm C."""
        return clip_by_l2_norm(update, clip_norm=self.clip_norm)

    @property
    def sum_noise_std(self) -> float:
        """z·C, std of the noise on the sum of the m clipped updates (derived)."""
        return self.noise_multiplier * self.clip_norm

    def client_noise_std(self, num_clients: int) -> float:
        """z·C/√m: what each of m clients adds so that the sum carries N(0, (zC)²)."""
        if isinstance(num_clients, bool) or int(num_clients) != num_clients or num_clients < 1:
            raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
        return self.sum_noise_std / math.sqrt(num_clients)

    def noise_sum(self, total: Sequence[np.ndarray], *, rng: np.random.Generator) -> ArrayList:
        """Add N(0, (zC)²) to the sum of clipped updates (server-side noising)."""
        return add_noise(total, gaussian_noise_like(total, std=self.sum_noise_std, rng=rng))

    def noise_client(
        self, update: Sequence[np.ndarray], *, num_clients: int, rng: np.random.Generator
    ) -> ArrayList:
        """Add one client's share N(0, (zC)²/m) to its clipped update."""
        std = self.client_noise_std(num_clients)
        return add_noise(update, gaussian_noise_like(update, std=std, rng=rng))

    def noise_metrics(self, num_clients: int) -> dict[str, float]:
        """Noise stds on the sum, per client, and on the average of m updates."""
        return {
            "noise-std-sum": self.sum_noise_std,
            "noise-std-client": self.client_noise_std(num_clients),
            "noise-std-mean": self.sum_noise_std / num_clients,
        }

    def dp_event(self) -> dp_accounting.GaussianDpEvent:
        """The unsampled release, add/remove-one: ``GaussianDpEvent(z)``."""
        import dp_accounting  # here: a ClientApp that only adds noise does not import it

        return dp_accounting.GaussianDpEvent(self.noise_multiplier)


@dataclass(frozen=True)
class LaplaceMechanism:
    """Clip to L1 norm S, add Laplace(0, S/ε) noise to every coordinate.

    One release is ε-DP (pure) for L1 sensitivity S. dp-accounting's
    ``LaplaceDpEvent(noise_multiplier)`` takes the ratio scale/sensitivity = S/ε/S = 1/ε
    (its docstring: "the noise_multiplier is defined as s / C").
    """

    sensitivity: float
    """S, the L1 bound of one update (the L1 sensitivity)."""
    epsilon: float
    """ε of one release."""

    def __post_init__(self) -> None:
        _check_positive("sensitivity", self.sensitivity)
        _check_positive("epsilon", self.epsilon)

    @property
    def scale(self) -> float:
        """b = S/ε, the Laplace scale (derived)."""
        return self.sensitivity / self.epsilon

    def clip(self, update: Sequence[np.ndarray]) -> ClipResult:
        """Clip one update to L1 norm S."""
        return clip_by_l1_norm(update, clip_norm=self.sensitivity)

    def noise(self, update: Sequence[np.ndarray], *, rng: np.random.Generator) -> ArrayList:
        """Add Laplace(0, b) to every coordinate of a clipped update."""
        return add_noise(update, laplace_noise_like(update, scale=self.scale, rng=rng))

    def noise_metrics(self) -> dict[str, float]:
        """Scale and std (√2·b) of the per-coordinate noise."""
        return {"noise-scale": self.scale, "noise-std": math.sqrt(2) * self.scale}

    def dp_event(self) -> dp_accounting.LaplaceDpEvent:
        """The unsampled release: ``LaplaceDpEvent(b/S)``."""
        import dp_accounting  # here: a ClientApp that only adds noise does not import it

        return dp_accounting.LaplaceDpEvent(self.scale / self.sensitivity)


@dataclass(frozen=True)
class BoundedScalarRelease:
    """One client's scalar report (e.g. SmartFedProx's model divergence), clipped to
    ``[0, bound]`` and released with Gaussian noise of std z·bound.

    A client's report changes by at most ``bound`` between neighbouring inputs: the
    client's data changed (any value in [0, bound] for another), or zeroed out (the
    client still takes part, with no data: its report is 0). So one report is the
    Gaussian mechanism with L2 sensitivity ``bound`` and noise multiplier z:
    ``GaussianDpEvent(z)``, without amplification (the server knows whom it asked). A
    vector of reports, one per client, releases each client's data through its own
    entry only.
    """

    bound: float
    """The public bound of the report (its sensitivity)."""
    noise_multiplier: float
    """z: noise std divided by ``bound``."""

    def __post_init__(self) -> None:
        _check_positive("bound", self.bound)
        _check_positive("noise_multiplier", self.noise_multiplier)

    @property
    def noise_std(self) -> float:
        """z·bound (derived)."""
        return self.noise_multiplier * self.bound

    def release(self, value: float, *, rng: np.random.Generator) -> float:
        """``min(max(value, 0), bound) + N(0, (z·bound)²)``; NonFiniteUpdateError for a
        NaN or infinite ``value`` (which no clip can bound)."""
        if not math.isfinite(value):
            raise NonFiniteUpdateError(f"the reported value {value!r} is not finite")
        return min(max(float(value), 0.0), self.bound) + float(rng.normal(0.0, self.noise_std))

    def dp_event(self) -> dp_accounting.GaussianDpEvent:
        """One report: ``GaussianDpEvent(z)``."""
        import dp_accounting  # here: a ClientApp that only adds noise does not import it

        return dp_accounting.GaussianDpEvent(self.noise_multiplier)


# -- generators -------------------------------------------------------------------
def make_generator(seed: int, *streams: int) -> np.random.Generator:
    """A reproducible PCG64 generator for ``SeedSequence([seed, *streams])``.

    Distinct ``streams`` (round, client id, purpose) give independent generators
    from one run seed. Never for randomness a DP guarantee relies on, unless the user
    asked for ``dp.reproducible-noise`` (``noise_generator``).
    """
    entropy = [seed, *streams]
    if any(isinstance(v, bool) or int(v) != v or v < 0 for v in entropy):
        raise ValueError(f"seed and streams must be non-negative integers, got {entropy!r}")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(v) for v in entropy])))


def secure_generator() -> np.random.Generator:
    """A PCG64 generator seeded with 128 bits from the OS's CSPRNG (``secrets``).

    Nobody can recompute its draws from anything the run writes or sends: not from
    ``seed``, ``config.json`` or a message. PCG64 itself is not a cryptographic
    generator: recovering its state from raw outputs is conceivable, but what leaves
    a DP mechanism is its output plus data, never raw draws. Its state is written only
    to the owner-only server checkpoint (for resume).
    """
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(secrets.randbits(128))))


def secret_seed() -> int:
    """63 bits from the OS's CSPRNG, for generators that take an integer seed
    (``torch.Generator.manual_seed``): DP-SGD batch sampling and noise, CP-NP/CG noise."""
    return secrets.randbits(63)


def noise_generator(
    *, seed: int, streams: Sequence[int] = (), reproducible: bool = False
) -> np.random.Generator:
    """The generator of randomness a DP guarantee relies on (noise, DP sampling).

    Secret (``secure_generator``) unless ``reproducible`` (``dp.reproducible-noise``,
    a debugging opt-in): then ``make_generator(seed, *streams)``, which anyone who
    knows ``seed`` can recompute, so no ε holds against them.
    """
    return make_generator(seed, *streams) if reproducible else secure_generator()


CLIENT_NOISE_STREAM = 0xD9  # separates a client's noise from other streams of the same seed


def client_noise_generator(
    run_config: Mapping[str, Any], node_config: Mapping[str, Any], server_round: int
) -> np.random.Generator:
    """A client's noise generator for one message (the client mods, SecAgg+): secret
    unless ``dp.reproducible-noise``, then a function of the seed, the round and the
    partition."""
    return noise_generator(
        seed=int(run_config.get("seed", 0)),
        streams=(server_round, int(node_config.get("partition-id", 0)), CLIENT_NOISE_STREAM),
        reproducible=bool(run_config.get("dp.reproducible-noise", False)),
    )
