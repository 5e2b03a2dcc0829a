"""Correlated noise across rounds: banded matrix factorization and DP-FTRL tree noise.

The released prefix sums of the clipped per-round sums x are ``A x + B w`` with A the
n x n prefix-sum workload (lower-triangular ones), ``A = B C`` and w i.i.d. Gaussian
(std z per coordinate); the noise added in round t is ``(C^{-1} w)_t``. Banded MF
(Choquette-Choo, McMahan et al., NeurIPS 2023, "(Amplified) Banded Matrix
Factorization"): C is b-banded lower-triangular Toeplitz with max column norm 1, its b
coefficients minimising ||A C^{-1}||_F^2 by L-BFGS; b = 1 is C = I, plain DP-FedAvg
noise; with server momentum A is the momentum workload (``momentum_workload``).
DP-FTRL (Kairouz et al., ICML 2021, "Practical and Private (Deep) Learning
without Sampling or Shuffling"): C has one row per node of the binary tree over the
rounds and prefix t sums the node noises of t's dyadic decomposition (honest tree).

Design notes: ``docs/notes.md``, ``privacy.correlated``.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from privacy.events import PLD_DISCRETIZATION, RDP_ORDERS, AccountingError, new_accountant

WORKLOADS = ("prefix-sum",)
CACHE_ENV = "FLOWER_PRIVACY_LAB_CACHE"
_CACHE_VERSION = 1
# Exact enumeration of participation patterns only below this many patterns.
_MAX_ENUMERATED = 200_000


class FactorizationError(ValueError):
    """A factorization or participation schema that cannot be built as asked."""


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise FactorizationError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


# -- banded Toeplitz strategy matrices ---------------------------------------------------
def prefix_sum_workload(n: int) -> np.ndarray:
    """A: the n x n lower-triangular matrix of ones (row t sums rounds 0..t)."""
    return np.tril(np.ones((_positive_int("n", n), _positive_int("n", n))))


def _check_momentum(momentum) -> float:
    if isinstance(momentum, bool) or not (isinstance(momentum, int | float) and 0 <= momentum < 1):
        raise FactorizationError(f"momentum must be in [0, 1), got {momentum!r}")
    return float(momentum)


def workload_column(n: int, momentum: float = 0.0) -> np.ndarray:
    """First column of the lower-triangular Toeplitz workload: ones (prefix sums), or
    ``(1 - beta^(m+1)) / (1 - beta)`` for heavy-ball momentum beta (the server's FedAvgM:
    m_t = beta m_(t-1) + x_t, model_t = model_0 - lr sum_s m_s)."""
    beta = _check_momentum(momentum)
    m = np.arange(_positive_int("n", n), dtype=np.float64)
    return np.ones(n) if beta == 0 else (1.0 - beta ** (m + 1)) / (1.0 - beta)


def momentum_workload(n: int, momentum: float) -> np.ndarray:
    """A for momentum beta: ``A[t, s] = (1 - beta^(t-s+1)) / (1 - beta)``, s <= t."""
    return banded_toeplitz(workload_column(n, momentum), n)


def banded_toeplitz(coefs: np.ndarray, n: int) -> np.ndarray:
    """The n x n lower-triangular Toeplitz C with ``C[i, j] = coefs[i - j]`` (0 <= i-j < b)."""
    from scipy.linalg import toeplitz

    column = np.zeros(n)
    coefs = np.asarray(coefs, dtype=np.float64)[:n]
    column[: coefs.size] = coefs
    row = np.zeros(n)
    row[0] = column[0]
    return toeplitz(column, row)


def _inverse_series(coefs: np.ndarray, n: int) -> np.ndarray:
    """First n coefficients of 1 / c(z): the first column of C^{-1} (lfilter: C loop)."""
    from scipy.signal import lfilter

    impulse = np.zeros(n)
    impulse[0] = 1.0
    return lfilter([1.0], coefs, impulse)


def _loss_and_grad(
    tail: np.ndarray, n: int, column: np.ndarray | None = None
) -> tuple[float, np.ndarray]:
    """||c||^2 ||A C^{-1}||_F^2 for c = (1, tail) and its gradient in ``tail``.

    Hand-written because A C^{-1} is Toeplitz with first column e = a(z)/c(z) (a: A's
    first column, ``column``; None: ones, prefix sums: e = cumsum(1/c(z))), so
    ||B||_F^2 = sum_m (n - m) e_m^2 in O(n b); d(1/c)/dc_k = -z^k / c(z)^2.
    """
    from scipy.signal import fftconvolve

    def times_a(x: np.ndarray) -> np.ndarray:
        return np.cumsum(x) if column is None else fftconvolve(column, x)[:n]

    c = np.concatenate(([1.0], tail))
    with np.errstate(over="ignore", invalid="ignore"):
        d = _inverse_series(c, n)
        e = times_a(d)
        w = n - np.arange(n, dtype=np.float64)
        s = float(np.sum(w * e * e))
        if not math.isfinite(s):
            return 1e300, np.zeros_like(tail)
        f = times_a(fftconvolve(d, d)[:n])  # -de_m/dc_k = f_{m-k}
        g = w * e
        # dS/dc_k = -2 sum_{m >= k} g_m f_{m-k}, k = 1..b-1
        corr = np.array([np.dot(g[k:], f[: n - k]) for k in range(1, len(c))])
    norm2 = float(np.dot(c, c))
    grad = norm2 * (-2.0 * corr) + 2.0 * tail * s
    return norm2 * s, grad


def cache_dir() -> Path:
    """Where optimised strategy coefficients are cached (public, data-independent)."""
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "flower-privacy-lab"
    return base / "correlated"


@dataclass(frozen=True)
class BandedFactorization:
    """A b-banded Toeplitz strategy C (max column norm 1) for an n-round workload.

    ``coefs[k]`` is C's k-th subdiagonal; ``loss`` is ||A C^{-1}||_F^2 (the total squared
    error of the workload per unit noise std, at sensitivity 1 per participation);
    ``momentum`` > 0: A is the momentum workload (``workload`` "momentum-<beta>").
    """

    n: int
    bands: int
    coefs: tuple[float, ...]
    workload: str = "prefix-sum"
    loss: float = float("nan")
    seconds: float = 0.0
    momentum: float = 0.0

    def strategy(self) -> np.ndarray:
        """C (n x n)."""
        return banded_toeplitz(np.array(self.coefs), self.n)

    def decoder(self) -> np.ndarray:
        """B = A C^{-1} (n x n), Toeplitz with first column a(z) / c(z)."""
        d = _inverse_series(np.array(self.coefs), self.n)
        if self.momentum == 0:
            return banded_toeplitz(np.cumsum(d), self.n)
        from scipy.signal import fftconvolve

        column = workload_column(self.n, self.momentum)
        return banded_toeplitz(fftconvolve(column, d)[: self.n], self.n)


def optimize_banded(
    n: int,
    bands: int,
    *,
    workload: str = "prefix-sum",
    use_cache: bool = True,
    cache: Path | None = None,
    max_iterations: int = 2000,
    momentum: float = 0.0,
) -> BandedFactorization:
    """The b-banded Toeplitz C minimising ||A C^{-1}||_F^2 at max column norm 1.

    With at most one participation every b rounds the sensitivity is sqrt(k) times the
    max column norm for any such C, so this minimises the total squared error for every
    k (Choquette-Choo et al. 2023). L-BFGS over c_1..c_{b-1} (c_0 = 1, then scaled),
    started from the truncated square-root factorization (coefficients of (1-z)^{-1/2}).
    b = 1 is the identity (plain DP-FedAvg noise). ``momentum`` beta > 0 optimises for
    the momentum workload instead (``momentum_workload``: the models a server with
    heavy-ball momentum releases). Cached by (workload, n, b).
    """
    n = _positive_int("n", n)
    bands = _positive_int("bands", bands)
    if bands > n:
        raise FactorizationError(f"bands must be <= n={n}, got {bands}")
    if workload not in WORKLOADS:
        raise FactorizationError(f"workload must be one of {list(WORKLOADS)}, got {workload!r}")
    beta = _check_momentum(momentum)
    column = None if beta == 0 else workload_column(n, beta)
    if beta:
        workload = f"momentum-{beta:.12g}"
    if bands == 1:
        loss = float(np.sum((n - np.arange(n)) * (np.ones(n) if column is None else column) ** 2))
        return BandedFactorization(n, 1, (1.0,), workload, loss, 0.0, beta)
    path = (cache or cache_dir()) / f"banded-{workload}-n{n}-b{bands}.json"
    if use_cache and path.exists():
        saved = json.loads(path.read_text())
        expected = {"version": _CACHE_VERSION, "workload": workload, "n": n, "bands": bands}
        if all(saved.get(key) == value for key, value in expected.items()) and (
            len(saved.get("coefs", ())) == bands
        ):
            return BandedFactorization(
                n, bands, tuple(saved["coefs"]), workload, saved["loss"], saved["seconds"], beta
            )
    from scipy.optimize import minimize

    start = time.perf_counter()
    sqrt_series = np.cumprod([1.0] + [(2 * k - 1) / (2 * k) for k in range(1, bands)])
    result = minimize(
        _loss_and_grad,
        sqrt_series[1:],
        args=(n, column),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": max_iterations},
    )
    c = np.concatenate(([1.0], result.x))
    c /= np.linalg.norm(c)
    loss, _ = _loss_and_grad(c[1:] / c[0], n, column)
    seconds = time.perf_counter() - start
    coefs = tuple(float(x) for x in c)
    out = BandedFactorization(n, bands, coefs, workload, loss, seconds, beta)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "version": _CACHE_VERSION,
            "public": "data-independent strategy matrix coefficients; no secret, no data",
            "workload": workload,
            "n": n,
            "bands": bands,
            "coefs": list(out.coefs),
            "loss": loss,
            "seconds": seconds,
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    return out


# -- sensitivity under participation schemas ---------------------------------------------
def _patterns(n: int, k: int, separation: int):
    """Every set of 1..k round indices pairwise >= ``separation`` apart."""
    for size in range(1, k + 1):
        for combo in itertools.combinations(range(n), size):
            if all(b - a >= separation for a, b in itertools.pairwise(combo)):
                yield combo


def brute_force_sensitivity(strategy: np.ndarray, *, participations: int, min_separation: int):
    """max over patterns of ||sum of C's columns||_2, by enumerating them (small n)."""
    k = _positive_int("participations", participations)
    sep = _positive_int("min_separation", min_separation)
    cols = np.asarray(strategy, dtype=np.float64)
    return max(
        float(np.linalg.norm(cols[:, list(p)].sum(axis=1)))
        for p in _patterns(cols.shape[1], k, sep)
    )


