"""Geometry-aligned DP (Subspace-DP-FL): P-norm clipping, elliptical noise, PMU.

The metric is ``P = U Λ Uᵀ + τ I`` with ``U`` (d×k) orthonormal, ``Λ = diag(λ)`` and
``τ > 0``. It is never materialised as a d×d matrix: every product with a power of
``P`` costs O(kd),

    P^p v = τ^p v + U diag((τ + λ)^p − τ^p) Uᵀ v.

**Mechanism (Subspace-DP-FL's Theorem 1).** One client's update ``g`` is clipped in the P-norm,
``ḡ = g · min(1, C/‖g‖_P)`` with ``‖g‖_P = √(gᵀPg)``, and the sum of the m clipped
updates is released with aligned elliptical noise ``z ~ N(0, σ²C² P⁻¹)``::

    R = Σ ḡ_i + z.

Design notes: ``docs/notes.md``, ``privacy.subspace``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from privacy.mechanisms import ClipResult, add_noise, clip_by_norm

if TYPE_CHECKING:  # imported on use: it loads SciPy (privacy.events)
    import dp_accounting

ArrayList = list[np.ndarray]

# Tolerance of the orthonormality check (a random probe, O(kd)).
_ORTHONORMAL_TOL = 1e-6


def flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The update as one float64 vector (all arrays, in order)."""
    if not arrays:
        return np.zeros(0)
    return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])


def unflatten(vector: np.ndarray, like: Sequence[np.ndarray]) -> ArrayList:
    """``vector`` cut into arrays shaped like ``like`` (float64)."""
    sizes = [int(np.size(a)) for a in like]
    if vector.shape != (sum(sizes),):
        raise ValueError(f"vector of shape {vector.shape} does not fit {sum(sizes)} values")
    out, start = [], 0
    for array, size in zip(like, sizes, strict=True):
        out.append(vector[start : start + size].reshape(np.shape(array)))
        start += size
    return out


def orthonormalize(vectors: np.ndarray) -> np.ndarray:
    """An orthonormal basis (d×k, via QR) of the span of the columns of ``vectors``."""
    q, r = np.linalg.qr(np.asarray(vectors, dtype=np.float64))
    # QR of a rank-deficient input gives columns outside the span; refuse them.
    diag = np.abs(np.diag(r))
    if diag.size and diag.min() <= 1e-12 * max(diag.max(), 1e-300):
        raise ValueError("the vectors are linearly dependent: no rank-k basis")
    return q


@dataclass(frozen=True)
class SubspaceMetric:
    """``P = U diag(λ) Uᵀ + τ I``, applied in O(kd) and never built as a d×d matrix.

    Attributes
    ----------
    basis : numpy.ndarray
        U, shape (d, k), orthonormal columns (k may be 0: ``P = τI``).
    lam : numpy.ndarray
        λ, shape (k,); ``τ + λ_i > 0`` (P positive definite). Subspace-DP-FL's
        constraint ``P ⪰ τI`` is ``λ ≥ 0``; the metric itself accepts ``λ > −τ``.
    tau : float
        τ > 0, the eigenvalue of P on the orthogonal complement of U.
    """

    basis: np.ndarray
    lam: np.ndarray
    tau: float

    def __post_init__(self) -> None:
        basis = np.asarray(self.basis, dtype=np.float64)
        lam = np.asarray(self.lam, dtype=np.float64).reshape(-1)
        if basis.ndim != 2 or basis.shape[1] != lam.shape[0]:
            raise ValueError(f"basis {basis.shape} and lam {lam.shape} disagree on k")
        if not (math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"tau must be positive and finite, got {self.tau!r}")
        if not (np.all(np.isfinite(basis)) and np.all(np.isfinite(lam))):
            raise ValueError("basis and lam must be finite")
        if np.any(self.tau + lam <= 0):
            raise ValueError("P must be positive definite: every tau + lam_i must be > 0")
        _check_orthonormal(basis)
        object.__setattr__(self, "basis", basis)
        object.__setattr__(self, "lam", lam)
        object.__setattr__(self, "tau", float(self.tau))

    @classmethod
    def isotropic(cls, dim: int, tau: float) -> SubspaceMetric:
        """``P = τ I`` on ℝᵈ (no subspace yet)."""
        return cls(basis=np.zeros((dim, 0)), lam=np.zeros(0), tau=tau)

    @property
    def dim(self) -> int:
        """d, the dimension of the updates."""
        return int(self.basis.shape[0])

    @property
    def rank(self) -> int:
        """k, the number of directions of U."""
        return int(self.basis.shape[1])

    def power(self, vector: np.ndarray, exponent: float) -> np.ndarray:
        """``P^exponent · vector`` (vector: shape (d,) or (d, n)), O(kd)."""
        v = np.asarray(vector, dtype=np.float64)
        if v.shape[0] != self.dim:
            raise ValueError(f"vector of length {v.shape[0]} for a metric on R^{self.dim}")
        out = self.tau**exponent * v
        if self.rank:
            gains = (self.tau + self.lam) ** exponent - self.tau**exponent
            coefficients = self.basis.T @ v
            gains = gains if v.ndim == 1 else gains[:, None]
            out = out + self.basis @ (gains * coefficients)
        return out

    def norm(self, vector: np.ndarray) -> float:
        """``‖v‖_P = √(τ‖v‖² + Σ λ_i (u_iᵀv)²)``, in float64."""
        v = np.asarray(vector, dtype=np.float64)
        peak = float(np.max(np.abs(v))) if v.size else 0.0
        if peak == 0.0:
            return 0.0
        v = v / peak  # scaled so that squaring cannot overflow
        quad = self.tau * float(v @ v)
        if self.rank:
            c = self.basis.T @ v
            quad += float(np.sum(self.lam * c * c))
        return peak * math.sqrt(max(quad, 0.0))

    def sample(self, std: float, rng: np.random.Generator) -> np.ndarray:
        """``z ~ N(0, std² P⁻¹)`` as ``std · P^(-½) ξ``, ξ ~ N(0, I_d): O(kd)."""
        if not (math.isfinite(std) and std >= 0):
            raise ValueError(f"std must be finite and >= 0, got {std!r}")
        return std * self.power(rng.standard_normal(self.dim), -0.5)

    def state_dict(self) -> dict[str, np.ndarray | float]:
        """Arrays and τ, for checkpoints."""
        return {"basis": self.basis, "lam": self.lam, "tau": self.tau}


