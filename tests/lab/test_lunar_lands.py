"""The statistics of ``bench/lunar_lands.py`` (issue 28's study), on hand-made runs:
Student-t intervals, the stability rule, env steps from participation.csv and the
plain verdict on overlapping intervals."""

from __future__ import annotations

import pandas as pd
import pytest

from bench import lunar_lands


def test_confidence_interval_is_student_t_with_n_minus_1_degrees_of_freedom():
    # Execute
    mean, half = lunar_lands.confidence_interval([1.0, 2.0, 3.0])

    # Assert: sd 1, t(0.975, 2) = 4.302653 (tables), half-width 4.302653 / sqrt(3)
    assert mean == 2.0
    assert half == pytest.approx(4.302653 / 3**0.5, rel=1e-6)
    assert lunar_lands.confidence_interval([5.0])[0] == 5.0


def _rounds(rewards: list[float], name: str = "fl", seed: int = 0) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "experiment": name,
            "seed": seed,
            "strategy": "fedavg",
            "round": range(1, len(rewards) + 1),
            "env-steps": [100 * (r + 1) for r in range(len(rewards))],
            "planet": "moon",
            "reward": rewards,
            "se": 10.0,
        }
    )


def test_stability_measures_the_largest_drop_after_first_reaching_150():
    # Prepare: drops of 100 before 150 is reached do not count; after it, 60 then 20
    rounds = pd.concat([_rounds([120, 20, 160, 100, 190, 170]), _rounds([100, 140], seed=1)])

    # Execute
    table = lunar_lands.stability(rounds).set_index("seed")

    # Assert
    assert table.loc[0, "first-150-round"] == 3
    assert table.loc[0, "max-drop"] == 60.0 and not table.loc[0, "stable"]
    assert table.loc[0, "max-drop-se"] == pytest.approx(200**0.5)  # se 10 in both rounds
    assert pd.isna(table.loc[1, "max-drop"]) and not table.loc[1, "stable"]
    assert pd.isna(table.loc[1, "max-drop-se"])


def test_stability_standard_error_is_that_of_the_largest_drop():
    # Prepare: drops of 30 (se 3 and 4) and 40 (se 6 and 8); nothing drops in seed 1
    rounds = pd.concat([_rounds([200, 170, 190, 150]), _rounds([160, 170], seed=1)])
    rounds["se"] = [1.0, 3.0, 6.0, 8.0, 5.0, 5.0]

    # Execute
    table = lunar_lands.stability(rounds).set_index("seed")

    # Assert: the 40-point drop's, sqrt(36 + 64) = 10
    assert table.loc[0, "max-drop"] == 40.0
    assert table.loc[0, "max-drop-se"] == pytest.approx(10.0)
    assert table.loc[1, "max-drop"] == 0.0 and pd.isna(table.loc[1, "max-drop-se"])


def test_final_table_and_overlap_verdicts():
    # Prepare: FL ends at 200, 210, 220; single agents at 100, 110, 120
    rounds = pd.concat(
        [_rounds([0, 200 + 10 * s], "fl", s) for s in range(3)]
        + [_rounds([0, 100 + 10 * s], "single", s) for s in range(3)]
    )

    # Execute
    final = lunar_lands.final_table(rounds).set_index("experiment")
    verdicts = lunar_lands.overlap_statements(final.reset_index(), "single")

    # Assert: mean 210, sd 10, half-width 4.302653 * 10 / sqrt(3) = 24.8
    assert final.loc["fl", "reward"] == 210.0
    assert final.loc["fl", "ci95"] == pytest.approx(24.84, abs=0.01)
    assert final.loc["fl", "per-seed"] == "200 / 210 / 220" and final.loc["fl", "landed"]
    assert not final.loc["single", "landed"]
    assert verdicts == [
        "fl vs single on moon: 210 ± 25 vs 110 ± 25: better: the intervals do not overlap"
    ]


def test_env_steps_count_the_replies_of_every_round(tmp_path):
    # Prepare
    pd.DataFrame(
        {
            "round": [1, 1, 2, 2],
            "replied": [True, True, True, False],
            "num-examples": [2048, 4096, 1024, 9999],
        }
    ).to_csv(tmp_path / "participation.csv", index=False)

    # Execute
    steps = lunar_lands.env_steps(tmp_path)

    # Assert
    assert steps.to_dict() == {0: 0, 1: 6144, 2: 7168}
