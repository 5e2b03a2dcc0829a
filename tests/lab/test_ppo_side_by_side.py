"""``bench/ppo_side_by_side.py``'s arithmetic: the speedometer's speed within a window,
each process's share of a core from its ``/proc`` snapshots, and a run's window."""

from __future__ import annotations

import json
import os
from datetime import datetime

import pandas as pd
import pytest

from bench import ppo_side_by_side


def test_rate_within_counts_the_learning_between_rollouts_of_one_chunk_in_the_window():
    # Prepare: (chunk, wall time, env steps) at each rollout's start
    marks = [
        (1, 10.0, 0),
        (1, 11.0, 2048),
        (1, 12.0, 4096),  # chunk 1's last mark: 12.0 -> 12.5 builds chunk 2's PPO
        (2, 12.5, 0),
        (2, 13.5, 2048),
        (2, 15.0, 4096),  # ends after the window
    ]

    # Execute
    steps, seconds = ppo_side_by_side.rate_within(marks, 10.5, 14.0)

    # Assert: 11 -> 12 and 12.5 -> 13.5, 2048 steps each
    assert steps == 4096
    assert seconds == pytest.approx(2.0)


def test_cpu_shares_are_each_names_cpu_time_over_the_window():
    # Prepare: snapshots of (name, user + system clock ticks) per pid
    tick = os.sysconf("SC_CLK_TCK")
    snapshots = [
        (0.5, {"1": ("ray::ClientAppActor", 0)}),  # before the window
        (1.0, {"1": ("ray::ClientAppActor", 0), "2": ("raylet", 0), "3": ("raylet", 7)}),
        (2.0, {"1": ("ray::ClientAppActor", tick)}),
        (
            3.0,
            {
                "1": ("ray::ClientAppActor", 19 * tick // 10),
                "2": ("raylet", tick // 10),
                "3": ("raylet", 7 + tick // 10),
                "4": ("flower-superlink", 50),  # not alive at the window's first snapshot
            },
        ),
        (4.0, {"1": ("ray::ClientAppActor", 10 * tick)}),  # after the window
    ]

    # Execute
    shares = ppo_side_by_side.cpu_shares(snapshots, 0.9, 3.5)

    # Assert: over the 2 s from 1.0 to 3.0, busiest first
    assert shares == pytest.approx({"ray::ClientAppActor": 0.95, "raylet": 0.1})
    assert list(shares) == ["ray::ClientAppActor", "raylet"]
    assert ppo_side_by_side.cpu_shares(snapshots, 1.5, 2.5) == {}  # one snapshot: none


def test_window_runs_from_round_1s_training_to_the_last_rounds(tmp_path):
    # Prepare: a run directory's config and metrics (other scopes interleaved)
    started = "2026-11-27T22:00:00+00:00"
    (tmp_path / "config.json").write_text(json.dumps({"started-at": started}))
    pd.DataFrame(
        {
            "round": [1, 1, 2, 2, 3],
            "scope": ["train", "evaluate", "train", "evaluate", "train"],
            "elapsed-s": [10.0, 11.0, 20.0, 21.0, 30.5],
        }
    ).to_csv(tmp_path / "metrics.csv", index=False)

    # Execute
    start, end = ppo_side_by_side.window(tmp_path)

    # Assert
    origin = datetime.fromisoformat(started).timestamp()
    assert (start - origin, end - origin) == pytest.approx((10.0, 30.5))