def _check_orthonormal(basis: np.ndarray) -> None:
    """Check UᵀU = I with a random probe x: ‖Uᵀ(Ux) − x‖ small (O(kd), not O(k²d))."""
    k = basis.shape[1]
    if k == 0:
        return
    if k > basis.shape[0]:
        raise ValueError(f"k = {k} directions exceed the dimension d = {basis.shape[0]}")
    probe = np.random.default_rng(0).standard_normal(k)
    error = np.linalg.norm(basis.T @ (basis @ probe) - probe) / np.linalg.norm(probe)
    if not error <= _ORTHONORMAL_TOL:
        raise ValueError(f"basis columns are not orthonormal (probe error {error:.2e})")


def top_subspace(samples: np.ndarray, rank: int) -> np.ndarray:
    """U (d×k): the top-k eigenvectors of the second moment Σ xxᵀ of the rows of ``samples``
    (n×d), i.e. its top-k right singular vectors. For public data only: no noise."""
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 2 or not 1 <= rank <= min(x.shape):
        raise ValueError(f"need an n x d matrix with rank k = {rank} <= min(n, d), got {x.shape}")
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    return orthonormalize(vt[:rank].T)


def uniform_allocation(rank: int, trace_budget: float) -> np.ndarray:
    """λ_i = B/k: the trace budget split evenly over the k directions (part 1's rule)."""
    if rank < 0 or not (math.isfinite(trace_budget) and trace_budget >= 0):
        raise ValueError("rank must be >= 0 and the trace budget finite and >= 0")
    return np.full(rank, trace_budget / rank) if rank else np.zeros(0)