def _disjoint_beyond(strategy: np.ndarray, separation: int) -> bool:
    """Whether columns >= ``separation`` apart share no nonzero row."""
    rows, cols = np.nonzero(strategy)
    n_rows, n = strategy.shape
    if n_rows == n and not np.any(rows < cols):  # lower-triangular: its band decides
        return (int(np.max(rows - cols)) + 1 if rows.size else 1) <= separation
    support = (strategy != 0).astype(np.float64)
    overlap = support.T @ support
    far = np.abs(np.subtract.outer(np.arange(n), np.arange(n))) >= separation
    return not np.any(overlap[far])


@dataclass(frozen=True)
class Sensitivity:
    """L2 sensitivity of C for k participations; ``method`` says how it was obtained."""

    value: float
    method: str  # "disjoint-columns" (exact), "enumeration" (exact), "upper-bound"


def sensitivity(strategy: np.ndarray, *, participations: int, min_separation: int) -> Sensitivity:
    """max over patterns (<= k rounds, >= ``min_separation`` apart) of ||C 1_pattern||_2.

    Exact by dynamic programming when C's band <= min_separation (a pattern's columns
    share no row, so the squared norm is the sum of squared column norms); exact by
    enumeration when there are few patterns; otherwise the sound bound
    sum_{i,j in p} G_ij <= sum of the k largest (G_ii + k-1 largest |G_ij|, j allowed
    with i), G = C^T C.
    """
    k = _positive_int("participations", participations)
    sep = _positive_int("min_separation", min_separation)
    c = np.asarray(strategy, dtype=np.float64)
    n = c.shape[1]
    if _disjoint_beyond(c, sep):
        weights = np.sum(c * c, axis=0)
        # best[j][i]: max weight of <= j picks among columns i.., pairwise >= sep apart
        best = np.zeros((k + 1, n + sep))
        for j in range(1, k + 1):
            for i in range(n - 1, -1, -1):
                best[j, i] = max(best[j, i + 1], weights[i] + best[j - 1, i + sep])
        return Sensitivity(math.sqrt(best[k, 0]), "disjoint-columns")
    count = sum(math.comb(n - (size - 1) * (sep - 1), size) for size in range(1, k + 1))
    if count <= _MAX_ENUMERATED:
        value = brute_force_sensitivity(c, participations=k, min_separation=sep)
        return Sensitivity(value, "enumeration")
    gram = np.abs(c.T @ c)
    rows = []
    for i in range(n):
        far = np.concatenate((gram[i, : max(i - sep + 1, 0)], gram[i, i + sep :]))
        top = np.sort(far)[::-1][: k - 1]
        rows.append(gram[i, i] + top.sum())
    return Sensitivity(math.sqrt(sum(sorted(rows, reverse=True)[:k])), "upper-bound")


