"""Cost of geometry-aligned DP vs isotropic DP as the update dimension d grows.

For each d, one client update (a single float32 array of d values) is clipped and a
sum is noised, once with the isotropic Gaussian mechanism (L2 clip, N(0, (zC)² I)) and
once with the elliptical one (P-norm clip, N(0, z²C² P⁻¹), P = U Λ Uᵀ + τI with a
rank-k orthonormal U). Both are timed as the median of ``--repeats`` runs; the metric's
construction (a QR of a d×k matrix, done once per PMU adoption, not per round) is not
part of the timing. The table reports ms per operation, the elliptical/isotropic ratio
and ns per coordinate: linear scaling in d means a flat ns/coordinate column.

    python bench/subspace_cost.py --dims 1e4 1e5 1e6 1e7 --rank 32

Peak memory at d = 1e7, k = 32 is about 4 GB (U alone is d·k float64 = 2.6 GB).
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from timing import median_ms  # bench/timing.py (scripts here run with bench/ on sys.path)

from privacy.mechanisms import GaussianMechanism, make_generator
from privacy.subspace import EllipticalGaussianMechanism, SubspaceMetric, uniform_allocation


def orthonormal_basis(dim: int, rank: int, rng: np.random.Generator) -> np.ndarray:
    """A random d×k orthonormal basis (reduced QR, column by column in float64)."""
    q, _ = np.linalg.qr(rng.standard_normal((dim, rank)))
    return q


def measure(dim: int, rank: int, repeats: int) -> dict[str, float]:
    rng = make_generator(0, dim)
    update = [rng.standard_normal(dim).astype(np.float32) * 10.0]
    iso = GaussianMechanism(clip_norm=1.0, noise_multiplier=1.0)
    metric = SubspaceMetric(
        basis=orthonormal_basis(dim, rank, rng), lam=uniform_allocation(rank, 25.0), tau=0.8
    )
    ell = EllipticalGaussianMechanism(metric, clip_norm=1.0, noise_multiplier=1.0)
    row = {"d": dim, "k": rank}
    row["iso clip ms"] = median_ms(lambda: iso.clip(update), repeats)
    row["ell clip ms"] = median_ms(lambda: ell.clip(update), repeats)
    row["iso noise ms"] = median_ms(lambda: iso.noise_sum(update, rng=rng), repeats)
    row["ell noise ms"] = median_ms(lambda: ell.noise_sum(update, rng=rng), repeats)
    iso_total = row["iso clip ms"] + row["iso noise ms"]
    ell_total = row["ell clip ms"] + row["ell noise ms"]
    row["ell/iso"] = ell_total / iso_total
    row["ell ns/coord"] = ell_total * 1e6 / dim
    row["iso ns/coord"] = iso_total * 1e6 / dim
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=float, nargs="+", default=[1e4, 1e5, 1e6, 1e7])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for dim in args.dims:
        rows.append(measure(int(dim), args.rank, args.repeats))
        print(pd.DataFrame(rows[-1:]).to_string(index=False, float_format="%.3g"), flush=True)
    table = pd.DataFrame(rows)
    print()
    print("| " + " | ".join(table.columns) + " |")
    print("|" + " ---: |" * len(table.columns))
    for row in table.itertuples(index=False):
        cells = (f"{v:.3g}" if isinstance(v, float) else str(v) for v in row)
        print("| " + " | ".join(cells) + " |")
    dims = table["d"].to_numpy(float)
    slope = np.polyfit(np.log10(dims), np.log10(table["ell clip ms"] + table["ell noise ms"]), 1)
    print(f"\nlog-log slope of elliptical time vs d: {slope[0]:.2f} (1.0 = linear)")


if __name__ == "__main__":
    main()
