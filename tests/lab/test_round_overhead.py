"""``bench/round_overhead.py``: the gap it reads from a run directory, and the old
polling it stages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest

from bench import round_overhead
from strategies.runtime import messaging


def test_the_gap_is_each_later_rounds_wall_time_less_its_clients_learning(tmp_path):
    pd.DataFrame(
        {
            "round": [2, 1, 3, 1, 2, 3],  # unsorted, evaluate rows mixed in
            "scope": ["train", "train", "train", "evaluate", "evaluate", "evaluate"],
            "round-seconds": [6.5, 9.0, 7.25, 1.0, 1.0, 1.0],
        }
    ).to_csv(tmp_path / "metrics.csv", index=False)
    pd.DataFrame(
        {"round": [1, 1, 2, 2, 3, 3], "train-seconds": [3.0, 3.0, 3.0, 3.25, 3.5, 3.5]}
    ).to_csv(tmp_path / "participation.csv", index=False)

    gap = round_overhead.gaps(tmp_path)

    # round 1 (Ray's start) is left out; 6.5 - 6.25 and 7.25 - 7.0
    assert gap.index.tolist() == [2, 3]
    assert gap.tolist() == pytest.approx([0.25, 0.25])


def test_the_old_polling_copy_caps_simulated_polls_at_the_deployed_interval(tmp_path):
    staged = round_overhead.stage(tmp_path / "app", old_polling=True)
    spec = importlib.util.spec_from_file_location(
        "old_messaging", staged / "strategies" / "messaging.py"
    )
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)

    assert old.SIMULATION_MAX_POLL == old.MAX_POLL == messaging.MAX_POLL
    assert messaging.SIMULATION_MAX_POLL < messaging.MAX_POLL  # what the bench compares
    shipped = round_overhead.stage(tmp_path / "shipped", old_polling=False)
    shipped_text = (shipped / "strategies" / "messaging.py").read_text()
    assert shipped_text == Path(messaging.__file__).read_text()
