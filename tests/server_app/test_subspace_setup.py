"""subspace-dp's start-up checks against the task (server_app/subspace_setup.py)."""

from __future__ import annotations

import pytest

from config.options import ConfigError
from server_app import config, subspace_setup
from tasks.vision import DigitsTask
from tests.inprocess import pyproject_defaults

FAIR = {
    "privacy": "subspace-dp",
    "subspace.allocation": "fairness",
    "subspace.warm-start": 1,
    "subspace.head-only": True,
    "dp.noise-multiplier": 1.0,
}


def test_fairness_allocation_needs_two_label_groups():
    run_config = {**pyproject_defaults(), **FAIR}
    with pytest.raises(ConfigError, match=r"'vision\.grouping'.*'low-high'"):
        subspace_setup.check(config.load(run_config), DigitsTask(run_config))
    grouped = {**run_config, "vision.grouping": "low-high"}
    subspace_setup.check(config.load(grouped), DigitsTask(grouped))


def test_allocation_without_public_data_is_refused_at_load():
    run_config = {**pyproject_defaults(), **FAIR, "subspace.warm-start": 0}
    with pytest.raises(ConfigError, match=r"'subspace\.allocation' = 'fairness' needs public"):
        config.load(run_config)
