"""``bench/lunar_lands.py outcomes``: how a run's final policies' episodes end, on a hand-made
run directory (a FedAvg run's config and global checkpoint) and hand-made tables."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from bench import lunar_lands
from tasks.lunar_lander import LunarLanderTask
from tasks.lunar_lander.ppo import evaluate_episodes

CONFIG = {
    "task": "lunar-lander",
    "strategy": "fedavg",
    "seed": 4,
    "ppo.derived-per-base": 0,
    "ppo.eval-episodes": 20,
}


def test_run_outcomes_plays_the_global_model_on_the_central_episodes(tmp_path):
    # Prepare: a FedAvg run whose global model is an untrained policy
    task = LunarLanderTask(CONFIG)
    model = task.build_model(1)
    (tmp_path / "checkpoint").mkdir()
    torch.save(model.state_dict(), tmp_path / "checkpoint" / "global.pt")
    (tmp_path / "config.json").write_text(json.dumps({"run-config": CONFIG}))

    # Execute: 3 episodes per planet and policy
    table = lunar_lands.run_outcomes(tmp_path, episodes=3)

    # Assert: every planet both ways; the counts add up to the episodes; the most
    # likely actions' rewards are the first 3 episodes of the run's own evaluation
    assert len(table) == 6 and set(table["policy"]) == {"most-likely", "sampled"}
    assert (table[["crashed", "at-rest", "time-limit"]].sum(axis=1) == 3).all()
    short = LunarLanderTask(CONFIG | {"ppo.eval-episodes": 3})
    for index, client in enumerate(short.load_central_test()):
        returns, _ = evaluate_episodes(model, client, task.eval_seeds(index)[:3])
        row = table[(table["planet"] == client.planet) & (table["policy"] == "most-likely")]
        assert row["reward"].item() == pytest.approx(np.mean(returns))
        assert row["se"].item() == pytest.approx(np.std(returns, ddof=1) / np.sqrt(3))


def test_totals_sum_outcomes_over_seeds_and_average_rewards():
    table = pd.DataFrame(
        {
            "experiment": "fl",
            "seed": [0, 1, 0],
            "planet": ["moon", "moon", "earth"],
            "policy": "most-likely",
            "episodes": 10,
            "reward": [100.0, 200.0, 50.0],
            "se": 1.0,
            "crashed": [2, 3, 10],
            "at-rest": [7, 5, 0],
            "time-limit": [1, 2, 0],
        }
    )

    summed = lunar_lands.totals(table).set_index("planet")

    assert summed.loc["moon", "episodes"] == 20 and summed.loc["moon", "seeds"] == 2
    assert summed.loc["moon", "reward"] == 150.0
    assert summed.loc["moon", ["crashed", "at-rest", "time-limit"]].tolist() == [5, 12, 3]
    assert summed.loc["earth", "crashed"] == 10


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["outcomes", "--runs", "a:0=x", "--episodes", "1"], "--episodes = 1: give 2 or more"),
        (["one-planet", "moon.toml", "--planet", "venus"], "invalid choice: 'venus'"),
        (["--seeds", "0"], "give one of: PRESET.toml files"),
    ],
)
def test_the_study_script_dispatches_its_subcommands(tmp_path, capsys, argv, error):
    # Each subcommand's own parser answers (its own error), the study's arguments are
    # the default; all fail before any run.
    with pytest.raises(SystemExit) as exited:
        lunar_lands.main([*argv, "--out", str(tmp_path)])

    assert exited.value.code == 2 and error in capsys.readouterr().err