@dataclass(frozen=True)
class EllipticalGaussianMechanism:
    """Clip in the P-norm to C; noise ``N(0, σ²C² P⁻¹)`` on the sum (see module doc).

    Releases are accounted as ``GaussianDpEvent(σ)`` (add/remove-one): whitening by
    ``P^½`` turns the release into the Gaussian mechanism with L2 sensitivity C.
    """

    metric: SubspaceMetric
    clip_norm: float
    """C, the P-norm bound of one client's update."""
    noise_multiplier: float
    """σ: the whitened noise on the sum has std σ·C."""

    def __post_init__(self) -> None:
        for name in ("clip_norm", "noise_multiplier"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive and finite, got {value!r}")

    def pnorm(self, update: Sequence[np.ndarray]) -> float:
        """‖update‖_P of a whole update (all arrays flattened together)."""
        return self.metric.norm(flatten(update))

    def clip(self, update: Sequence[np.ndarray]) -> ClipResult:
        """Scale the update by min(1, C/‖update‖_P); the result's P-norm is <= C."""
        if sum(int(np.size(a)) for a in update) != self.metric.dim:
            raise ValueError(
                f"update of {sum(int(np.size(a)) for a in update)} values for a metric "
                f"on R^{self.metric.dim}"
            )
        return clip_by_norm(update, clip_norm=self.clip_norm, norm=self.pnorm)

    @property
    def sum_noise_std(self) -> float:
        """σ·C, the std of the whitened noise on the sum."""
        return self.noise_multiplier * self.clip_norm

    def noise_sum(self, total: Sequence[np.ndarray], *, rng: np.random.Generator) -> ArrayList:
        """Add ``N(0, σ²C² P⁻¹)`` to the sum of clipped updates."""
        noise = self.metric.sample(self.sum_noise_std, rng)
        return add_noise(total, unflatten(noise, total))

    def dp_event(self) -> dp_accounting.GaussianDpEvent:
        """The unsampled release, add/remove-one: ``GaussianDpEvent(σ)``."""
        import dp_accounting

        return dp_accounting.GaussianDpEvent(self.noise_multiplier)


# -- Private Metric Updates ----------------------------------------------------------
def sketch_matrix(dim: int, sketch_dim: int, rng: np.random.Generator) -> np.ndarray:
    """Ω, a d×s Johnson–Lindenstrauss matrix with N(0, 1/s) entries (public randomness)."""
    if dim < 1 or sketch_dim < 1:
        raise ValueError("dim and sketch_dim must be >= 1")
    return rng.standard_normal((dim, sketch_dim)) / math.sqrt(sketch_dim)


@dataclass
class SketchAccumulator:
    """Sums the clients' PMU contributions ``(ĝŝᵀ, ŝŝᵀ)``, each part of Frobenius ≤ 1."""

    omega: np.ndarray
    """Ω (d×s)."""

    def __post_init__(self) -> None:
        d, s = self.omega.shape
        self.lift = np.zeros((d, s))
        self.second_moment = np.zeros((s, s))
        self.count = 0

    def add(self, update: np.ndarray) -> None:
        """Add one client's update (flattened). A zero update contributes nothing."""
        g = np.asarray(update, dtype=np.float64)
        self.count += 1
        norm = float(np.linalg.norm(g))
        if norm == 0.0 or not math.isfinite(norm):
            return
        direction = g / norm
        sketch = self.omega.T @ direction
        # ‖ĝŝᵀ‖_F = ‖ŝ‖ and ‖ŝŝᵀ‖_F = ‖ŝ‖²: scale ŝ to norm <= 1 for both bounds.
        sketch = sketch * min(1.0, 1.0 / max(float(np.linalg.norm(sketch)), 1e-300))
        self.lift += np.outer(direction, sketch)
        self.second_moment += np.outer(sketch, sketch)


@dataclass(frozen=True)
class SketchRelease:
    """The noised PMU sums and what the server derives from them (post-processing)."""

    lift: np.ndarray
    """Ỹ = Σ ĝŝᵀ + noise (d×s)."""
    second_moment: np.ndarray
    """S̃, symmetrised Σ ŝŝᵀ + noise (s×s)."""
    noise_std: float
    """Std of the Gaussian noise per entry (√2·σ_PMU)."""


def release_sketch(
    accumulator: SketchAccumulator, *, noise_multiplier: float, rng: np.random.Generator
) -> SketchRelease:
    """Release the PMU sums: one Gaussian mechanism, L2 sensitivity √2, multiplier σ_PMU.

    Each client changes ``(Y, S)`` by at most 1 in Frobenius norm per part, √2 jointly;
    noise of std √2·σ_PMU on every entry is the Gaussian mechanism with multiplier σ_PMU.
    """
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be positive, got {noise_multiplier!r}")
    std = math.sqrt(2.0) * noise_multiplier
    lift = accumulator.lift + rng.normal(0.0, std, size=accumulator.lift.shape)
    second = accumulator.second_moment + rng.normal(0.0, std, size=accumulator.second_moment.shape)
    return SketchRelease(lift=lift, second_moment=(second + second.T) / 2, noise_std=std)


@dataclass(frozen=True)
class SubspaceEstimate:
    """Top-k eigenpairs of the released sketch, lifted to ℝᵈ, and the PTR decision."""

    basis: np.ndarray
    """Proposed U (d×k, orthonormal)."""
    eigenvalues: np.ndarray
    """θ̃, all eigenvalues of S̃, descending."""
    gap: float
    """θ̃_k − θ̃_{k+1}."""
    gap_threshold: float
    """λ_PTR times the noise's spectral-norm bound on S̃ (s×s)."""
    lift_threshold: float
    """λ_PTR times the noise's spectral-norm bound on the lift Ỹ W_k (d×k)."""

    @property
    def kth_eigenvalue(self) -> float:
        """θ̃_k, the weakest proposed direction's (noisy) second moment."""
        return float(self.eigenvalues[self.basis.shape[1] - 1])

    @property
    def adopt(self) -> bool:
        """The PTR gate: the gap and θ̃_k both clear their thresholds."""
        return self.gap >= self.gap_threshold and self.kth_eigenvalue >= self.lift_threshold


def noise_spectral_bound(rows: int, cols: int, noise_std: float) -> float:
    """(√rows + √cols)·std: the typical spectral norm of a rows×cols matrix of iid
    N(0, std²) entries (Gordon; symmetrising an s×s matrix does not increase it)."""
    return (math.sqrt(rows) + math.sqrt(cols)) * noise_std


def estimate_subspace(release: SketchRelease, rank: int, lambda_ptr: float) -> SubspaceEstimate:
    """Nyström: top-k eigenvectors W_k of S̃, lift ``Ỹ W_k``, orthonormalise; PTR gap test.

    Only reads the released sketch (post-processing: no privacy cost). The lift noise
    ``E W_k`` has iid N(0, std²) entries since W_k is orthonormal.
    """
    s = release.second_moment.shape[0]
    if not 1 <= rank < s:
        raise ValueError(f"rank k = {rank} must be in [1, sketch_dim - 1 = {s - 1}]")
    if not (math.isfinite(lambda_ptr) and lambda_ptr >= 0):
        raise ValueError(f"lambda_ptr must be finite and >= 0, got {lambda_ptr!r}")
    values, vectors = np.linalg.eigh(release.second_moment)
    order = np.argsort(values)[::-1]
    values, vectors = values[order], vectors[:, order]
    lifted = release.lift @ vectors[:, :rank]
    basis = orthonormalize(lifted)
    d = release.lift.shape[0]
    return SubspaceEstimate(
        basis=basis,
        eigenvalues=values,
        gap=float(values[rank - 1] - values[rank]),
        gap_threshold=lambda_ptr * noise_spectral_bound(s, s, release.noise_std),
        lift_threshold=lambda_ptr * noise_spectral_bound(d, rank, release.noise_std),
    )


def pmu_noise_multiplier(
    noise_multiplier: float, reserve: float, rounds: int, pmu_releases: int
) -> tuple[float, float]:
    """Split the run's noise budget between training and PMU in zCDP ρ = count/(2σ²).

    ``noise_multiplier`` z is what ``rounds`` unsampled releases would have with no PMU
    (ρ = T/(2z²)). Training gets ``1 − reserve`` of ρ and the ``pmu_releases`` PMU
    releases get ``reserve``::

        z_train = z / √(1 − r),   z_PMU = z · √(n / (T r)).

    Returns ``(z_train, z_PMU)``; ``z_PMU`` is ``inf`` when ``reserve`` is 0 (no PMU).
    The ledger then composes the actual releases (with amplification) exactly.
    """
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve must be in [0, 1), got {reserve!r}")
    if rounds < 1 or pmu_releases < 0:
        raise ValueError("rounds must be >= 1 and pmu_releases >= 0")
    z_train = noise_multiplier / math.sqrt(1.0 - reserve)
    if reserve == 0 or pmu_releases == 0:
        return z_train, math.inf
    return z_train, noise_multiplier * math.sqrt(pmu_releases / (rounds * reserve))


def combined_noise_multiplier(*multipliers: float) -> float:
    """``(Σ z_i⁻²)^(-½)``: Gaussian releases on the same sample, as one Gaussian mechanism."""
    inverse = math.fsum(z**-2 for z in multipliers if math.isfinite(z))
    if inverse <= 0:
        raise ValueError("need at least one finite noise multiplier")
    return inverse**-0.5


def principal_angle(a: np.ndarray, b: np.ndarray) -> float:
    """Largest principal angle (radians) between the spans of orthonormal a and b."""
    singular = np.linalg.svd(a.T @ b, compute_uv=False)
    return float(np.arccos(np.clip(singular.min(), -1.0, 1.0))) if singular.size else 0.0
