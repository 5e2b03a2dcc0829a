"""The benchmarks' run-config strings (``bench/peer_digits.py``'s ``toml_value``, which
``bench/audit.py`` and ``bench/correlated.py`` use) read back as written by Flower's own
``--run-config`` parser."""

from __future__ import annotations

from flwr.common.config import parse_config_args

from bench.peer_digits import toml_value


def test_run_config_literals_read_back_through_flowers_parser():
    config = {
        "privacy": "dp-fedavg-adaptive",
        "audit.canaries": 100,
        "dp.target-epsilon": 8.0,
        "dp.target-delta": 1e-05,
        "fraction-train": 0.1,
        "audit.flag": True,
        "audit.other-flag": False,
        "output-dir": "/tmp/audit/flwr-runs",
    }
    text = " ".join(f"{key}={toml_value(value)}" for key, value in config.items())
    assert "dp.target-delta=1e-05" in text and "privacy='dp-fedavg-adaptive'" in text
    parsed = parse_config_args([text])
    assert parsed == config
    assert [type(parsed[key]) for key in config] == [type(value) for value in config.values()]
