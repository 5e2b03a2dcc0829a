"""Config and data errors stop the ServerApp at start-up, naming what to fix, before a
run directory exists or any client is asked for anything."""

from __future__ import annotations

import pytest

from config.options import ConfigError
from tasks.vision.hub import DatasetUnavailableError
from tests.inprocess import InProcessGrid, run_config, run_server

NODES = [1, 2, 3, 4]


def _start(tmp_path, **overrides):
    config = run_config(**{"output-dir": str(tmp_path / "runs")}, **overrides)
    grid = InProcessGrid(config, NODES)
    try:
        run_server(config, grid)
    finally:
        assert grid.sent == []  # no client was asked anything
        assert not (tmp_path / "runs").exists()  # no run directory was made


def test_missing_data_path(tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(ConfigError, match=r"'finance.data-path' = .*nope.csv': no such file"):
        _start(tmp_path, task="finance", **{"finance.data-path": str(missing)})


def test_wrong_csv_schema(tmp_path):
    table = tmp_path / "table.csv"
    table.write_text("Age,Income\n30,1000\n40,2000\n")
    with pytest.raises(ConfigError, match=r"'finance.data-path' = .*table.csv'.*missing"):
        _start(tmp_path, task="finance", **{"finance.data-path": str(table)})


def test_unknown_names_list_the_valid_values(tmp_path):
    with pytest.raises(ConfigError, match=r"'strategy' = 'fedsgd' is not valid; valid values"):
        _start(tmp_path, strategy="fedsgd")
    with pytest.raises(
        ConfigError,
        match=r"unknown run-config key\(s\): 'fedprox.muu' \(did you mean fedprox.mu\?\)",
    ):
        _start(tmp_path, **{"fedprox.muu": 0.1})


def test_unreachable_dataset(tmp_path):
    # No hub access in CI (and none is assumed): MNIST fails before any work.
    try:
        _start(tmp_path, task="mnist")
    except DatasetUnavailableError as err:
        assert "mnist" in str(err).lower()
    else:
        pytest.skip("the Hugging Face hub is reachable from this machine")
