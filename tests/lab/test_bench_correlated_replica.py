"""``bench/correlated.py replica`` and ``theory``: the training replica and the noise in
its models run against the app's current ``privacy.correlated``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def correlated():
    sys.path.insert(0, str(BENCH))  # the script imports bench/peer_digits.py as `peer_digits`
    try:
        import correlated

        yield correlated
    finally:
        sys.path.remove(str(BENCH))


def _row(table: str) -> list[float]:
    return [float(cell) for cell in table.splitlines()[2].strip("|").split("|")]


def test_theory_of_independent_noise_without_momentum_is_a_random_walk(correlated):
    # C = I, no momentum, n = 25 rounds, every client in every round (separation 1, so
    # k = 25 participations, sensitivity sqrt(25) = 5): the model's noise at round t is a
    # sum of t + 1 draws of std z, so its sd is z sqrt(t + 1), its rms over rounds is
    # z sqrt(mean(1..25)) = z sqrt(13), at round n 5 z, a round's change z, and the
    # correlation of rounds t and t + d is sqrt((t + 1) / (t + d + 1)).
    from privacy import correlated as cr

    row = _row(correlated.theory(rounds=25, separation=1, momentum=0.0, eps=2.0, bands=(1,)))
    z = cr.calibrate(target_epsilon=2.0, sensitivity=5.0, delta=1e-5)

    def lag(d: int) -> float:
        return sum(math.sqrt((t + 1) / (t + d + 1)) for t in range(25 - d)) / (25 - d)

    expected = [1, z, z, z * math.sqrt(13), 5 * z, z, lag(1), lag(5), lag(20)]
    decimals = [0, 3, 2, 1, 1, 2, 3, 3, 3]  # the table's own rounding, column by column
    assert row == [round(value, places) for value, places in zip(expected, decimals, strict=True)]
    # (0.2182 + 0.3015 + 0.3612 + 0.4082 + 0.4472) / 5: sqrt(1/21) .. sqrt(5/25)
    assert lag(20) == pytest.approx(0.3473, abs=1e-4)


def test_theory_subcommand_prints_the_studys_table(correlated, capsys):
    # The study's table (ε = 2, momentum 0.5, 60 rounds, separation 20): C = I's row and
    # the 20-band row, as recorded before the replica moved into bench/correlated.py.
    assert correlated.cli(["theory"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| 1 | 3.453 | 3.45 | 37.1 | 52.8 | 3.99 | 0.995 | 0.950 | 0.779 |"
    assert lines[-1] == "| 20 | 3.453 | 8.15 | 13.1 | 16.4 | 6.89 | 0.879 | 0.674 | 0.609 |"


def test_replica_run_reproduces_the_replaced_script(correlated):
    # The linear model, 20 bands, seed 0: 101 of the 360 held-out digits, as the script
    # bench/correlated_dynamics.py (folded into this subcommand) gave.
    assert correlated.replica_run(20, 0, model="linear") * 360 == pytest.approx(101)


def test_replica_needs_two_seeds_for_its_spread(correlated, capsys):
    with pytest.raises(SystemExit) as exited:
        correlated.cli(["replica", "--seeds", "1"])
    assert exited.value.code == 2
    assert "--seeds 1: the spread needs at least 2 seeds" in capsys.readouterr().err