# -- DP-FTRL binary tree -------------------------------------------------------------------
def tree_levels(n: int) -> int:
    """Levels of the binary tree over n leaves: ceil(log2 n) + 1."""
    return math.ceil(math.log2(_positive_int("n", n))) + 1


def tree_strategy(n: int) -> np.ndarray:
    """C of the tree: one row per node (all levels), C[node, t] = 1 if leaf t is under it."""
    levels = tree_levels(n)
    rows = []
    for h in range(levels):
        for start in range(0, n, 2**h):
            row = np.zeros(n)
            row[start : start + 2**h] = 1.0
            rows.append(row)
    return np.array(rows)


def tree_decoder(n: int) -> np.ndarray:
    """B of the honest tree: prefix t (1-based) sums the nodes of t's dyadic decomposition."""
    levels = tree_levels(n)
    offsets = np.cumsum([0] + [math.ceil(n / 2**h) for h in range(levels)])
    b = np.zeros((n, offsets[-1]))
    for t in range(1, n + 1):
        for h in range(levels):
            if (t >> h) & 1:
                b[t - 1, offsets[h] + (t >> h) - 1] = 1.0
    return b


def tree_sensitivity(
    n: int, *, participations: int, min_separation: int = 1, restart_every: int | None = None
) -> float:
    """Upper bound on the honest tree's L2 sensitivity for k participations.

    ||C 1_p||^2 = sum over nodes of m_v^2 (m_v: pattern leaves under node v); per level
    sum_v m_v = k and m_v <= min(k, floor((2^h - 1)/sep) + 1), so the squared norm is at
    most g(k) = k * sum_h min(k, floor((2^h - 1)/sep) + 1). k = 1 gives sqrt(levels)
    exactly; sqrt(k * levels) would NOT be a bound (two leaves under one node add 4,
    not 2). With a fresh tree every r rounds (Kairouz et al.'s restarts) the trees are
    disjoint: max of sum_j g_r(k_j) over sum k_j = k, k_j <= the per-tree cap, which
    for convex g_r (g_r(0) = 0) fills whole trees first (a vertex of the polytope).
    """
    k = _positive_int("participations", participations)
    sep = _positive_int("min_separation", min_separation)
    n = _positive_int("n", n)
    leaves = n if restart_every is None else min(_positive_int("restart_every", restart_every), n)
    levels = tree_levels(leaves)

    def g(j: int) -> int:
        return j * sum(min(j, (2**h - 1) // sep + 1) for h in range(levels))

    trees = math.ceil(n / leaves)
    cap = min(k, (leaves - 1) // sep + 1)
    full = min(k // cap, trees)
    rest = k - full * cap if full < trees else 0
    return math.sqrt(full * g(cap) + g(rest))


# -- online noise generators ---------------------------------------------------------------
def _check_state(state: dict, kind: str, keys: set[str]) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind or not keys <= state.keys():
        raise FactorizationError(f"noise state must be a {kind!r} state dict with {sorted(keys)}")


class BandedNoise:
    """Round-t noise (C^{-1} w)_t for a banded Toeplitz C, O(b) past solutions kept.

    w_t ~ N(0, std^2 I_dim) from ``generator`` (secret); y_t = (w_t - sum_k c_k y_{t-k})/c_0.
    ``dtype`` is the released weights' (float32 models: float32 noise, half the memory
    traffic of a round; the stream's cost per round: docs/correlated-noise.md).
    """

    def __init__(
        self,
        coefs,
        *,
        dim: int,
        std: float,
        generator: np.random.Generator,
        dtype=np.float64,
    ):
        self.coefs = np.asarray(coefs, dtype=np.float64)
        if self.coefs.ndim != 1 or self.coefs.size == 0 or self.coefs[0] == 0:
            raise FactorizationError("coefs must be a non-empty vector with coefs[0] != 0")
        self.dim = _positive_int("dim", dim)
        if not (math.isfinite(std) and std >= 0):
            raise FactorizationError(f"std must be finite and >= 0, got {std!r}")
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise FactorizationError(f"dtype must be float32 or float64, got {dtype!r}")
        self.std, self.generator = float(std), generator
        self.round = 0
        # Hand-written ring (no library keeps a banded solve's past online): y_s lives
        # in row s % b, preallocated once; a round draws into the oldest row in place
        # and subtracts the band as one matrix-vector product (BLAS gemv) into a
        # preallocated scratch row, so no (b - 1) x dim temporary is ever made.
        self._buffer = np.zeros((self.coefs.size, self.dim), dtype=self.dtype)
        self._scratch = np.empty(self.dim, dtype=self.dtype) if self.coefs.size > 1 else None

    def _slots(self, count: int) -> list[int]:
        """Rows holding y_{t-1}, ..., y_{t-count} (t = self.round)."""
        b = self._buffer.shape[0]
        return [(self.round - k) % b for k in range(1, count + 1)]

    def _advance(self) -> np.ndarray:
        """y_t computed in its ring row (a view, overwritten b rounds later)."""
        b = self._buffer.shape[0]
        y = self._buffer[self.round % b]
        if self.std:
            self.generator.standard_normal(dtype=self.dtype, out=y)
            y *= self.std / self.coefs[0]
        else:
            y[:] = 0.0
        past = min(self.round, b - 1)
        if past:
            weights = np.zeros(b, dtype=self.dtype)
            for k, slot in enumerate(self._slots(past), start=1):
                weights[slot] = self.coefs[k] / self.coefs[0]
            np.dot(weights, self._buffer, out=self._scratch)  # row t's weight is 0
            y -= self._scratch
        self.round += 1
        return y

    def next(self) -> np.ndarray:
        """The next round's noise increment, shape (dim,) (a fresh array)."""
        return self._advance().copy()

    def add_to(self, total: np.ndarray) -> None:
        """Add the next round's increment to ``total`` in place (no copy of it)."""
        total += self._advance()

    def state_dict(self) -> dict:
        """The stream's state (secret: past noise, newest first); the generator is saved
        by its owner."""
        b = self._buffer.shape[0]
        return {
            "kind": "banded-mf",
            "coefs": self.coefs.tolist(),
            "round": self.round,
            "past": [self._buffer[s].copy() for s in self._slots(min(self.round, b - 1))],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream saved by ``state_dict`` (same coefs and dim)."""
        _check_state(state, "banded-mf", {"coefs", "round", "past"})
        if not np.array_equal(np.asarray(state["coefs"]), self.coefs):
            raise FactorizationError("noise state was saved for other band coefficients")
        if any(np.shape(p) != (self.dim,) for p in state["past"]):
            raise FactorizationError(f"noise state was saved for another dim than {self.dim}")
        b = self._buffer.shape[0]
        count = min(int(state["round"]), b - 1)
        if len(state["past"]) != count:
            raise FactorizationError(f"noise state must hold {count} past vectors")
        self.round = int(state["round"])
        self._buffer[:] = 0.0
        for slot, past in zip(self._slots(count), state["past"], strict=True):
            self._buffer[slot] = past


class TreeNoise:
    """DP-FTRL honest-tree noise increments: N(t) - N(t-1), N(t) the sum of the node
    noises of t's dyadic decomposition; one fresh node per round, O(log n) kept; with
    ``restart_every`` r, a fresh tree every r rounds."""

    def __init__(
        self,
        *,
        dim: int,
        std: float,
        generator: np.random.Generator,
        restart_every: int | None = None,
    ):
        self.dim = _positive_int("dim", dim)
        if not (math.isfinite(std) and std >= 0):
            raise FactorizationError(f"std must be finite and >= 0, got {std!r}")
        self.restart_every = (
            None if restart_every is None else _positive_int("restart_every", restart_every)
        )
        self.std, self.generator = float(std), generator
        self.round = 0
        self._nodes: dict[int, np.ndarray] = {}  # level -> noise of the open node

    def _leaves(self, rounds: int) -> int:
        """Leaves of the current tree after ``rounds`` rounds."""
        if self.restart_every is None or rounds == 0:
            return rounds
        return (rounds - 1) % self.restart_every + 1

    def next(self) -> np.ndarray:
        """The next round's noise increment, shape (dim,)."""
        if self.restart_every is not None and self.round % self.restart_every == 0:
            self._nodes = {}  # a new tree; the old one's noise stays in the past prefix
        t = self._leaves(self.round + 1)
        low = (t & -t).bit_length() - 1  # levels below `low` close into the new node
        fresh = self.generator.normal(0.0, self.std, self.dim) if self.std else np.zeros(self.dim)
        increment = fresh.copy()
        for h in range(low):
            increment -= self._nodes.pop(h)
        self._nodes[low] = fresh
        self.round += 1
        return increment

    def add_to(self, total: np.ndarray) -> None:
        """Add the next round's increment to ``total`` in place."""
        total += self.next()

    def state_dict(self) -> dict:
        """The stream's state (secret: open node noises)."""
        return {
            "kind": "dp-ftrl-tree",
            "round": self.round,
            "restart_every": self.restart_every,
            "nodes": {str(h): v.copy() for h, v in self._nodes.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue the stream saved by ``state_dict``."""
        _check_state(state, "dp-ftrl-tree", {"round", "nodes", "restart_every"})
        if state["restart_every"] != self.restart_every:
            raise FactorizationError(
                f"noise state has restart_every={state['restart_every']!r}, this stream "
                f"{self.restart_every!r}"
            )
        nodes = {int(h): np.array(v, dtype=np.float64) for h, v in state["nodes"].items()}
        local = self._leaves(int(state["round"]))
        expected = {h for h in range(64) if (local >> h) & 1}
        if set(nodes) != expected or any(v.shape != (self.dim,) for v in nodes.values()):
            raise FactorizationError("noise state's open nodes do not match its round or dim")
        self.round, self._nodes = int(state["round"]), nodes


# -- accounting and error --------------------------------------------------------------------
def _check_privacy(noise_multiplier: float, sens: float, delta: float) -> None:
    for name, value in (("noise_multiplier", noise_multiplier), ("sensitivity", sens)):
        if isinstance(value, bool) or not (math.isfinite(value) and value > 0):
            raise AccountingError(f"{name} must be finite and > 0, got {value!r}")
    if not 0 < delta < 1:
        raise AccountingError(f"delta must be in (0, 1), got {delta!r}")


def epsilon(
    *, noise_multiplier: float, sensitivity: float, delta: float, accountant: str = "pld"
) -> float:
    """ε of the whole run: one Gaussian mechanism, noise std z on L2 sensitivity ``sens``
    (clip 1), i.e. dp-accounting's GaussianDpEvent(z / sens), add-or-remove-one client."""
    _check_privacy(noise_multiplier, sensitivity, delta)
    import dp_accounting

    fresh = new_accountant(
        accountant,
        "add-or-remove-one",
        rdp_orders=RDP_ORDERS,
        pld_discretization=PLD_DISCRETIZATION,
    )
    event = dp_accounting.GaussianDpEvent(noise_multiplier / sensitivity)
    return float(fresh.compose(event).get_epsilon(delta))


def calibrate(
    *, target_epsilon: float, sensitivity: float, delta: float, accountant: str = "pld"
) -> float:
    """Smallest z (to 1e-6 relative) with epsilon(z) <= target_epsilon; ε never above it.

    z / sens is one Gaussian's multiplier, so it is calibrated once per (ε, δ) by
    dp-accounting's ``calibrate_dp_mechanism`` (Brent, returns the private end).
    """
    _check_privacy(1.0, sensitivity, delta)
    if isinstance(target_epsilon, bool) or not (
        math.isfinite(target_epsilon) and target_epsilon > 0
    ):
        raise AccountingError(f"target_epsilon must be finite and > 0, got {target_epsilon!r}")
    return sensitivity * _unit_multiplier(float(target_epsilon), float(delta), accountant)


@functools.lru_cache(maxsize=32)
def _unit_multiplier(target_epsilon: float, delta: float, accountant: str) -> float:
    import dp_accounting
    from dp_accounting import mechanism_calibration

    def eps(z: float) -> float:
        return epsilon(noise_multiplier=z, sensitivity=1.0, delta=delta, accountant=accountant)

    low, high = 0.5, 1.0
    while eps(high) > target_epsilon:
        low, high = high, 2 * high
        if high > 1e6:
            raise AccountingError(f"target_epsilon={target_epsilon:g} is unreachable")
    while eps(low) <= target_epsilon:
        low, high = low / 2, low
        if low < 1e-4:
            raise AccountingError(f"target_epsilon={target_epsilon:g} needs no noise to speak of")
    return float(
        mechanism_calibration.calibrate_dp_mechanism(
            lambda: new_accountant(
                accountant,
                "add-or-remove-one",
                rdp_orders=RDP_ORDERS,
                pld_discretization=PLD_DISCRETIZATION,
            ),
            dp_accounting.GaussianDpEvent,
            target_epsilon,
            delta,
            bracket_interval=mechanism_calibration.ExplicitBracketInterval(low, high),
            tol=1e-6 * low,
        )
    )


def prefix_sum_error(decoder: np.ndarray, *, noise_std: float) -> float:
    """Mean over rounds of the squared error of the released prefix sums, per coordinate:
    noise_std^2 ||B||_F^2 / n."""
    b = np.asarray(decoder, dtype=np.float64)
    return float(noise_std**2 * np.sum(b * b) / b.shape[0])


# -- choosing b for the amplified schema -----------------------------------------------------
@dataclass(frozen=True)
class SeparationChoice:
    """The amplified schema's b with the least error, and every candidate's numbers.

    ``sweep`` holds ``(b, q, z, error)`` per candidate b (1 .. B): q = m / (the smallest
    group of b), z calibrated to the target ε for k = ceil(n / b) Poisson-sampled
    Gaussians, error the mean squared error of the workload's released models per
    coordinate in units of C² (``prefix_sum_error`` of A C⁻¹, C at max column norm 1).
    """

    separation: int
    sweep: tuple[tuple[int, float, float, float], ...]


def amplified_noise_multiplier(
    *, target_epsilon: float, delta: float, cohort: int, group_size: int, participations: int
) -> float:
    """z of k = ``participations`` Poisson-sampled Gaussians at q = cohort / group_size
    and unit sensitivity (max column norm 1) for (ε, δ): the ledger's calibration of the
    amplified schema (PLD, add-or-remove-one)."""
    from privacy.calibration import calibrate_parameter
    from privacy.events import Release

    def releases(z: float) -> list[Release]:
        return [
            Release(
                server_round=1,
                kind="model-update",
                mechanism="gaussian",
                noise_multiplier=z,
                sampling="poisson",
                sample_size=cohort,
                population=group_size,
                count=participations,
            )
        ]

    return calibrate_parameter(
        releases,
        target_epsilon=target_epsilon,
        target_delta=delta,
        accountant="pld",
        neighboring="add-or-remove-one",
    )


def least_error_separation(
    *,
    rounds: int,
    cohort: int,
    group_sizes: dict[int, int],
    target_epsilon: float,
    delta: float,
    momentum: float = 0.0,
    bands: int = 0,
) -> SeparationChoice:
    """The b among ``group_sizes`` (b -> its smallest group) with the least error at ε.

    Every input is public (n, m, the groups' sizes, ε, δ, the workload), so the choice
    costs no privacy (Choquette-Choo, McMahan et al. 2023 and jax-privacy's
    ``optimize_coefs_for_amplifications`` choose the same way). ``bands`` > 0 caps C's
    bands at min(bands, b); b = 1 is DP-FedAvg with Poisson sampling (C = I).
    """
    n, m = _positive_int("rounds", rounds), _positive_int("cohort", cohort)
    sweep = []
    for b, size in sorted(group_sizes.items()):
        if _positive_int("b", b) > n or size < m:
            continue  # more groups than rounds, or a group smaller than the cohort
        z = amplified_noise_multiplier(
            target_epsilon=target_epsilon,
            delta=delta,
            cohort=m,
            group_size=size,
            participations=math.ceil(n / b),
        )
        decoder = optimize_banded(n, min(bands or b, b), momentum=momentum).decoder()
        sweep.append((b, m / size, z, prefix_sum_error(decoder, noise_std=z)))
    if not sweep:
        raise FactorizationError(
            f"no b has groups of at least the cohort m = {m} within n = {n} rounds "
            f"(candidates: {sorted(group_sizes)})"
        )
    best = min(sweep, key=lambda row: row[3])
    return SeparationChoice(best[0], tuple(sweep))
