"""subspace-dp's start-up checks against the task (server_app/subspace_setup.py)."""

from __future__ import annotations

import numpy as np
import pytest

from config.options import ConfigError
from server_app import config, subspace_setup
from strategies import registry
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


class _Public:
    """A task's public split: per-example gradients along the first two coordinates."""

    def public_gradients(self, model, keys, labels=None):
        return np.diag([3.0, 2.0, 0.0, 0.0])[:3]  # 3 examples x d = 4


@pytest.mark.parametrize(("init", "has_basis"), [("public", True), ("isotropic", False)])
def test_the_public_basis_follows_the_wrappers_init(init, has_basis):
    run = {**pyproject_defaults(), "privacy": "subspace-dp", "dp.noise-multiplier": 1.0}
    run |= {"subspace.init": init, "subspace.warm-start": 1, "subspace.rank": 2}
    cfg = config.load(run)
    strategy = registry.build("subspace-dp", cfg.strategy_settings())
    assert strategy.init == init  # the set-up reads the built wrapper, not the options
    subspace_setup.prepare(cfg, _Public(), None, strategy, ["w"])
    basis = strategy.initial_basis
    assert (basis is not None) == has_basis
    if has_basis:  # the top-2 subspace: the first two coordinate axes
        np.testing.assert_allclose(np.abs(basis), np.eye(4)[:, :2], atol=1e-12)
