"""The ServerApp asks the strategy what it can do; it never branches on its name."""

from __future__ import annotations

import ast
from pathlib import Path

from flwr.serverapp.strategy import FedAvg

import strategies
from server_app import config
from strategies.algorithms.local import LocalOnly
from strategies.runtime.capabilities import NoGlobalModel, innermost, provides
from tests.inprocess import run_config

APP = Path(__file__).resolve().parents[2] / "server_app" / "app.py"


def test_server_app_compares_no_strategy_name():
    compared = [
        ast.unparse(node)
        for node in ast.walk(ast.parse(APP.read_text()))
        if isinstance(node, ast.Compare) and "strategy" in ast.unparse(node)
    ]
    assert compared == []


def test_only_local_training_keeps_no_global_model():
    assert provides(LocalOnly(), NoGlobalModel)
    assert "central evaluation is skipped" in LocalOnly.NO_GLOBAL_MODEL
    assert not provides(FedAvg(), NoGlobalModel)


def _built(**overrides):
    cfg = config.load(run_config(**overrides))
    return strategies.build(cfg.privacy, cfg.strategy_settings())


def test_the_app_finds_it_inside_the_wrappers_the_registry_adds():
    assert provides(innermost(_built(strategy="local")), NoGlobalModel)
    assert not provides(innermost(_built(strategy="fedavg")), NoGlobalModel)
