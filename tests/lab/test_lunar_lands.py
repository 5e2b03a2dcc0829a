"""The statistics of ``bench/lunar_lands.py`` (federated PPO that lands), on hand-made runs:
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


def test_central_rewards_take_the_se_of_the_cluster_model_picked_per_planet(tmp_path):
    # Prepare: a clustered run's metrics.csv as written before the SE followed the
    # picked model (plain SE columns: the largest of the two); round 0 has no clusters
    planets = {"moon": (120.0, 4.0, 230.0, 30.0), "earth": (210.0, 5.0, 90.0, 40.0)}
    planets["mars"] = (200.0, 6.0, 199.0, 7.0)
    row = {"round": 1, "scope": "central-eval"}
    for planet, (r0, se0, r1, se1) in planets.items():
        row |= {f"cluster-0-eval-reward-{planet}": r0, f"cluster-0-eval-reward-se-{planet}": se0}
        row |= {f"cluster-1-eval-reward-{planet}": r1, f"cluster-1-eval-reward-se-{planet}": se1}
        row |= {f"eval-reward-{planet}": max(r0, r1), f"eval-reward-se-{planet}": max(se0, se1)}
    first = {"round": 0, "scope": "central-eval"}
    first |= {f"eval-reward-{p}": -150.0 for p in planets}
    first |= {f"eval-reward-se-{p}": 9.0 for p in planets}
    pd.DataFrame([first, row]).to_csv(tmp_path / "metrics.csv", index=False)

    # Execute
    rewards = lunar_lands.central_rewards(tmp_path).set_index(["round", "planet"])

    # Assert: each planet's best model, with that model's SE
    assert rewards.loc[(1, "moon"), "reward"] == 230.0 and rewards.loc[(1, "moon"), "se"] == 30.0
    assert rewards.loc[(1, "earth"), "reward"] == 210.0 and rewards.loc[(1, "earth"), "se"] == 5.0
    assert rewards.loc[(1, "mars"), "reward"] == 200.0 and rewards.loc[(1, "mars"), "se"] == 6.0
    assert rewards.loc[(0, "moon"), "reward"] == -150.0 and rewards.loc[(0, "moon"), "se"] == 9.0


def test_kept_snapshot_is_the_last_logged_of_the_latest_round():
    # Prepare: round 2 ends with an in-rollout snapshot and the training-end one at the
    # same step (rows 3 and 4, logged in that order); round 1's rows come after them
    snapshots = pd.DataFrame(
        {"server_round": [2, 2, 2, 2, 1, 1], "step": [10, 20, 30, 30, 5, 9]},
        index=[7, 8, 3, 4, 5, 6],
    )

    # Execute / Assert: the training-end snapshot of round 2
    assert lunar_lands.kept_snapshot(snapshots) == 4
    assert lunar_lands.kept_snapshot(snapshots[snapshots["server_round"] == 1]) == 6
