"""``bench/correlated.py``'s sweep over the amplified schema's b and the app's own
least-error choice (``correlated.choose-separation``) agree: same b, same z and error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from privacy import correlated as cr

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cr.CACHE_ENV, str(tmp_path))


def test_the_benchs_sweep_is_the_apps_least_error_choice():
    sys.path.insert(0, str(BENCH))  # the script imports bench/peer_digits.py as a module
    try:
        import correlated as bench
    finally:
        sys.path.remove(str(BENCH))
    # N = 8 clients, m = 2 a round, n = 6 rounds: b in 1..4, groups of 8 // b
    best, errors = bench.best_amplified_groups(3.0, rounds=6, clients=8, cohort=2)
    app = cr.least_error_separation(
        rounds=6, cohort=2, group_sizes={b: 8 // b for b in range(1, 5)},
        target_epsilon=3.0, delta=1e-5,
    )  # fmt: skip
    assert app.separation == best
    assert [(b, z, e) for b, _, z, e in app.sweep] == pytest.approx(
        [(b, z, e) for b, (z, e) in errors.items()], rel=1e-9
    )
